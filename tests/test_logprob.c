/* logprob: fh_logprob_* against the double reference (tests/cases/logprob_case.c, tolerances there): temperatures 0.3, 1 and
 * 2.5, the entropy and lse gradients on and off, ignored tokens, softcap and logit_scale, both layouts, forward +
 * backward and the single call (row blocks, and the streaming fallback under a small budget), edge tiles, beta 1,
 * fp32 and bf16 (bf16 gradients, fp32 dU); and the call contract. */
#include "bf16.h"
#include "logprob_harness.h"
#include "rng.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
                        lp_check_spec(&s, "temperature, entropy gradient, layout, call");
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
            lp_check_spec(&s, "softcap and logit_scale");
        }
    static const double fractions[] = {0.0, 1.0};
    for (size_t k = 0; k < TU_COUNT(fractions); k++) {
        logprob_case_spec s;
        logprob_case_spec_default(&s);
        s.ignore_frac = fractions[k];
        s.train_step = (int)k;
        lp_check_spec(&s, fractions[k] > 0.0 ? "every token ignored" : "no token ignored");
    }
    logprob_case_spec s;
    logprob_case_spec_default(&s);
    s.options.ignore_index = 0; /* an ignore_index inside [0, V): those rows still get zeros */
    s.ignore_frac = 0.3;
    lp_check_spec(&s, "ignore_index 0");
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
        lp_check_spec(&s, "streaming, edge tiles");
        s.train_step = 1;
        s.tile_vocab = 0;
        lp_check_spec(&s, "train step, eight row blocks");
        s.tile_rows = 0;
        s.budget = 200000;
        lp_check_spec(&s, "train step, streaming fallback under a small budget");
        s.budget = 0;
        s.grad_beta = 1.0f;
        s.threads = 1;
        lp_check_spec(&s, "train step, beta 1, one thread");
    }
    for (int step = 0; step <= 1; step++) {
        logprob_case_spec s;
        logprob_case_spec_default(&s);
        s.dtype = s.grad_dtype = FH_DTYPE_BF16;
        s.train_step = step;
        lp_check_spec(&s, "bf16 gradients");
        s.grad_dtype = FH_DTYPE_F32;
        s.fp32_du = 1;
        lp_check_spec(&s, "bf16 inputs, fp32 dU");
    }
}

/* One call of the log-prob head on a problem with prompt-like runs of ignored rows: logp, entropy, lse and the
 * gradients, on a context with the library's workspace (ignored rows compacted away) or with a caller's (where the
 * library allocates nothing, so every row runs its GEMMs). */
typedef struct counted_case {
    int64_t n, h, v;
    float *x, *w, *b, *g[3], *values, *grads[3];
    uint16_t *xb, *wb;
    int64_t *targets;
} counted_case;

static void counted_run(counted_case *k, int bf16, int train_step, float beta, int callers_workspace)
{
    const int64_t n = k->n, h = k->h, v = k->v;
    fh_linear lin;
    fh_linear_init(&lin, n, h, v, bf16 ? (const void *)k->xb : k->x, bf16 ? (const void *)k->wb : k->w, FH_LAYOUT_VH,
                   k->b);
    lin.x_dtype = lin.weight_dtype = bf16 ? FH_DTYPE_BF16 : FH_DTYPE_F32;
    fh_context *ctx = tu_context(2, 0, 0, 0);
    void *workspace = NULL;
    size_t bytes = 0;
    if (callers_workspace) {
        TU_CHECK(fh_logprob_workspace_size(ctx, &lin, &bytes) == FH_OK, "workspace size");
        workspace = tu_alloc(bytes, 1);
        TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
    }
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = 0.8;
    const size_t counts[3] = {(size_t)(n * h), (size_t)(h * v), (size_t)v};
    for (int j = 0; j < 3; j++)
        for (size_t e = 0; e < counts[j]; e++)
            k->grads[j][e] = beta != 0.0f ? 0.25f * (float)(e % 7) : NAN;
    fh_linear_grads g = {.dx = k->grads[0], .dx_row_stride = h, .dx_beta = beta, .dweight = k->grads[1],
                         .dweight_beta = beta, .dbias = k->grads[2], .dbias_beta = beta};
    fh_logprob_outputs out = {k->values, k->values + n, k->values + 2 * n};
    fh_status st;
    if (train_step) {
        st = fh_logprob_forward_backward(ctx, &lin, k->targets, &o, k->g[0], k->g[1], k->g[2], &out, &g);
    } else {
        st = fh_logprob_forward(ctx, &lin, k->targets, &o, &out);
        if (st == FH_OK)
            st = fh_logprob_backward(ctx, &lin, k->targets, &o, out.lse, out.entropy, k->g[0], k->g[1], k->g[2], &g);
    }
    TU_CHECK(st == FH_OK, "counted rows call: status %d", (int)st);
    fh_context_destroy(ctx);
    free(workspace);
}

/* Skipping the ignored rows changes no per-row result: logp, entropy, lse and dx are bit for bit those of the call
 * that runs every row; dweight and dbias sum the same terms grouped over fewer rows (the GEMMs' blocking), so they
 * agree to fp32 summation order: 1e-6 normwise (measured <= 2e-7). */
static void test_counted_rows_bit_for_bit(void)
{
    counted_case k = {.n = 160, .h = 48, .v = 1500};
    const int64_t n = k.n, h = k.h, v = k.v;
    uint64_t rng = 77;
    k.x = tu_alloc((size_t)(n * h), sizeof(float));
    k.w = tu_alloc((size_t)(h * v), sizeof(float));
    k.b = tu_alloc((size_t)v, sizeof(float));
    tu_fill_uniform(k.x, (size_t)(n * h), &rng, -1.0, 1.0);
    tu_fill_uniform(k.w, (size_t)(h * v), &rng, -0.3, 0.3);
    tu_fill_uniform(k.b, (size_t)v, &rng, -0.2, 0.2);
    k.xb = tu_alloc((size_t)(n * h), sizeof(uint16_t));
    k.wb = tu_alloc((size_t)(h * v), sizeof(uint16_t));
    for (int64_t e = 0; e < n * h; e++)
        k.xb[e] = bf16_from_float(k.x[e]);
    for (int64_t e = 0; e < h * v; e++)
        k.wb[e] = bf16_from_float(k.w[e]);
    k.targets = tu_alloc((size_t)n, sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) /* sequences of 40: a 20-token prompt, then the completion */
        k.targets[i] = i % 40 < 20 ? -100 : (i * 37) % v;
    k.targets[25] = k.targets[103] = -100; /* and scattered ones */
    for (int j = 0; j < 3; j++) {
        k.g[j] = tu_alloc((size_t)n, sizeof(float));
        tu_fill_uniform(k.g[j], (size_t)n, &rng, -1.0, 1.0);
    }
    const size_t counts[3] = {(size_t)(n * h), (size_t)(h * v), (size_t)v};
    float *values[2], *grads[2][3];
    for (int run = 0; run < 2; run++) {
        values[run] = tu_alloc((size_t)(3 * n), sizeof(float));
        for (int j = 0; j < 3; j++)
            grads[run][j] = tu_alloc(counts[j], sizeof(float));
    }
    for (int bf16 = 0; bf16 <= 1; bf16++)
        for (int step = 0; step <= 1; step++)
            for (int beta = 0; beta <= 1; beta++) {
                for (int run = 0; run < 2; run++) {
                    k.values = values[run];
                    memcpy(k.grads, grads[run], sizeof k.grads);
                    counted_run(&k, bf16, step, (float)beta, run);
                }
                const int same_values = memcmp(values[0], values[1], (size_t)(3 * n) * sizeof(float)) == 0;
                const int same_dx = memcmp(grads[0][0], grads[1][0], counts[0] * sizeof(float)) == 0;
                double worst = 0.0;
                for (int j = 1; j < 3; j++)
                    worst = fmax(worst, tu_norm_rel_f(grads[0][j], grads[1][j], counts[j]));
                TU_CHECK(same_values && same_dx && worst <= 1e-6,
                         "counted rows (bf16 %d, train step %d, beta %d): values identical %d, dx identical %d, "
                         "dweight/dbias %.2e normwise",
                         bf16, step, beta, same_values, same_dx, worst);
            }
    for (int run = 0; run < 2; run++) {
        free(values[run]);
        for (int j = 0; j < 3; j++)
            free(grads[run][j]);
    }
    for (int j = 0; j < 3; j++)
        free(k.g[j]);
    free(k.x);
    free(k.w);
    free(k.b);
    free(k.xb);
    free(k.wb);
    free(k.targets);
}

/* Bad arguments: each refused with its status, outputs untouched. */
/* Ignored rows' lse is a placeholder (0): a backward that computes every row (a caller's workspace, gradient
 * filtering) must not recompute their p = exp(s - lse) from it, which overflows once an ignored token's tempered logit
 * passes ~88.7 (inf x the zero coefficient = NaN in dx, dweight and dbias). Temperature 0.05 with logits up to +-160
 * (s up to +-3200): every gradient finite, and equal to the default context's, which compacts those rows away: dx bit
 * for bit (a row's dx depends on its own logits only), dweight and dbias to fp32 summation order (1e-6 normwise, as in
 * the counted-rows test; filtering at eps 2^-28 drops terms below 2^-28 of a row's scale: measured <= 1e-7 here). */
static void test_ignored_rows_cold_temperature(void)
{
    enum { N = 48, H = 16, V = 300 };
    uint64_t rng = 4141;
    float *x = tu_alloc(N * H, sizeof(float)), *w = tu_alloc(H * V, sizeof(float)), *b = tu_alloc(V, sizeof(float));
    tu_fill_uniform(x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(w, H * V, &rng, -1.0, 1.0);
    tu_fill_uniform(b, V, &rng, -150.0, 150.0);
    int64_t targets[N];
    float g[3][N];
    for (int64_t i = 0; i < N; i++)
        targets[i] = i % 3 == 0 ? -100 : (i * 31) % V;
    for (int j = 0; j < 3; j++)
        tu_fill_uniform(g[j], N, &rng, -1.0, 1.0);
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, b);
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    o.temperature = 0.05;
    const size_t counts[3] = {N * H, H * V, V};
    float *grads[3][3];
    static const char *const names[3] = {"the default context", "a caller's workspace", "gradient filtering"};
    for (int run = 0; run < 3; run++) {
        for (int j = 0; j < 3; j++)
            grads[run][j] = tu_alloc(counts[j], sizeof(float));
        fh_context *ctx = tu_context(2, 0, 0, 0);
        void *workspace = NULL;
        size_t bytes = 0;
        if (run == 1) {
            TU_CHECK(fh_logprob_workspace_size(ctx, &lin, &bytes) == FH_OK, "workspace size");
            workspace = tu_alloc(bytes, 1);
            TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
        }
        if (run == 2)
            TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0x1.0p-28) == FH_OK, "filtering on");
        float logp[N], entropy[N], lse[N];
        fh_logprob_outputs out = {logp, entropy, lse};
        fh_linear_grads gr = {.dx = grads[run][0], .dx_row_stride = H, .dweight = grads[run][1],
                              .dbias = grads[run][2]};
        fh_status st = fh_logprob_forward(ctx, &lin, targets, &o, &out);
        if (st == FH_OK)
            st = fh_logprob_backward(ctx, &lin, targets, &o, lse, entropy, g[0], g[1], g[2], &gr);
        TU_CHECK(st == FH_OK, "%s: status %d", names[run], (int)st);
        for (int j = 0; j < 3; j++)
            TU_CHECK(tu_all_finite_f(grads[run][j], counts[j]), "%s: %s finite", names[run],
                     j == 0 ? "dx" : j == 1 ? "dweight" : "dbias");
        if (run > 0) {
            TU_CHECK(run == 2 || memcmp(grads[run][0], grads[0][0], counts[0] * sizeof(float)) == 0,
                     "%s: dx bit for bit the default context's", names[run]);
            for (int j = 0; j < 3; j++) {
                const double d = tu_norm_rel_f(grads[run][j], grads[0][j], counts[j]);
                TU_CHECK(d <= 1e-6, "%s: gradient %d %.2e normwise from the default context's", names[run], j, d);
            }
        }
        fh_context_destroy(ctx);
        free(workspace);
    }
    for (int run = 0; run < 3; run++)
        for (int j = 0; j < 3; j++)
            free(grads[run][j]);
    free(x);
    free(w);
    free(b);
}

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
    TU_CHECK(fh_logprob_forward_backward(ctx, &lin, targets, &o, g, NULL, NULL, &out, NULL) == FH_ERR_NULL_POINTER &&
                 fh_logprob_backward(ctx, &lin, targets, &o, lse, NULL, g, NULL, NULL, NULL) == FH_ERR_NULL_POINTER,
             "the gradient calls without grads");
    TU_CHECK(fh_logprob_forward_backward(ctx, &lin, targets, &o, g, NULL, NULL, &out, &grads) == FH_OK,
             "a valid single call");
    fh_linear_grads overlapping = {.dx = (void *)g, .dx_row_stride = H};
    TU_CHECK(fh_logprob_forward_backward(ctx, &lin, targets, &o, g, NULL, NULL, &out, &overlapping) ==
                 FH_ERR_OVERLAPPING_BUFFERS,
             "dx over g_logp");
    float kept[N * V];
    tu_fill_canary(out_logp, sizeof out_logp);
    TU_CHECK(fh_logprob_forward_keep(ctx, &lin, targets, &o, &out, NULL) == FH_ERR_NULL_POINTER &&
                 fh_logprob_backward_kept(ctx, &lin, targets, &o, NULL, lse, NULL, g, NULL, NULL, &grads) ==
                     FH_ERR_NULL_POINTER,
             "kept logits NULL");
    fh_logprob_outputs over_kept = {kept + 3, NULL, NULL};
    fh_linear_grads dx_over_kept = {.dx = kept + 5, .dx_row_stride = H};
    TU_CHECK(fh_logprob_forward_keep(ctx, &lin, targets, &o, &over_kept, kept) == FH_ERR_OVERLAPPING_BUFFERS &&
                 fh_logprob_backward_kept(ctx, &lin, targets, &o, kept, lse, NULL, g, NULL, NULL, &dx_over_kept) ==
                     FH_ERR_OVERLAPPING_BUFFERS,
             "an output over the kept logits");
    TU_CHECK(fh_logprob_forward_keep(NULL, &lin, targets, &o, &out, kept) == FH_ERR_NULL_POINTER, "no context");
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

/* The pair that keeps the logits (fh_logprob_forward_keep, fh_logprob_backward_kept) against the reference, at the
 * same tolerances as the recomputing pair: fp32 and bf16, both layouts, the entropy gradient, a temperature, softcap
 * and scale, ignored rows compacted away (the default budget) and run as they are (a caller's workspace: nothing is
 * compacted), edge tiles, and the streaming forward on small tiles. */
static void test_kept_logits(void)
{
    for (int dtype = 0; dtype <= 1; dtype++)
        for (int layout = 0; layout <= 1; layout++)
            for (int variant = 0; variant < 3; variant++) {
                logprob_case_spec s;
                logprob_case_spec_default(&s);
                s.keep_logits = 1;
                s.dtype = (fh_dtype)dtype;
                s.layout = (fh_layout)layout;
                s.seed = 60 + (uint64_t)(dtype * 6 + layout * 3 + variant);
                if (variant == 1) {
                    s.options.temperature = 0.7;
                    s.options.softcap = 5.0;
                    s.options.logit_scale = 0.5;
                    s.g_entropy = 0;
                }
                if (variant == 2) {
                    s.tile_rows = 13;
                    s.tile_vocab = 127;
                    s.ignore_frac = 0.0;
                }
                lp_check_spec(&s, "kept logits");
            }
}

/* What the forward keeps: x W of every counted row (fp32, to the GEMM's rounding: 1e-5 of the row's largest |x_k
 * w_kj| sum, ~1.5e-6 seen), 0 in ignored rows, and the same rows whether or not the ignored ones were compacted
 * away (a caller's workspace runs every row). */
static void test_kept_logits_content(void)
{
    enum { N = 40, H = 24, V = 700 };
    uint64_t rng = 5;
    float *x = tu_alloc(N * H, sizeof(float)), *w = tu_alloc((size_t)V * H, sizeof(float));
    for (size_t e = 0; e < N * H; e++)
        x[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    for (size_t e = 0; e < (size_t)V * H; e++)
        w[e] = (float)(2.0 * ref_uniform(&rng) - 1.0);
    int64_t targets[N];
    for (int i = 0; i < N; i++)
        targets[i] = i % 4 == 1 ? -100 : (int64_t)(i * 37 % V);
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, NULL);
    fh_logprob_options o;
    fh_logprob_options_init(&o);
    float logp[N], *kept[2];
    fh_logprob_outputs out = {logp, NULL, NULL};
    void *workspace = NULL;
    for (int callers = 0; callers <= 1; callers++) {
        fh_context *ctx = tu_context(2, 0, 0, 0);
        size_t bytes = 0;
        if (callers) {
            TU_CHECK(fh_logprob_workspace_size(ctx, &lin, &bytes) == FH_OK, "workspace size");
            workspace = tu_alloc(bytes, 1);
            TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
        }
        kept[callers] = tu_alloc((size_t)N * V, sizeof(float));
        for (size_t e = 0; e < (size_t)N * V; e++)
            kept[callers][e] = NAN;
        TU_CHECK(fh_logprob_forward_keep(ctx, &lin, targets, &o, &out, kept[callers]) == FH_OK, "forward_keep");
        fh_context_destroy(ctx);
        free(workspace);
        double worst = 0.0;
        int zeros = 1;
        for (int i = 0; i < N; i++)
            for (int j = 0; j < V; j++) {
                double u = 0.0, scale = 0.0;
                for (int k = 0; k < H; k++) {
                    u += (double)x[i * H + k] * (double)w[(size_t)j * H + k];
                    scale += fabs((double)x[i * H + k] * (double)w[(size_t)j * H + k]);
                }
                const float got = kept[callers][(size_t)i * V + j];
                if (targets[i] == -100)
                    zeros &= got == 0.0f;
                else
                    worst = fmax(worst, isfinite(got) ? fabs(got - u) / scale : INFINITY);
            }
        TU_CHECK(worst <= 1e-5 && zeros, "kept logits (%s): worst error %.2e of the row's scale, ignored rows 0: %d",
                 callers ? "every row run" : "ignored rows compacted", worst, zeros);
    }
    TU_CHECK(memcmp(kept[0], kept[1], (size_t)N * V * sizeof(float)) == 0,
             "kept logits: the same with and without compaction");
    free(kept[0]);
    free(kept[1]);
    free(x);
    free(w);
}

static const tu_test tests[] = {
    {"temperatures, entropy gradient, layouts, calls, fp32 and bf16", test_temperatures_gradients_layouts},
    {"softcap, logit_scale and ignored tokens", test_transforms_and_ignored},
    {"schedules, tiles, beta 1, bf16 gradients and fp32 dU", test_schedules},
    {"counted rows: per-row results bit for bit", test_counted_rows_bit_for_bit},
    {"ignored rows at temperature 0.05, logits to +-160: finite gradients in every schedule",
     test_ignored_rows_cold_temperature},
    {"kept logits: the pair that keeps them, against the reference", test_kept_logits},
    {"kept logits: x W of counted rows, 0 in ignored ones, with and without compaction", test_kept_logits_content},
    {"call contract", test_contract},
};
const tu_suite suite_logprob = {tests, TU_COUNT(tests)};
