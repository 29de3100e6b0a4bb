/* Extreme logits: a target 200 below the row's maximum, and logits around +-1e4.
 *
 * Tolerances are derived from fp32 rounding at the logits' magnitude, not from the generic ones. The
 * inputs are hand-built (identity x, so the fp32 GEMM reproduces the given logits exactly); what remains
 * is rounding of quantities of size |z|: the float subtraction z - max inside exp, the lse stored as a
 * float and read back by the backward pass, the float per-token outputs. Each such rounding moves a
 * log-probability by at most 2^-24 * max|z| (plus a few ulps of 1), and there are fewer than 8 on any
 * path, so with
 *     tau = 8 * 2^-24 * max|z|
 *   |d lse_i|, |d logp_i|            <= tau
 *   |d ce_i|                         <= tau                         (ce_i = lse_i - z_y)
 *   |d loss|                         <= tau * S * (1 for mean, N for sum/none),  S = 1 + 2 z_loss max|lse|
 *   |d dU_ij|                        <= tau * S * G_i     (p_ij <= 1 has relative error <= tau; G_i = |d loss / d ce_i|)
 *   dweight = x^T dU = dU exactly (x = identity): the same bound per element;
 *   dx_ik = sum_j dU_ij W_kj:        <= tau S G_i sum_j |W_kj| + V 2^-24 sum_j |dU_ij W_kj|  (GEMM rounding).
 * For |z| = 1e4, tau ~ 4.8e-3; for |z| = 200, tau ~ 1e-4.
 */
#include "ce_harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};

static int all_finite_d(const double *a, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

/* Runs a hand-built problem (cp_problem_from_logits; every row active) and checks the bounds above,
 * with separate calls and with the train step. */
static void check_extreme_once(const cp_problem *p, const char *label_base, int train_step)
{
    const int64_t n = p->n, h = p->hidden, v = p->vocab;
    const cp_config cfg = {.threads = 2, .tile_rows = 2, .tile_vocab = 16, .train_step = train_step};
    char label[160];
    snprintf(label, sizeof label, "%s, train step %d", label_base, train_step);
    cp_fused f;
    cp_reference r;
    if (!cp_run_fused_and_reference(p, &cfg, label, &f, &r))
        return;

    double zmax = 0.0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < v; j++)
            zmax = fmax(zmax, fabs(cp_logit(p, i, j)));
    const double tau = 8.0 * TU_FP32_U * zmax;
    const double s = 1.0 + 2.0 * p->options.z_loss * tu_max_abs_d(r.lse, (size_t)n);
    const fh_reduction red = p->options.reduction;

    TU_CHECK(isfinite(f.loss) && isfinite(f.z_loss), "%s: loss %g, z_loss %g", label, f.loss, f.z_loss);
    TU_CHECK(tu_all_finite_f(f.per_token_loss, (size_t)n) && tu_all_finite_f(f.logp, (size_t)n) &&
                 tu_all_finite_f(f.lse, (size_t)n),
             "%s: non-finite per-token output", label);
    TU_CHECK(tu_all_finite_f(f.dx, (size_t)(n * h)) && tu_all_finite_f(f.dweight, (size_t)(h * v)),
             "%s: non-finite gradient", label);
    TU_CHECK(all_finite_d(r.dx, (size_t)(n * h)) && isfinite(r.loss), "%s: non-finite reference", label);

    const double loss_tol = tau * s * (red == FH_REDUCTION_MEAN ? 1.0 : (double)n);
    TU_CHECK(fabs(f.loss - r.loss) <= loss_tol, "%s: |loss - ref| = %.3e > %.3e (loss %.9g, ref %.9g)", label,
             fabs(f.loss - r.loss), loss_tol, f.loss, r.loss);
    const double lse_err = tu_max_abs_diff(f.lse, r.lse, (size_t)n);
    const double logp_err = tu_max_abs_diff(f.logp, r.logp, (size_t)n);
    const double ptl_err = tu_max_abs_diff(f.per_token_loss, r.per_token_loss, (size_t)n);
    TU_CHECK(lse_err <= tau && logp_err <= tau && ptl_err <= tau * s,
             "%s: per-token errors lse %.3e, logp %.3e (tol %.3e), per_token_loss %.3e (tol %.3e)", label, lse_err,
             logp_err, tau, ptl_err, tau * s);

    /* Gradients, element by element. G_i: the loss's derivative w.r.t. token i's loss. */
    double worst_dw = 0.0, worst_dx = 0.0; /* error / bound, must stay <= 1 */
    for (int64_t i = 0; i < n; i++) {
        const double g = red == FH_REDUCTION_NONE ? p->grad_output[i] : p->grad_output[0];
        const double gi = fabs(g) / (red == FH_REDUCTION_MEAN ? (double)n : 1.0);
        const double eps_u = tau * s * gi;
        for (int64_t j = 0; j < v; j++) {
            const size_t w = cp_weight_index(p, i, j); /* hidden index k = i */
            const double e = fabs((double)f.dweight[w] - r.dweight[w]);
            worst_dw = fmax(worst_dw, isnan(e) ? INFINITY : e / eps_u);
        }
        for (int64_t k = 0; k < h; k++) {
            double wsum = 0.0, dusum = 0.0;
            for (int64_t j = 0; j < v; j++) {
                const double wkj = p->weight[cp_weight_index(p, k, j)];
                wsum += fabs(wkj);
                dusum += fabs(r.dweight[cp_weight_index(p, i, j)] * wkj);
            }
            const double bound = eps_u * wsum + (double)v * TU_FP32_U * dusum;
            const double e = fabs((double)f.dx[i * h + k] - r.dx[i * h + k]);
            worst_dx = fmax(worst_dx, isnan(e) ? INFINITY : bound > 0.0 ? e / bound : (e > 0.0 ? INFINITY : 0.0));
        }
    }
    TU_CHECK(worst_dw <= 1.0, "%s: dweight error up to %.3g x its bound (tau %.3e)", label, worst_dw, tau);
    TU_CHECK(worst_dx <= 1.0, "%s: dx error up to %.3g x its bound (tau %.3e)", label, worst_dx, tau);
    cp_reference_free(&r);
    cp_fused_free(&f);
}

static void check_extreme(const cp_problem *p, const char *label)
{
    check_extreme_once(p, label, 0);
    check_extreme_once(p, label, 1);
}

/* Each row: noise in (-1, 1), the maximum 100 somewhere, the target at -100 (200 below the maximum),
 * the two on various sides of the tile edge (tile_vocab 16). Bounds from the top of this file with
 * tau = 8 * 2^-24 * 100 ~ 4.8e-5. Besides, ce_i >= z_max - z_y = 200 holds exactly (lse >= max), so the
 * fused per-token losses must be >= 200 - tau. */
static void test_target_200_below_max(void)
{
    enum { N = 5, V = 37 };
    static const int64_t max_col[N] = {0, 15, 16, 36, 20}, target_col[N] = {36, 16, 15, 0, 33};
    float logits[N * V];
    uint64_t rng = 5;
    for (int64_t i = 0; i < N; i++) {
        for (int64_t j = 0; j < V; j++)
            logits[i * V + j] = (float)(2.0 * ref_uniform(&rng) - 1.0);
        logits[i * V + max_col[i]] = 100.0f;
        logits[i * V + target_col[i]] = -100.0f;
    }
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int layout = FH_LAYOUT_HV; layout <= FH_LAYOUT_VH; layout++) {
            cp_problem p;
            cp_problem_from_logits(&p, N, V, (fh_layout)layout, logits);
            p.options.reduction = reductions[r];
            for (int64_t i = 0; i < N; i++) {
                p.targets[i] = target_col[i];
                p.grad_output[i] = (float)(0.5 + 0.25 * (double)i);
            }
            char label[64];
            snprintf(label, sizeof label, "target 200 below max, reduction %d, layout %d", (int)reductions[r], layout);
            check_extreme(&p, label);
            for (int train_step = 0; train_step <= 1; train_step++) {
                const cp_config cfg = {.threads = 1, .tile_rows = 2, .tile_vocab = 16, .train_step = train_step};
                cp_fused f;
                if (cp_run_fused(&p, &cfg, &f) == FH_OK) {
                    const double tau = 8.0 * TU_FP32_U * 100.0;
                    for (int64_t i = 0; i < N; i++)
                        TU_CHECK(f.per_token_loss[i] >= 200.0 - tau,
                                 "%s, train step %d: row %lld: per-token loss %.9g < 200", label, train_step,
                                 (long long)i, (double)f.per_token_loss[i]);
                }
                cp_fused_free(&f);
            }
            cp_problem_free(&p);
        }
}

/* Rows around +-1e4: near-ties at the top (so that p is neither 0 nor 1), every logit near -1e4, a
 * 2e4 spread with the target at the bottom, the target on the maximum, alternating signs. Plain, with
 * z-loss (lse^2 ~ 1e8) and with softcap 30 (saturating tanh). Tolerances from the top of this file:
 * |d loss| <= tau * S * (1 or N) with tau = 8 * 2^-24 * max|z| ~ 4.8e-3 at max|z| = 1e4 (fp32 spacing
 * at 1e4 is 2^-10 ~ 9.8e-4: one rounding of lse or of z - max moves a loss by up to half of it), and
 * tau ~ 1.4e-5 under softcap 30 (max|z| = 30). */
static void test_logits_around_1e4(void)
{
    enum { N = 5, V = 23 };
    float logits[N * V];
    uint64_t rng = 11;
    for (int64_t j = 0; j < V; j++) {
        const double u = ref_uniform(&rng);
        logits[0 * V + j] = (float)(2e4 * u - 1e4);          /* spread over [-1e4, 1e4] */
        logits[1 * V + j] = (float)(-1e4 - 4.0 * u);         /* all near -1e4 */
        logits[2 * V + j] = -1e4f;                           /* one at +1e4, the rest at -1e4 */
        logits[3 * V + j] = (float)(1e4 - 8.0 * u);          /* all near +1e4 */
        logits[4 * V + j] = j % 2 ? 1e4f : -1e4f;            /* alternating */
    }
    logits[0 * V + 3] = 1e4f, logits[0 * V + 17] = 1e4f - 1.0f, logits[0 * V + 16] = 1e4f - 2.5f;
    logits[1 * V + 9] = -1e4f + 0.5f;
    logits[2 * V + 0] = 1e4f;
    logits[3 * V + 12] = 1e4f, logits[3 * V + 5] = 1e4f - 0.25f;
    const int64_t targets[N] = {17, 2, V - 1, 12, 0};
    static const struct {
        const char *name;
        double z_loss, softcap;
    } variants[] = {{"plain", 0.0, 0.0}, {"z_loss 1e-4", 1e-4, 0.0}, {"softcap 30", 0.0, 30.0}};
    for (size_t k = 0; k < TU_COUNT(variants); k++)
        for (size_t r = 0; r < TU_COUNT(reductions); r++) {
            cp_problem p;
            cp_problem_from_logits(&p, N, V, r == 1 ? FH_LAYOUT_VH : FH_LAYOUT_HV, logits);
            p.options.reduction = reductions[r];
            p.options.z_loss = variants[k].z_loss;
            p.options.softcap = variants[k].softcap;
            for (int64_t i = 0; i < N; i++) {
                p.targets[i] = targets[i];
                p.grad_output[i] = (float)(i % 2 ? -0.75 : 1.25);
            }
            char label[64];
            snprintf(label, sizeof label, "+-1e4 %s, reduction %d", variants[k].name, (int)reductions[r]);
            check_extreme(&p, label);
            cp_problem_free(&p);
        }
}

/* The same magnitude through random GEMM inputs (ce_case, logit_scale 1e4). Now the fp32 GEMM rounds each
 * logit: by the standard dot-product bound, |dz_ij| <= gamma * S_ij with gamma = (H + 2) 2^-24 and
 * S_ij = sum_k |x_ik w_kj| + |b_j| (the +2: bias add and output rounding). Hence
 * |d ce_i| <= 2 max_j |dz_ij| + tau, and the mean loss is off by at most that, the sum by N times it.
 * No a-priori elementwise bound holds for the gradients here (a near-tie makes p arbitrarily sensitive
 * to the logit error), so they are checked for finiteness; their accuracy at this magnitude is checked
 * on the hand-built cases above. */
static void test_gemm_logits_1e4(void)
{
    for (size_t r = 0; r < 2; r++)
        for (int variant = 0; variant < 4; variant++) {
            const int layout = variant & 1;
            ce_case_spec s;
            ce_case_spec_default(&s);
            s.n = 16;
            s.hidden = 8;
            s.vocab = 37;
            s.bias = 1;
            s.layout = (fh_layout)layout;
            s.reduction = reductions[r];
            s.logit_scale = 1e4;
            s.tile_rows = 8;
            s.tile_vocab = 16;
            s.train_step = variant >> 1;
            s.seed = 300 + r * 2 + (uint64_t)layout;
            ce_case c;
            ce_metrics m;
            const fh_status st = ce_case_run(&s, &c, &m);
            char label[64];
            snprintf(label, sizeof label, "logit_scale 1e4, reduction %d, layout %d, train step %d", (int)s.reduction,
                     layout, s.train_step);
            TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
            if (st == FH_OK) {
                double smax = 0.0, zmax = 0.0;
                for (int64_t i = 0; i < s.n; i++)
                    for (int64_t j = 0; j < s.vocab; j++) {
                        double sum = fabs(c.bias[j]), z = c.bias[j];
                        for (int64_t k = 0; k < s.hidden; k++) {
                            const float w = c.weight[layout == FH_LAYOUT_HV ? k * s.vocab + j : j * s.hidden + k];
                            sum += fabs((double)c.x[i * s.hidden + k] * w);
                            z += (double)c.x[i * s.hidden + k] * w;
                        }
                        smax = fmax(smax, sum);
                        zmax = fmax(zmax, fabs(z));
                    }
                const double gamma = (double)(s.hidden + 2) * TU_FP32_U, tau = 8.0 * TU_FP32_U * zmax;
                const double per_token = 2.0 * gamma * smax + tau;
                const double tol = per_token * (s.reduction == FH_REDUCTION_MEAN ? 1.0 : (double)s.n);
                TU_CHECK(isfinite(c.loss) && fabs(c.loss - c.ref_loss) <= tol,
                         "%s: loss %.9g, ref %.9g, |diff| %.3e > %.3e", label, c.loss, c.ref_loss,
                         fabs(c.loss - c.ref_loss), tol);
                const size_t n = (size_t)s.n, hv = (size_t)(s.hidden * s.vocab);
                TU_CHECK(tu_all_finite_f(c.per_token_loss, n) && tu_all_finite_f(c.logp, n) &&
                             tu_all_finite_f(c.lse, n),
                         "%s: non-finite per-token output", label);
                TU_CHECK(tu_all_finite_f(c.dx, n * (size_t)s.hidden) && tu_all_finite_f(c.dweight, hv) &&
                             tu_all_finite_f(c.dbias, (size_t)s.vocab),
                         "%s: non-finite gradient", label);
            }
            ce_case_free(&c);
        }
}

static const tu_test tests[] = {
    {"target 200 below the maximum", test_target_200_below_max},
    {"hand-built logits around +-1e4", test_logits_around_1e4},
    {"GEMM logits around +-1e4 (logit_scale)", test_gemm_logits_1e4},
};
const tu_suite suite_extremes = {tests, TU_COUNT(tests)};
