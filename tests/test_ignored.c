/* Ignored tokens. The header's contract when every token is ignored: loss 0, z_loss 0, every gradient 0,
 * never NaN. Those are exact values, asserted exactly. For partly ignored inputs, the loss does not depend
 * on an ignored row at all, so its per-token loss and log p are the documented 0 and its dx row is
 * exactly 0 (a nonzero value, however small, means the row leaked into the loss). */
#include "ce_harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};

/* Every fused output of an all-ignored call, judged exactly. Gradients: 0 over NaN garbage with beta 0,
 * exactly the 1.0 that was there with beta 1. */
static void check_all_ignored(const char *label, int64_t n, int64_t h, int64_t v, double loss, double z_loss,
                              const float *per_token_loss, const float *logp, const float *lse, const float *dx,
                              const float *dweight, const float *dbias, float beta)
{
    const float g = beta != 0.0f ? 1.0f : 0.0f;
    TU_CHECK(loss == 0.0, "%s: loss = %.17g, expected exactly 0", label, loss);
    TU_CHECK(z_loss == 0.0, "%s: z_loss = %.17g, expected exactly 0", label, z_loss);
    TU_CHECK(tu_all_equal_f(per_token_loss, (size_t)n, 0.0f), "%s: per_token_loss not all 0", label);
    TU_CHECK(tu_all_equal_f(logp, (size_t)n, 0.0f), "%s: per_token_logp not all 0", label);
    TU_CHECK(tu_all_finite_f(lse, (size_t)n), "%s: lse not finite", label);
    TU_CHECK(tu_all_equal_f(dx, (size_t)(n * h), g), "%s: dx not all %g", label, (double)g);
    TU_CHECK(tu_all_equal_f(dweight, (size_t)(h * v), g), "%s: dweight not all %g", label, (double)g);
    TU_CHECK(!dbias || tu_all_equal_f(dbias, (size_t)v, g), "%s: dbias not all %g", label, (double)g);
}

/* Every target equals ignore_index: the default -100, one inside [0, V) and one above V; with no
 * options and with every option (whose terms must all vanish too); each reduction, both betas,
 * 1 and 2 threads, separate calls and the train step. */
static void test_every_row_ignored(void)
{
    enum { N = 11, H = 5, V = 19 };
    const int64_t ignore_values[] = {-100, 3, V + 5};
    for (size_t iv = 0; iv < TU_COUNT(ignore_values); iv++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++)
            for (int all_options = 0; all_options <= 1; all_options++)
                for (int variant = 0; variant < 4; variant++) {
                    const int b = variant & 1, train_step = variant >> 1;
                    cp_problem p;
                    cp_problem_init(&p, N, H, V, FH_LAYOUT_VH, CP_BIAS | (all_options ? CP_CLASS_WEIGHTS : 0));
                    cp_problem_randomize(&p, 70 + r, 3.0);
                    p.options.reduction = reductions[r];
                    p.options.ignore_index = ignore_values[iv];
                    if (all_options) {
                        p.options.label_smoothing = 0.1;
                        p.options.softcap = 2.0;
                        p.options.z_loss = 1e-2;
                    }
                    for (int64_t i = 0; i < N; i++)
                        p.targets[i] = ignore_values[iv];
                    const cp_config cfg = {.threads = 1 + b, .tile_rows = 4, .tile_vocab = 8, .grad_beta = (float)b,
                                           .train_step = train_step};
                    cp_fused f;
                    const fh_status st = cp_run_fused(&p, &cfg, &f);
                    char label[128];
                    snprintf(label, sizeof label, "ignore_index %lld, reduction %d, options %d, beta %d, train step %d",
                             (long long)ignore_values[iv], (int)reductions[r], all_options, b, train_step);
                    TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
                    if (st == FH_OK)
                        check_all_ignored(label, N, H, V, f.loss, f.z_loss, f.per_token_loss, f.logp, f.lse, f.dx,
                                          f.dweight, f.dbias, cfg.grad_beta);
                    cp_fused_free(&f);
                    cp_problem_free(&p);
                }
}

/* The same through the ce_case harness (ignore_frac = 1), whose fused outputs are judged exactly. */
static void test_every_row_ignored_harness(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int variant = 0; variant < 4; variant++) {
            const int b = variant & 1;
            ce_case_spec s;
            ce_case_spec_default(&s);
            s.n = 9;
            s.hidden = 4;
            s.vocab = 21;
            s.bias = 1;
            s.ignore_frac = 1.0;
            s.label_smoothing = 0.2;
            s.class_weights = 1;
            s.z_loss = 1e-3;
            s.reduction = reductions[r];
            s.grad_beta = (float)b;
            s.train_step = variant >> 1;
            s.tile_rows = 4;
            s.tile_vocab = 8;
            ce_case c;
            ce_metrics m;
            const fh_status st = ce_case_run(&s, &c, &m);
            char label[64];
            snprintf(label, sizeof label, "harness, reduction %d, beta %d, train step %d", (int)reductions[r], b,
                     s.train_step);
            TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
            if (st == FH_OK)
                check_all_ignored(label, s.n, s.hidden, s.vocab, c.loss, c.z_loss, c.per_token_loss, c.logp, c.lse,
                                  c.dx, c.dweight, c.dbias, s.grad_beta);
            ce_case_free(&c);
        }
}

/* Every other row ignored, under several ignore_index values (default, inside [0, V), negative other
 * than -100, above V): the ignored rows are exactly 0 in per_token_loss, logp and dx (or exactly 1 with
 * beta 1), and everything matches the reference (ce_metrics_pass, tests/cases/ce_case.c). */
static void test_some_rows_ignored(void)
{
    enum { N = 13, H = 6, V = 23 };
    const int64_t ignore_values[] = {-100, 5, -1, V + 10};
    for (size_t iv = 0; iv < TU_COUNT(ignore_values); iv++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++)
            for (int variant = 0; variant < 4; variant++) {
                const int b = variant & 1, train_step = variant >> 1;
                cp_problem p;
                cp_problem_init(&p, N, H, V, FH_LAYOUT_HV, CP_BIAS | CP_CLASS_WEIGHTS);
                cp_problem_randomize(&p, 80 + iv * 10 + r, 3.0);
                p.options.reduction = reductions[r];
                p.options.ignore_index = ignore_values[iv];
                p.options.label_smoothing = 0.1;
                p.options.z_loss = 1e-3;
                for (int64_t i = 0; i < N; i++) {
                    if (i % 2 == 1)
                        p.targets[i] = ignore_values[iv];
                    else if (p.targets[i] == ignore_values[iv])
                        p.targets[i] = (p.targets[i] + 1) % V; /* keep even rows active */
                }
                const cp_config cfg = {.threads = 2, .tile_rows = 4, .tile_vocab = 8, .grad_beta = (float)b,
                                       .train_step = train_step};
                char label[128];
                snprintf(label, sizeof label, "ignore_index %lld, reduction %d, beta %d, train step %d",
                         (long long)ignore_values[iv], (int)reductions[r], b, train_step);
                cp_check_against_reference(&p, &cfg, label);
                cp_fused f;
                const fh_status st = cp_run_fused(&p, &cfg, &f);
                TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
                for (int64_t i = 1; st == FH_OK && i < N; i += 2) {
                    TU_CHECK(f.per_token_loss[i] == 0.0f && f.logp[i] == 0.0f,
                             "%s: ignored row %lld: per_token_loss %g, logp %g", label, (long long)i,
                             (double)f.per_token_loss[i], (double)f.logp[i]);
                    TU_CHECK(tu_all_equal_f(f.dx + i * H, H, cfg.grad_beta), "%s: ignored row %lld: dx not %g", label,
                             (long long)i, (double)cfg.grad_beta);
                }
                cp_fused_free(&f);
                cp_problem_free(&p);
            }
}

/* Ignored rows at logit_scale 20 (a temperature of 0.05), logits to +-160 (s to +-3200): a call that computes every
 * row (a caller's workspace, gradient filtering) gives finite gradients equal to the default context's, which compacts
 * the ignored rows away: no ignored row's gradient is formed from a statistic it does not have (issue 41). dx bit for
 * bit (a row's dx depends on its own logits only), dweight and dbias to fp32 summation order (1e-6 normwise, as the
 * counted-rows comparisons). */
static void test_ignored_rows_cold_scale(void)
{
    enum { N = 48, H = 16, V = 300 };
    uint64_t rng = 4142;
    float *x = tu_alloc(N * H, sizeof(float)), *w = tu_alloc(H * V, sizeof(float)), *b = tu_alloc(V, sizeof(float));
    tu_fill_uniform(x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(w, H * V, &rng, -0.5, 0.5);
    tu_fill_uniform(b, V, &rng, -150.0, 150.0);
    int64_t targets[N];
    for (int64_t i = 0; i < N; i++)
        targets[i] = i % 3 == 0 ? -100 : (i * 31) % V;
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, x, w, FH_LAYOUT_VH, b);
    fh_ce_options o;
    fh_ce_options_init(&o);
    o.logit_scale = 20.0;
    const float one = 1.0f;
    const size_t counts[3] = {N * H, H * V, V};
    static const char *const names[3] = {"the default context", "a caller's workspace", "gradient filtering"};
    for (int step = 0; step <= 1; step++) {
        float *grads[3][3];
        for (int run = 0; run < 3; run++) {
            for (int j = 0; j < 3; j++)
                grads[run][j] = tu_alloc(counts[j], sizeof(float));
            fh_context *ctx = tu_context(2, 0, 0, 0);
            void *workspace = NULL;
            size_t bytes = 0;
            if (run == 1) {
                TU_CHECK((step ? fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &bytes)
                               : fh_ce_workspace_size(ctx, &lin, &o, &bytes)) == FH_OK,
                         "workspace size");
                workspace = tu_alloc(bytes, 1);
                TU_CHECK(fh_context_set_workspace(ctx, workspace, bytes) == FH_OK, "caller's workspace");
            }
            if (run == 2)
                TU_CHECK(fh_context_set_real(ctx, FH_PARAM_GRAD_FILTER_EPS, 0x1.0p-28) == FH_OK, "filtering on");
            double loss = 0.0;
            float lse[N];
            fh_ce_outputs out = {.loss = &loss, .lse = step ? NULL : lse};
            fh_linear_grads gr = {.dx = grads[run][0], .dx_row_stride = H, .dweight = grads[run][1],
                                  .dbias = grads[run][2]};
            fh_status st;
            if (step) {
                st = fh_ce_forward_backward(ctx, &lin, targets, &o, &one, &out, &gr);
            } else {
                st = fh_ce_forward(ctx, &lin, targets, &o, &out);
                if (st == FH_OK)
                    st = fh_ce_backward(ctx, &lin, targets, &o, lse, &one, &gr);
            }
            TU_CHECK(st == FH_OK, "%s, train step %d: status %d", names[run], step, (int)st);
            for (int j = 0; j < 3; j++)
                TU_CHECK(tu_all_finite_f(grads[run][j], counts[j]), "%s, train step %d: gradient %d finite",
                         names[run], step, j);
            if (run > 0) {
                TU_CHECK(run == 2 || memcmp(grads[run][0], grads[0][0], counts[0] * sizeof(float)) == 0,
                         "%s, train step %d: dx bit for bit the default context's", names[run], step);
                for (int j = 0; j < 3; j++) {
                    const double d = tu_norm_rel_f(grads[run][j], grads[0][j], counts[j]);
                    TU_CHECK(d <= 1e-6, "%s, train step %d: gradient %d %.2e normwise from the default context's",
                             names[run], step, j, d);
                }
            }
            fh_context_destroy(ctx);
            free(workspace);
        }
        for (int run = 0; run < 3; run++)
            for (int j = 0; j < 3; j++)
                free(grads[run][j]);
    }
    free(x);
    free(w);
    free(b);
}

static const tu_test tests[] = {
    {"every row ignored: exact zeros", test_every_row_ignored},
    {"every row ignored via ce_case (ignore_frac 1)", test_every_row_ignored_harness},
    {"some rows ignored, several ignore_index values", test_some_rows_ignored},
    {"ignored rows at logit_scale 20, logits to +-160: finite gradients in every schedule",
     test_ignored_rows_cold_scale},
};
const tu_suite suite_ignored = {tests, TU_COUNT(tests)};
