/* logprob: fh_logprob_* against the double reference (ref/logprob_case.c, tolerances there): temperatures 0.3, 1 and
 * 2.5, the entropy and lse gradients on and off, ignored tokens, softcap and logit_scale, both layouts, forward +
 * backward and the single call (row blocks, and the streaming fallback under a small budget), edge tiles, beta 1,
 * fp32 and bf16 (bf16 gradients, fp32 dU); and the call contract. */
#include "logprob_case.h"
#include "test_util.h"

#include <math.h>
#include <string.h>

static void check(const logprob_case_spec *s, const char *what)
{
    logprob_diff d;
    const fh_status st = logprob_case_run(s, &d);
    TU_CHECK(st == FH_OK, "%s: status %d (%s)", what, (int)st, fh_status_string(st));
    if (st != FH_OK)
        return;
    TU_CHECK(logprob_diff_pass(&d),
             "%s (T %g, softcap %g, scale %g, %s, %s, g_entropy %d, g_lse %d, dtype %d): logp %.2e entropy %.2e "
             "lse %.2e (tol %.1e), dx %.2e dW %.2e db %.2e (tol %.1e / %.1e), ignored rows clean %d",
             what, s->options.temperature, s->options.softcap, s->options.logit_scale,
             s->layout == FH_LAYOUT_HV ? "hv" : "vh", s->train_step ? "train step" : "forward+backward", s->g_entropy,
             s->g_lse, (int)s->dtype, d.logp_max_abs, d.entropy_max_abs, d.lse_max_abs, d.value_tol,
             d.dhidden_norm_rel, d.dweight_norm_rel, d.dbias_norm_rel, d.grad_tol, d.dbias_tol,
             d.ignored_outputs_zero);
}

/* Every temperature x entropy gradient x layout x call style, fp32 and bf16. */
static void test_temperatures_gradients_layouts(void)
{
    static const double temperatures[] = {0.3, 1.0, 2.5};
    for (int dtype = 0; dtype <= 1; dtype++)
        for (size_t t = 0; t < TU_COUNT(temperatures); t++)
            for (int entropy = 0; entropy <= 1; entropy++)
                for (int layout = 0; layout <= 1; layout++)
                    for (int step = 0; step <= 1; step++) {
                        logprob_case_spec s;
                        logprob_case_spec_default(&s);
                        s.options.temperature = temperatures[t];
                        s.g_entropy = entropy;
                        s.g_lse = step;
                        s.layout = (fh_layout)layout;
                        s.train_step = step;
                        s.dtype = (fh_dtype)dtype;
                        s.seed = 10 + t * 8 + (size_t)(entropy * 4 + layout * 2 + step);
                        check(&s, "temperature, entropy gradient, layout, call");
                    }
}

/* softcap and logit_scale (alone and together), every token ignored, no token ignored. */
static void test_transforms_and_ignored(void)
{
    static const double caps[][2] = {{5.0, 1.0}, {0.0, 0.5}, {5.0, 0.5}, {30.0, 2.0}};
    for (size_t k = 0; k < TU_COUNT(caps); k++)
        for (int step = 0; step <= 1; step++) {
            logprob_case_spec s;
            logprob_case_spec_default(&s);
            s.options.softcap = caps[k][0];
            s.options.logit_scale = caps[k][1];
            s.options.temperature = 0.7;
            s.train_step = step;
            s.seed = 40 + k;
            check(&s, "softcap and logit_scale");
        }
    static const double fractions[] = {0.0, 1.0};
    for (size_t k = 0; k < TU_COUNT(fractions); k++) {
        logprob_case_spec s;
        logprob_case_spec_default(&s);
        s.ignore_frac = fractions[k];
        s.train_step = (int)k;
        check(&s, fractions[k] > 0.0 ? "every token ignored" : "no token ignored");
    }
    logprob_case_spec s;
    logprob_case_spec_default(&s);
    s.options.ignore_index = 0; /* an ignore_index inside [0, V): those rows still get zeros */
    s.ignore_frac = 0.3;
    check(&s, "ignore_index 0");
}

/* Edge tiles, several row blocks, the streaming fallback, beta 1, one thread; bf16 gradients and fp32 dU. */
static void test_schedules(void)
{
    for (int dtype = 0; dtype <= 1; dtype++) {
        logprob_case_spec s;
        logprob_case_spec_default(&s);
        s.dtype = (fh_dtype)dtype;
        s.tile_rows = 13;
        s.tile_vocab = 127;
        check(&s, "streaming, edge tiles");
        s.train_step = 1;
        s.tile_vocab = 0;
        check(&s, "train step, eight row blocks");
        s.tile_rows = 0;
        s.budget = 200000;
        check(&s, "train step, streaming fallback under a small budget");
        s.budget = 0;
        s.grad_beta = 1.0f;
        s.threads = 1;
        check(&s, "train step, beta 1, one thread");
    }
    for (int step = 0; step <= 1; step++) {
        logprob_case_spec s;
        logprob_case_spec_default(&s);
        s.dtype = s.grad_dtype = FH_DTYPE_BF16;
        s.train_step = step;
        check(&s, "bf16 gradients");
        s.grad_dtype = FH_DTYPE_F32;
        s.fp32_du = 1;
        check(&s, "bf16 inputs, fp32 dU");
    }
}

/* Bad arguments: each refused with its status, outputs untouched. */
static void test_contract(void)
{
    enum { N = 5, H = 3, V = 11 };
    float x[N * H], w[V * H], lse[N], g[N], out_logp[N], dx[N * H];
    for (size_t i = 0; i < N * H; i++)
        x[i] = 0.1f * (float)i;
    for (size_t i = 0; i < V * H; i++)
        w[i] = 0.05f * (float)(i % 7);
    for (size_t i = 0; i < N; i++)
        lse[i] = g[i] = 1.0f;
    int64_t targets[N] = {1, 2, -100, 4, 5};
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
    fh_context *ctx = tu_context(1, 0, 0, 0);
    fh_logprob_options o;
    TU_CHECK(fh_logprob_options_init(&o) == FH_OK && o.ignore_index == -100 && o.temperature == 1.0 &&
                 o.softcap == 0.0 && o.logit_scale == 1.0,
             "fh_logprob_options_init defaults");
    TU_CHECK(fh_logprob_options_init(NULL) == FH_ERR_NULL_POINTER, "options_init(NULL)");
    fh_logprob_outputs out = {out_logp, NULL, NULL};
    fh_linear_grads grads = {.dx = dx, .dx_row_stride = H};
    struct {
        const char *what;
        double temperature, softcap, logit_scale;
        int64_t bad_target;
        fh_status expected;
    } cases[] = {{"temperature 0", 0.0, 0.0, 1.0, 1, FH_ERR_INVALID_TEMPERATURE},
                 {"temperature NaN", NAN, 0.0, 1.0, 1, FH_ERR_INVALID_TEMPERATURE},
                 {"softcap -1", 1.0, -1.0, 1.0, 1, FH_ERR_INVALID_SOFTCAP},
                 {"logit_scale 0", 1.0, 0.0, 0.0, 1, FH_ERR_INVALID_LOGIT_SCALE},
                 {"logit_scale inf", 1.0, 0.0, INFINITY, 1, FH_ERR_INVALID_LOGIT_SCALE},
                 {"softcap / logit_scale beyond fp32", 1.0, 1e30, 1e-20, 1, FH_ERR_INVALID_LOGIT_SCALE},
                 {"target V", 1.0, 0.0, 1.0, V, FH_ERR_TARGET_OUT_OF_RANGE},
                 {"target -1", 1.0, 0.0, 1.0, -1, FH_ERR_TARGET_OUT_OF_RANGE}};
    for (size_t k = 0; k < TU_COUNT(cases); k++) {
        fh_logprob_options bad = o;
        bad.temperature = cases[k].temperature;
        bad.softcap = cases[k].softcap;
        bad.logit_scale = cases[k].logit_scale;
        targets[0] = cases[k].bad_target;
        for (int call = 0; call < 3; call++) {
            tu_fill_canary(out_logp, sizeof out_logp);
            tu_fill_canary(dx, sizeof dx);
            const fh_status st = call == 0   ? fh_logprob_forward(ctx, &lin, targets, &bad, &out)
                                 : call == 1 ? fh_logprob_backward(ctx, &lin, targets, &bad, lse, NULL, g, NULL,
                                                                   NULL, &grads)
                                             : fh_logprob_forward_backward(ctx, &lin, targets, &bad, g, NULL, NULL,
                                                                           &out, &grads);
            unsigned char canary[sizeof dx];
            memset(canary, TU_CANARY, sizeof canary);
            TU_CHECK(st == cases[k].expected && memcmp(dx, canary, sizeof dx) == 0 &&
                         memcmp(out_logp, canary, sizeof out_logp) == 0,
                     "%s, call %d: status %d, expected %d, outputs untouched", cases[k].what, call, (int)st,
                     (int)cases[k].expected);
        }
    }
    targets[0] = 1;
    float g_bad[N] = {1.0f, NAN, 1.0f, 1.0f, 1.0f};
    TU_CHECK(fh_logprob_backward(ctx, &lin, targets, &o, lse, NULL, g_bad, NULL, NULL, &grads) ==
                 FH_ERR_INVALID_GRAD_OUTPUT,
             "a NaN g_logp");
    TU_CHECK(fh_logprob_backward(ctx, &lin, targets, &o, NULL, NULL, g, NULL, NULL, &grads) == FH_ERR_NULL_POINTER,
             "backward without lse");
    TU_CHECK(fh_logprob_backward(ctx, &lin, targets, &o, lse, NULL, g, g, NULL, &grads) == FH_ERR_NULL_POINTER,
             "g_entropy without the saved entropy");
    TU_CHECK(fh_logprob_forward(ctx, &lin, targets, &o, NULL) == FH_ERR_NULL_POINTER, "forward without outputs");
    TU_CHECK(fh_logprob_forward_backward(ctx, &lin, targets, &o, g, NULL, NULL, &out, &grads) == FH_OK,
             "a valid single call");
    fh_linear_grads overlapping = {.dx = (void *)g, .dx_row_stride = H};
    TU_CHECK(fh_logprob_forward_backward(ctx, &lin, targets, &o, g, NULL, NULL, &out, &overlapping) ==
                 FH_ERR_OVERLAPPING_BUFFERS,
             "dx over g_logp");
    size_t bytes = 0;
    TU_CHECK(fh_logprob_workspace_size(ctx, &lin, &bytes) == FH_OK && bytes > 0, "workspace size");
    /* No gradient asked for at all: the single call is the forward and writes zeros nowhere. */
    float logp_only[N];
    fh_logprob_outputs only = {logp_only, NULL, NULL};
    TU_CHECK(fh_logprob_forward(ctx, &lin, targets, &o, &only) == FH_OK && logp_only[2] == 0.0f &&
                 logp_only[0] < 0.0f,
             "forward: an ignored token's logp is 0, a counted one's negative");
    fh_context_destroy(ctx);
}

static const tu_test tests[] = {
    {"temperatures, entropy gradient, layouts, calls, fp32 and bf16", test_temperatures_gradients_layouts},
    {"softcap, logit_scale and ignored tokens", test_transforms_and_ignored},
    {"schedules, tiles, beta 1, bf16 gradients and fp32 dU", test_schedules},
    {"call contract", test_contract},
};
const tu_suite suite_logprob = {tests, TU_COUNT(tests)};
