/* Numerical extremes against the double reference (ref/).
 *
 * Generic tolerances (tests/cases/ce_case.c, tests/cases/grpo_case.c: loss relative 1e-6, gradients normwise relative
 * 1e-5) apply to: V = 1 without options (the gradient is exactly 0); V = 1,000,003 with N = 3, H = 4;
 * label_smoothing = 1; softcap 1e-3 with logits of the cap's size (|u / cap| ~ 1); GRPO with V = 1 and
 * V = 1,000,003.
 *
 * Elsewhere they cannot hold in fp32, and hand-built logits (x = identity, so the GEMM gives the given
 * floats exactly) are checked against bounds derived from fp32 rounding; u = 2^-24:
 *   z: exact, or with a softcap c, z = c tanhf(u / c) in fp32: |dz| <= 3u |z|  (tanhf 1 ulp, the scaling)
 *   p_ij = expf(float(z_ij - lse_i)), lse_i rounded to float between the split passes:
 *       |dp_ij| <= p_ij (u (5 + |z_ij| + 2 |lse_i|) + |dz_ij| + max_j |dz_ij|) + 2^-126   (expf 1 ulp = 2u;
 *                                                                                       fp32 underflow)
 *   (the train step's p_ij = float(expf(float(z_ij - max_i)) float(1 / sum_i)) errs by at most
 *   p_ij u (4 + |z_ij - max_i|) + ..., within that: |z - max| <= |z| + |lse|, as max <= lse, or <= |z| if max <= 0)
 *   dZ_ij = a_i p_ij + b_i [j = y_i] + c_i w_j in fp32 (a, b, c: the cross-entropy coefficients, with label
 *   smoothing, class weights and z-loss; see row_coefs in src/):
 *       |d dZ_ij| <= |a_i| (|dp_ij| + 3u p_ij + 2^-126) + 4u |c_i w_j| + 2u |b_i| [j = y_i] + 2u |dZ_ij|
 *   softcap: dU = dZ (1 - t^2), t = z / c in fp32, |d(1 - t^2)| <= 7u:
 *       |d dU_ij| <= E_ij = 1.25 ((1 - t^2) |d dZ_ij| + 7u |dZ_ij| + 2u |dU_ij|)   (no softcap: 1.25 |d dZ_ij|)
 *   dweight = x^T dU = dU exactly (x = identity); dx_ik = sum_j dU_ij W_kj with GEMM rounding:
 *       |d dx_ik| <= sum_j E_ij |W_kj| + V u sum_j |dU_ij W_kj|
 *   lse_i = max_i + log(sum_j expf(z_ij - max_i)): the max's term is exactly 1, every other term has
 *   relative error <= u (2 + |z - max| e^{-|z - max|}) <= 2.4u, so |d lse_i| <= 3u (1 - p_max,i) + max |dz|:
 *   relative to the loss itself when the target is the maximum (the loss keeps full relative accuracy at
 *   p_y = 1 - 1e-7, loss 1e-7). The per-token loss adds the smoothing sum (float products w_j z_j) and
 *   z-loss terms; the reductions are in double.
 * Cases: V = 1 with every option (the cross-entropy coefficients cancel exactly, so the true gradient is the
 * z-loss term alone and fp32 cancellation leaves ~u |a| on it); softcap 1e-3 with |u / cap| up to 20
 * (partly saturated: 1 - t^2 in fp32 has absolute error ~7u, large relative to tiny dU); logits x 1e3 with
 * near-ties; a target of probability 1 - 1e-7 (dZ_y = g (p_y - 1) = -1e-7 g is below fp32's resolution at
 * 1: the bound allows ~2.5u |g| there, i.e. ~150% relative error on that component, and the measured error,
 * printed, is of that order; torch's fp32 softmax - onehot has the same); N = 1 (no averaging over rows). */
#include "ce_harness.h"
#include "grpo_case.h"
#include "grpo_convert.h"
#include "ref_grpo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_SUM, FH_REDUCTION_NONE};

/* ---- generic tolerances ---- */

static ce_case_spec base_spec(int64_t n, int64_t h, int64_t v, uint64_t seed)
{
    ce_case_spec s;
    ce_case_spec_default(&s);
    s.n = n;
    s.hidden = h;
    s.vocab = v;
    s.seed = seed;
    s.threads = 2;
    return s;
}

static void check_spec_both_paths(ce_case_spec s, const char *label)
{
    for (int train_step = 0; train_step <= 1; train_step++) {
        s.train_step = train_step;
        cp_check_spec(&s, label);
    }
}

static void test_vocab_million(void)
{
    /* Every option, both paths; then reduction none without options, the split pair. The library picks one
     * thread at this size (threads 0): a thousand tiny tiles gain nothing from a second one. */
    ce_case_spec s = base_spec(3, 4, 1000003, 2100);
    s.threads = 0;
    s.layout = FH_LAYOUT_VH;
    s.bias = 1;
    s.label_smoothing = 0.1;
    s.z_loss = 1e-4;
    s.class_weights = 1;
    check_spec_both_paths(s, "V = 1,000,003, N = 3, H = 4, every option");
    s = base_spec(3, 4, 1000003, 2101);
    s.threads = 0;
    s.layout = FH_LAYOUT_HV;
    s.reduction = FH_REDUCTION_NONE;
    cp_check_spec(&s, "V = 1,000,003, N = 3, H = 4, reduction none");
}

static void test_label_smoothing_one(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++)
        for (int cw = 0; cw <= 1; cw++) {
            ce_case_spec s = base_spec(33, 16, 501, 2200 + r * 2 + (uint64_t)cw);
            s.reduction = reductions[r];
            s.label_smoothing = 1.0;
            s.class_weights = cw;
            s.bias = 1;
            s.ignore_frac = 0.1;
            s.tile_rows = 8;
            s.tile_vocab = 64;
            check_spec_both_paths(s, "label_smoothing = 1");
        }
}

static void test_tiny_softcap_unsaturated(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++) {
        ce_case_spec s = base_spec(33, 16, 501, 2300 + r);
        s.reduction = reductions[r];
        s.softcap = 1e-3;
        s.logit_scale = 1e-3; /* |u / cap| ~ 1 */
        s.bias = 0;
        s.tile_vocab = 64;
        check_spec_both_paths(s, "softcap 1e-3, logits ~ 1e-3");
    }
}

/* ---- GRPO ---- */

static void check_grpo_paths(grpo_case_spec s, const char *label, int first_path)
{
    for (int train_step = first_path; train_step <= 1; train_step++) {
        s.train_step = train_step;
        grpo_case c;
        grpo_metrics_diff d;
        const fh_status st = grpo_case_run(&s, &c, &d);
        TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
        if (st == FH_OK)
            TU_CHECK(grpo_metrics_pass(&d),
                     "%s (loss type %d, level %d, train step %d): loss diff %.3e (tol %.3e), metrics %.3e, dx %.3e, "
                     "dw %.3e, db %.3e",
                     label, (int)s.options.loss_type, (int)s.options.importance_sampling_level, train_step,
                     d.abs_diff_loss, d.loss_tolerance, d.metrics_max_abs, d.dhidden_norm_rel, d.dweight_norm_rel,
                     d.dbias_norm_rel);
        grpo_case_free(&c);
    }
}

static void check_grpo(grpo_case_spec s, const char *label)
{
    check_grpo_paths(s, label, 0);
}

static void test_grpo_extreme_vocab(void)
{
    for (int loss_type = FH_GRPO_LOSS_GRPO; loss_type <= FH_GRPO_LOSS_VESPO; loss_type++)
        for (int level = 0; level <= 1; level++) {
            grpo_case_spec s;
            grpo_case_spec_default(&s);
            s.options.loss_type = (fh_grpo_loss_type)loss_type;
            s.options.importance_sampling_level = (fh_grpo_is_level)level;
            s.options.beta = 0.04;
            s.options.entropy_coef = 0.01;
            s.threads = 2;
            s.batch = 2;
            s.seq = 3;
            s.hidden = 8;
            s.vocab = 1;
            s.bias = 1;
            s.seed = 2500 + (uint64_t)(loss_type * 2 + level);
            check_grpo(s, "GRPO V = 1");
        }
    grpo_case_spec s;
    grpo_case_spec_default(&s);
    s.batch = 1;
    s.seq = 3;
    s.hidden = 4;
    s.vocab = 1000003;
    s.options.beta = 0.04;
    s.options.temperature = 0.7;
    s.threads = 0;
    check_grpo_paths(s, "GRPO V = 1,000,003, B = 1, T = 3, H = 4", 1);
}

/* One token (B = T = 1) with exact logits (H = 1, x = 1, the weight row holds the logits), against the
 * reference directly: one row cannot average fp32 GEMM rounding of the logits away, so exact logits keep
 * the comparison about the library's own arithmetic, where the generic tolerances hold. */
static void test_grpo_single_token(void)
{
    enum { V = 300 };
    float x = 1.0f, w[V], old_logp, ref_logp, advantage, mask = 1.0f;
    uint64_t rng = 2600;
    for (int j = 0; j < V; j++)
        w[j] = (float)(6.0 * ref_uniform(&rng) - 3.0);
    int64_t id = 123;
    double wd[V];
    for (int j = 0; j < V; j++)
        wd[j] = w[j];
    for (int loss_type = FH_GRPO_LOSS_GRPO; loss_type <= FH_GRPO_LOSS_VESPO; loss_type++)
        for (int level = 0; level <= 1; level++)
            for (int sign = 0; sign <= 1; sign++)
                for (int train_step = 0; train_step <= 1; train_step++) {
                    fh_grpo_options o;
                    fh_grpo_options_init(&o);
                    o.loss_type = (fh_grpo_loss_type)loss_type;
                    o.importance_sampling_level = (fh_grpo_is_level)level;
                    o.beta = 0.04;
                    o.entropy_coef = 0.01;
                    o.temperature = 0.9;
                    advantage = sign ? -0.7f : 0.8f;
                    old_logp = -6.0f + 0.3f * (float)sign;
                    ref_logp = -5.5f;
                    const fh_grpo_batch batch = {1, 1, &id, &mask, &advantage, &old_logp, &ref_logp, NULL, NULL, NULL};
                    fh_linear lin;
                    fh_linear_init(&lin, 1, 1, V, &x, w, FH_LAYOUT_HV, NULL);
                    double loss = 0.0;
                    float logp = 0.0f, entropy = 0.0f, lse = 0.0f, ptl = 0.0f, dx = 0.0f, dw[V];
                    fh_grpo_metrics metrics;
                    fh_grpo_outputs out = {&loss, &metrics, &logp, &ptl, &entropy, &lse};
                    fh_linear_grads g = {.dx = &dx, .dx_row_stride = 1, .dx_beta = 0.0f, .dweight = dw, .dweight_beta = 0.0f, .dbias = NULL, .dbias_beta = 0.0f};
                    const float one = 1.0f;
                    fh_context *ctx = tu_context(1, 0, 64, 0);
                    fh_status st = train_step ? fh_grpo_forward_backward(ctx, &lin, &batch, &o, &one, &out, &g)
                                              : fh_grpo_forward(ctx, &lin, &batch, &o, &out);
                    if (!train_step && st == FH_OK)
                        st = fh_grpo_backward(ctx, &lin, &batch, &o, &logp, &lse, &entropy, &one, &g);
                    fh_context_destroy(ctx);
                    /* Reference. */
                    const ref_grpo_options ro = grpo_ref_options(&o);
                    const double xd = 1.0, md = 1.0, ad = advantage, od = old_logp, rd = ref_logp;
                    const ref_grpo_problem rp = {1, 1, 1, V, &xd, wd, NULL, &id, &md, &ad, &od, &rd, NULL, NULL, NULL};
                    double rlogp = 0.0, rdx = 0.0, rdw[V];
                    ref_grpo_result rr = {0};
                    rr.logp = &rlogp;
                    const int rc = ref_grpo_forward(&rp, &ro, &rr) | ref_grpo_backward(&rp, &ro, 1.0, &rdx, rdw, NULL);
                    char label[96];
                    snprintf(label, sizeof label, "GRPO one token, loss type %d, level %d, A %g, train step %d",
                             loss_type, level, (double)advantage, train_step);
                    TU_CHECK(st == FH_OK && rc == 0, "%s: status %d, reference %d", label, (int)st, rc);
                    const double loss_tol = GRPO_LOSS_TOL * fmax(1.0, fabs(rr.loss));
                    const ce_diff ddw = ce_compare(dw, rdw, V), ddx = ce_compare(&dx, &rdx, 1);
                    TU_CHECK(fabs(loss - rr.loss) <= loss_tol && ddw.norm_rel <= GRPO_GRAD_NORM_REL_TOL &&
                                 ddx.norm_rel <= GRPO_GRAD_NORM_REL_TOL,
                             "%s: loss %.12g vs %.12g (tol %.2e), dweight %.3e, dx %.3e (tol %g)", label, loss, rr.loss,
                             loss_tol, ddw.norm_rel, ddx.norm_rel, GRPO_GRAD_NORM_REL_TOL);
                }
}

/* ---- hand-built logits against the fp32 bounds at the top of the file ---- */

static double raw_logit(const cp_problem *p, int64_t i, int64_t j)
{
    double u = p->bias ? p->bias[j] : 0.0;
    for (int64_t k = 0; k < p->hidden; k++)
        u += (double)p->x[i * p->hidden + k] * p->weight[cp_weight_index(p, k, j)];
    return u;
}

static double ratio_of(double err, double bound)
{
    if (isnan(err))
        return INFINITY;
    return bound > 0.0 ? err / bound : (err > 0.0 ? INFINITY : 0.0);
}

static void check_elementwise_once(const cp_problem *p, int train_step, const char *label_base)
{
    const int64_t n = p->n, h = p->hidden, v = p->vocab;
    const double u = TU_FP32_U;
    const fh_ce_options *o = &p->options;
    const cp_config cfg = {.threads = 2, .tile_rows = 2, .tile_vocab = 16, .train_step = train_step};
    char label[192];
    snprintf(label, sizeof label, "%s, reduction %d, layout %d, train step %d", label_base, (int)o->reduction,
             (int)p->layout, train_step);
    cp_fused f;
    cp_reference r;
    if (!cp_run_fused_and_reference(p, &cfg, label, &f, &r))
        return;
    const int mean = o->reduction == FH_REDUCTION_MEAN, softcap = o->softcap > 0.0;
    const double eps = o->label_smoothing, s = o->z_loss;
    double count = 0.0, weight_sum = 0.0, weight_total = 0.0;
    for (int64_t j = 0; j < v; j++)
        weight_total += o->class_weights ? o->class_weights[j] : 1.0;
    for (int64_t i = 0; i < n; i++)
        if (p->targets[i] != o->ignore_index) {
            count += 1.0;
            weight_sum += o->class_weights ? o->class_weights[p->targets[i]] : 1.0;
        }
    double loss_bound = 0.0, worst_dw = 0.0, worst_dx = 0.0, worst_ptl = 0.0;
    double *e = calloc((size_t)v, sizeof(double)), *du = calloc((size_t)v, sizeof(double));
    double *z = calloc((size_t)v, sizeof(double)), *dz_err = calloc((size_t)v, sizeof(double));
    for (int64_t i = 0; i < n; i++) {
        const int64_t y = p->targets[i];
        if (y == o->ignore_index)
            continue;
        const double g = (double)(o->reduction == FH_REDUCTION_NONE ? p->grad_output[i] : p->grad_output[0]);
        const double g_ce = mean ? g / weight_sum : g, g_z = mean ? g / count : g;
        const double w_y = o->class_weights ? o->class_weights[y] : 1.0, lse = r.lse[i];
        const double a = g_ce * ((1.0 - eps) * w_y + eps * weight_total / (double)v) + g_z * 2.0 * s * lse;
        const double b = -g_ce * (1.0 - eps) * w_y, c = -g_ce * eps / (double)v;
        double pmax = 0.0, dz_err_max = 0.0, smooth_err = 0.0;
        for (int64_t j = 0; j < v; j++) {
            z[j] = cp_logit(p, i, j);
            dz_err[j] = softcap ? 3.0 * u * fabs(z[j]) : 0.0;
            dz_err_max = fmax(dz_err_max, dz_err[j]);
        }
        for (int64_t j = 0; j < v; j++) {
            const double wj = o->class_weights ? o->class_weights[j] : 1.0, pij = exp(z[j] - lse);
            pmax = fmax(pmax, pij);
            smooth_err += wj * dz_err[j] + 2.0 * u * fabs(wj * z[j]);
            const double dp = pij * (u * (5.0 + fabs(z[j]) + 2.0 * fabs(lse)) + dz_err[j] + dz_err_max) + 0x1p-126;
            const double dZ = a * pij + (j == y ? b : 0.0) + c * wj;
            const double dZ_err = fabs(a) * (dp + 3.0 * u * pij + 0x1p-126) + 4.0 * u * fabs(c * wj) +
                                  (j == y ? 2.0 * u * fabs(b) : 0.0) + 2.0 * u * fabs(dZ);
            const double t = softcap ? tanh(raw_logit(p, i, j) / o->softcap) : 0.0, dzdu = 1.0 - t * t;
            du[j] = dZ * dzdu;
            e[j] = 1.25 * (softcap ? dzdu * dZ_err + 7.0 * u * fabs(dZ) + 2.0 * u * fabs(du[j]) : dZ_err);
            const size_t w = cp_weight_index(p, i, j); /* dweight = dU (x = identity, hidden index k = i) */
            const double ratio = ratio_of(fabs((double)f.dweight[w] - r.dweight[w]), e[j]);
            if (ratio > 1.0 && getenv("FH_HARDENING_VERBOSE"))
                printf("\n    dweight(%lld, %lld): fused %.9g, reference %.9g, bound %.3g, p %.3g", (long long)i,
                       (long long)j, (double)f.dweight[w], r.dweight[w], e[j], pij);
            worst_dw = fmax(worst_dw, ratio);
        }
        const double dlse = 3.0 * u * (1.0 - pmax) + dz_err_max + 0x1p-50 * fabs(lse);
        const double ce_err = ((1.0 - eps) * w_y + eps * weight_total / (double)v) * dlse +
                              (1.0 - eps) * w_y * (dz_err[y] + 0x1p-50 * fabs(z[y])) + eps / (double)v * smooth_err;
        const double zl_err = 2.0 * s * fabs(lse) * dlse + 0x1p-50 * s * lse * lse;
        loss_bound += (mean ? 1.0 / weight_sum : 1.0) * ce_err + (mean ? 1.0 / count : 1.0) * zl_err;
        const double ptl_bound = ce_err + zl_err + u * fabs(r.per_token_loss[i]);
        worst_ptl = fmax(worst_ptl, ratio_of(fabs((double)f.per_token_loss[i] - r.per_token_loss[i]), ptl_bound));
        for (int64_t k = 0; k < h; k++) {
            double bound = 0.0;
            for (int64_t j = 0; j < v; j++) {
                const double wkj = fabs((double)p->weight[cp_weight_index(p, k, j)]);
                bound += e[j] * wkj + (double)v * u * fabs(du[j]) * wkj;
            }
            worst_dx = fmax(worst_dx, ratio_of(fabs((double)f.dx[i * h + k] - r.dx[i * h + k]), bound));
        }
    }
    loss_bound += 0x1p-50 * fabs(r.loss) * (double)n;
    TU_CHECK(fabs(f.loss - r.loss) <= loss_bound, "%s: |loss - ref| = %.3e > %.3e (loss %.17g, ref %.17g)", label,
             fabs(f.loss - r.loss), loss_bound, f.loss, r.loss);
    TU_CHECK(worst_ptl <= 1.0, "%s: per-token loss error up to %.3g x its bound", label, worst_ptl);
    TU_CHECK(worst_dw <= 1.0, "%s: dweight error up to %.3g x its bound", label, worst_dw);
    TU_CHECK(worst_dx <= 1.0, "%s: dx error up to %.3g x its bound", label, worst_dx);
    free(e);
    free(du);
    free(z);
    free(dz_err);
    cp_reference_free(&r);
    cp_fused_free(&f);
}

typedef struct hand_options {
    double label_smoothing, softcap, z_loss;
    int class_weights;
    int64_t ignored_row; /* -1: none */
} hand_options;

static void check_elementwise(const float *logits, const int64_t *targets, int64_t n, int64_t v,
                              const hand_options *ho, const char *label)
{
    for (size_t red = 0; red < TU_COUNT(reductions); red++)
        for (int layout = 0; layout < 2; layout++) {
            cp_problem p;
            cp_problem_from_logits(&p, n, v, (fh_layout)layout, logits);
            p.options.reduction = reductions[red];
            p.options.label_smoothing = ho ? ho->label_smoothing : 0.0;
            p.options.softcap = ho ? ho->softcap : 0.0;
            p.options.z_loss = ho ? ho->z_loss : 0.0;
            if (ho && ho->class_weights) {
                p.class_weights = malloc(sizeof(float) * (size_t)v);
                uint64_t rng = 99;
                for (int64_t j = 0; j < v; j++)
                    p.class_weights[j] = (float)(0.5 + ref_uniform(&rng));
                p.options.class_weights = p.class_weights;
            }
            for (int64_t i = 0; i < n; i++) {
                p.targets[i] = targets[i];
                p.grad_output[i] = (float)(i % 2 ? -0.75 : 1.25);
            }
            if (ho && ho->ignored_row >= 0)
                p.targets[ho->ignored_row] = -100;
            check_elementwise_once(&p, 0, label);
            check_elementwise_once(&p, 1, label);
            cp_problem_free(&p);
        }
}

/* V = 1: the loss is z-loss alone (lse = z_0, ce = 0), logp = 0 exactly. Without options every gradient is
 * exactly 0 (generic tolerances, GEMM inputs); with label smoothing, class weights, softcap and z-loss the
 * cross-entropy coefficients cancel and fp32 leaves ~u |a| on the z-loss gradient (the bounds above). */
static void test_vocab_one(void)
{
    for (size_t r = 0; r < TU_COUNT(reductions); r++) {
        ce_case_spec s = base_spec(17, 8, 1, 2000 + r);
        s.reduction = reductions[r];
        s.bias = 1;
        s.ignore_frac = 0.2;
        check_spec_both_paths(s, "V = 1");
    }
    enum { N = 17 };
    float logits[N];
    int64_t targets[N] = {0};
    uint64_t rng = 2010;
    for (int i = 0; i < N; i++)
        logits[i] = (float)(20.0 * ref_uniform(&rng) - 10.0);
    const hand_options every = {0.1, 5.0, 1e-3, 1, 4};
    check_elementwise(logits, targets, N, 1, &every, "V = 1, smoothing, class weights, softcap 5, z-loss");
    const hand_options z_only = {0.0, 0.0, 1e-3, 0, -1};
    check_elementwise(logits, targets, N, 1, &z_only, "V = 1, z-loss");
}

/* softcap 1e-3 with |u / cap| from 0 to 20: saturated and partly saturated logits. */
static void test_tiny_softcap_saturated(void)
{
    enum { N = 5, V = 37 };
    float logits[N * V];
    int64_t targets[N];
    uint64_t rng = 2310;
    for (int64_t i = 0; i < N; i++) {
        targets[i] = (int64_t)(ref_uniform(&rng) * V);
        for (int64_t j = 0; j < V; j++)
            logits[i * V + j] = (float)(0.02 * (2.0 * ref_uniform(&rng) - 1.0) * (double)(i + 1) / N);
    }
    const hand_options cap = {0.0, 1e-3, 0.0, 0, -1};
    check_elementwise(logits, targets, N, V, &cap, "softcap 1e-3, |u / cap| up to 20");
    const hand_options cap_all = {0.1, 1e-3, 1e-4, 1, 2};
    check_elementwise(logits, targets, N, V, &cap_all, "softcap 1e-3, |u / cap| up to 20, every option");
}

/* N = 1, exact logits, every option and none. */
static void test_single_token(void)
{
    enum { V = 777 };
    float logits[V];
    uint64_t rng = 2400;
    for (int j = 0; j < V; j++)
        logits[j] = (float)(6.0 * ref_uniform(&rng) - 3.0);
    const int64_t target = 400;
    check_elementwise(logits, &target, 1, V, NULL, "N = 1");
    const hand_options every = {0.2, 10.0, 1e-3, 1, -1};
    check_elementwise(logits, &target, 1, V, &every, "N = 1, every option");
    /* And through the GEMM, generic tolerances. */
    for (size_t r = 0; r < TU_COUNT(reductions); r++) {
        ce_case_spec s = base_spec(1, 9, 777, 2400 + r);
        s.reduction = reductions[r];
        s.bias = 1;
        s.label_smoothing = 0.2;
        s.class_weights = 1;
        s.softcap = 10.0;
        s.z_loss = 1e-3;
        check_spec_both_paths(s, "N = 1 through the GEMM");
    }
}

/* Logits spread over [-1e3, 1e3] with near-ties at the top (gaps 0.25 .. 1.5) so that p is neither 0 nor 1;
 * targets on the maximum, on the runner-up, far below, on either side of tile edges (tile_vocab 16). */
static void test_logits_times_1e3(void)
{
    enum { N = 6, V = 41 };
    float logits[N * V];
    uint64_t rng = 77;
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < V; j++)
            logits[i * V + j] = (float)(2e3 * ref_uniform(&rng) - 1e3);
    static const int64_t top[N] = {0, 15, 16, 40, 31, 7}, second[N] = {1, 16, 15, 39, 32, 33};
    for (int64_t i = 0; i < N; i++) {
        logits[i * V + top[i]] = (float)(1000.0 + 0.5 * (double)i);
        logits[i * V + second[i]] = (float)(1000.0 + 0.5 * (double)i - 0.25 * (double)(i + 1));
    }
    const int64_t targets[N] = {0, 16, 3, 40, 32, 20};
    check_elementwise(logits, targets, N, V, NULL, "logits x 1e3");
    const hand_options z = {0.05, 0.0, 1e-4, 1, 2};
    check_elementwise(logits, targets, N, V, &z, "logits x 1e3, smoothing, class weights, z-loss");
}

/* Rows whose target has probability 1 - 1e-7: the target's logit 0, the others at a common value c with
 * (V - 1) e^c = 1e-7 / (1 - 1e-7), or spread around it; the target at either end of the row and on a tile
 * edge. Also prints the relative error of the target's gradient component. */
static void test_target_probability_near_one(void)
{
    enum { N = 4, V = 50 };
    float logits[N * V];
    const int64_t targets[N] = {0, 49, 16, 15};
    const double tail = 1e-7 / (1.0 - 1e-7);
    uint64_t rng = 78;
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < V; j++) {
            const double c = log(tail / (double)(V - 1));
            /* rows 2 and 3: spread by +-1 around c (the tail's sum then differs slightly from 1e-7). */
            logits[i * V + j] = j == targets[i] ? 0.0f : (float)(c + (i >= 2 ? 2.0 * ref_uniform(&rng) - 1.0 : 0.0));
        }
    check_elementwise(logits, targets, N, V, NULL, "target probability 1 - 1e-7");
    /* Report the measured relative errors of the loss and of dZ_y (dweight at (i, y)). */
    cp_problem p;
    cp_problem_from_logits(&p, N, V, FH_LAYOUT_HV, logits);
    p.options.reduction = FH_REDUCTION_SUM;
    for (int64_t i = 0; i < N; i++)
        p.targets[i] = targets[i];
    for (int train_step = 0; train_step <= 1; train_step++) {
        const cp_config cfg = {.threads = 1, .tile_vocab = 16, .train_step = train_step};
        cp_fused f;
        TU_CHECK(cp_run_fused(&p, &cfg, &f) == FH_OK, "run");
        cp_reference r;
        cp_run_reference(&p, 0.0f, &r);
        double worst = 0.0;
        const double loss_rel = fabs(f.loss - r.loss) / fabs(r.loss);
        for (int64_t i = 0; i < N; i++) {
            const size_t w = cp_weight_index(&p, i, targets[i]);
            worst = fmax(worst, fabs(f.dweight[w] - r.dweight[w]) / fabs(r.dweight[w]));
        }
        printf("\n    p_y = 1 - 1e-7, %s: loss %.9e, relative error %.2e; target's dZ relative error up to %.2f",
               train_step ? "train step" : "split pair", f.loss, loss_rel, worst);
        TU_CHECK(loss_rel <= 4.0 * TU_FP32_U, "loss relative error %.3e > 4u", loss_rel);
        cp_reference_free(&r);
        cp_fused_free(&f);
    }
    cp_problem_free(&p);
}

/* Rows [0, -x] with the target on the 0: the per-token loss is log(1 + e^-x), e^-x to within u for large x, so its
 * bound (about 4u of itself: 3u (1 - p_max) + u) checks the row kernels' exp to about 2 ulps over its normal range,
 * x up to 86.8 (e^-86.8 ~ 2e-38; beyond 87.3 the loss is subnormal), in the split pair and in the train step (whose
 * gradient takes p from the fold's exps). Measured: the AVX-512 exp with its Taylor polynomial cut to degree 5
 * (error up to ~40u) fails it; at degree 6 (~2u) it passes. */
static void test_exp_range(void)
{
    enum { N = 96, V = 2 };
    float logits[N * V];
    int64_t targets[N] = {0};
    for (int64_t i = 0; i < N; i++) {
        logits[i * V] = 0.0f;
        logits[i * V + 1] = (float)(-86.0 * (double)(i + 1) / N - 0.37 * (double)(i % 3));
    }
    check_elementwise(logits, targets, N, V, NULL, "rows [0, -x], x in (0, 86.8]");
}

static const tu_test tests[] = {
    {"V = 1", test_vocab_one},
    {"V = 1,000,003, N = 3, H = 4", test_vocab_million},
    {"label_smoothing = 1", test_label_smoothing_one},
    {"softcap 1e-3, logits of the cap's size", test_tiny_softcap_unsaturated},
    {"softcap 1e-3, saturated (fp32 bounds)", test_tiny_softcap_saturated},
    {"N = 1", test_single_token},
    {"GRPO: V = 1 and V = 1,000,003", test_grpo_extreme_vocab},
    {"GRPO: one token, exact logits", test_grpo_single_token},
    {"logits x 1e3 (fp32 bounds)", test_logits_times_1e3},
    {"target probability 1 - 1e-7 (fp32 bounds)", test_target_probability_near_one},
    {"exp over its range: rows [0, -x] (fp32 bounds)", test_exp_range},
};
const tu_suite suite_numeric_extremes = {tests, TU_COUNT(tests)};
