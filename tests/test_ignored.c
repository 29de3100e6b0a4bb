/* Ignored tokens. The header's contract when every token is ignored: loss 0, z_loss 0, every gradient 0,
 * never NaN. Those are exact values, asserted exactly. For partly ignored inputs, the loss does not depend
 * on an ignored row at all, so its per-token loss and log p are the documented 0 and its dx row is
 * exactly 0 (a nonzero value, however small, means the row leaked into the loss). */
#include "ce_harness.h"

#include <math.h>
#include <stdio.h>

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

static const tu_test tests[] = {
    {"every row ignored: exact zeros", test_every_row_ignored},
    {"every row ignored via ce_case (ignore_frac 1)", test_every_row_ignored_harness},
    {"some rows ignored, several ignore_index values", test_some_rows_ignored},
};
const tu_suite suite_ignored = {tests, TU_COUNT(tests)};
