/* The double reference checked on its own terms, since every other suite trusts it:
 *   - its gradients (ref_ce_backward) against central finite differences of its loss (ref_ce_forward),
 *   - its forward against the header's formula, evaluated here independently.
 * Each reduction, with no options, with every option on (label smoothing, class weights, softcap, logit_scale,
 * z-loss, an ignored row), and with those and DFT's token scaling (its factor p_y held fixed for the finite
 * differences, as the stop-gradient says). */
#include "ce_case.h"
#include "ref_ce.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 6, H = 4, V = 9, IGNORED_ROW = 4 };

typedef struct dproblem {
    double x[N * H], w[H * V], b[V], cw[V], g[N], p_y[N];
    int64_t t[N];
    ref_ce_options o;
    ref_linear lin;
} dproblem;

enum { PLAIN, ALL_OPTIONS, ALL_AND_DFT };

static void dproblem_make(dproblem *d, int options, int reduction, uint64_t seed)
{
    uint64_t rng = seed;
    memset(d, 0, sizeof *d);
    for (int i = 0; i < N * H; i++)
        d->x[i] = 2.0 * ref_uniform(&rng) - 1.0;
    for (int i = 0; i < H * V; i++)
        d->w[i] = 3.0 * (2.0 * ref_uniform(&rng) - 1.0); /* logits of size ~3 */
    for (int j = 0; j < V; j++) {
        d->b[j] = ref_uniform(&rng) - 0.5;
        d->cw[j] = 0.5 + ref_uniform(&rng);
    }
    for (int i = 0; i < N; i++) {
        d->t[i] = (int64_t)(ref_uniform(&rng) * V);
        d->g[i] = 2.0 * ref_uniform(&rng) - 1.0;
    }
    d->g[0] = 0.75; /* serves mean and sum */
    /* logit_scale 0.7 with softcap 2.5: m u / c ~ 0.8, tanh well into its nonlinear range. */
    const ref_ce_options plain = {.ignore_index = -100, .reduction = reduction, .logit_scale = 1.0};
    const ref_ce_options all = {.ignore_index = -100, .reduction = reduction, .label_smoothing = 0.1,
                                .class_weights = d->cw, .softcap = 2.5, .z_loss = 1e-2, .logit_scale = 0.7,
                                .token_scaling = options == ALL_AND_DFT};
    d->o = options == PLAIN ? plain : all;
    if (options != PLAIN)
        d->t[IGNORED_ROW] = -100;
    const ref_linear lin = {N, H, V, d->x, d->w, d->b};
    d->lin = lin;
    /* DFT's factors at these inputs, for the finite differences to hold fixed (objective()). */
    double logp[N];
    ref_ce_result r = {.logp = logp};
    ref_ce_forward(&d->lin, d->t, &d->o, &r);
    for (int i = 0; i < N; i++)
        d->p_y[i] = exp(logp[i]);
}

/* The scalar whose gradient ref_ce_backward returns: g * loss (mean, sum) or sum_i g_i loss_i (none), with DFT's
 * factors the constants p_y of the unperturbed inputs. */
static double objective(const dproblem *d)
{
    double ptl[N];
    ref_ce_options o = d->o;
    o.token_scales = d->p_y;
    ref_ce_result r = {.per_token_loss = ptl};
    ref_ce_forward(&d->lin, d->t, &o, &r);
    if (d->o.reduction != 2)
        return d->g[0] * r.loss;
    double f = 0.0;
    for (int i = 0; i < N; i++)
        f += d->g[i] * ptl[i];
    return f;
}

/* Central differences with step h = 1e-6 on O(1) inputs:
 *   truncation  h^2 / 6 * |F'''| ~ 1e-12 * O(|w|^3) ~ 1e-11 relative: negligible;
 *   roundoff    F(+h) and F(-h) each carry ~ c * eps * |F| of rounding (eps = 2.2e-16, c a small count:
 *               observed c < 2 here), so the quotient carries ~ c * eps * |F| / h ~ 2e-10 * c * |F|.
 * Tolerance: |fd - an| <= 1e-6 * |an| + 10 * eps * (1 + |F|) / h. The first term is the relative 1e-6
 * agreement, >= 20x above what is observed; the second is the roundoff floor (with c = 10, ~2e-9 * |F|),
 * which only matters for entries near 0 (the ignored row's, exactly 0 on both sides). */
static void check_fd(int options, int reduction)
{
    dproblem d;
    dproblem_make(&d, options, reduction, 17 + (uint64_t)reduction + 10 * (uint64_t)options);
    double dx[N * H], dw[H * V], db[V];
    const int rc = ref_ce_backward(&d.lin, d.t, &d.o, d.g, dx, dw, db);
    TU_CHECK(rc == 0, "ref_ce_backward failed");
    const double f0 = objective(&d);
    const struct {
        const char *name;
        double *param;
        const double *grad;
        int entries[4];
    } tensors[] = {
        {"x", d.x, dx, {0 * H + 0, 2 * H + 3, 5 * H + 1, IGNORED_ROW * H + 2}},
        {"weight", d.w, dw, {0 * V + 0, 3 * V + 8, 1 * V + 4, 2 * V + 7}},
        {"bias", d.b, db, {0, 4, 8, 3}},
    };
    const double h = 1e-6, floor = 10.0 * DBL_EPSILON * (1.0 + fabs(f0)) / h;
    for (size_t t = 0; t < TU_COUNT(tensors); t++) {
        for (int e = 0; e < 4; e++) {
            const int k = tensors[t].entries[e];
            double *p = &tensors[t].param[k];
            const double saved = *p;
            *p = saved + h;
            const double fp = objective(&d);
            *p = saved - h;
            const double fm = objective(&d);
            *p = saved;
            const double fd = (fp - fm) / (2.0 * h), an = tensors[t].grad[k];
            const double tol = 1e-6 * fabs(an) + floor;
            TU_CHECK(fabs(fd - an) <= tol,
                     "options %d, reduction %d: d%s[%d]: analytic %.12g, finite difference %.12g, |diff| %.3e > %.3e "
                     "(F = %g)",
                     options, reduction, tensors[t].name, k, an, fd, fabs(fd - an), tol, f0);
        }
    }
    if (options != PLAIN)
        for (int k = 0; k < H; k++)
            TU_CHECK(dx[IGNORED_ROW * H + k] == 0.0, "reduction %d: the ignored row has dx %g", reduction,
                     dx[IGNORED_ROW * H + k]);
}

static void test_fd_plain(void)
{
    for (int r = 0; r < 3; r++)
        check_fd(PLAIN, r);
}

static void test_fd_all_options(void)
{
    for (int r = 0; r < 3; r++)
        check_fd(ALL_OPTIONS, r);
}

static void test_fd_dft(void)
{
    for (int r = 0; r < 3; r++)
        check_fd(ALL_AND_DFT, r);
}

/* The header's formula, written out here without the reference's max shift or its order of sums:
 *   z_j = c tanh(m u_j / c) (m u_j without softcap),  p = softmax(z),
 *   ce_i = -sum_j q_ij log p_ij,  q_ij = (1 - eps) w_y [j = y] + (eps / V) w_j,   zl_i = z_loss lse_i^2
 * (equal to the header's (1-eps) w_y (lse - z_y) + eps/V sum_j w_j (lse - z_j)), both times p_y with DFT; mean
 * divides the ce part by sum w_y and the z part by the count of active tokens; the entropy -sum_j p_j log p_j; the
 * correct count over active tokens whose first largest z is the target. Both sides are double with logits ~3:
 * they differ by summation-order roundoff ~V * eps relative, so 1e-12 relative leaves >= 1000x margin. */
static void test_forward_formula(void)
{
    for (int options = PLAIN; options <= ALL_AND_DFT; options++)
        for (int red = 0; red < 3; red++) {
            dproblem d;
            dproblem_make(&d, options, red, 40 + (uint64_t)red);
            double ptl[N], logp[N], lse[N], entropy[N];
            int64_t am[N];
            ref_ce_result r = {0, 0, ptl, logp, lse, entropy, am, -1};
            TU_CHECK(ref_ce_forward(&d.lin, d.t, &d.o, &r) == 0, "ref_ce_forward failed");
            const double eps = d.o.label_smoothing, m = d.o.logit_scale, c = d.o.softcap;
            double ce_sum = 0.0, zl_sum = 0.0, wsum = 0.0, count = 0.0;
            int64_t correct = 0;
            for (int i = 0; i < N; i++) {
                double z[V], s = 0.0;
                int first_max = 0;
                for (int j = 0; j < V; j++) {
                    double u = d.b[j];
                    for (int k = 0; k < H; k++)
                        u += d.x[i * H + k] * d.w[k * V + j];
                    z[j] = c > 0.0 ? c * tanh(m * u / c) : m * u;
                    s += exp(z[j]);
                    first_max = z[j] > z[first_max] ? j : first_max;
                }
                const double l = log(s);
                double ce = 0.0, zl = 0.0, lp = 0.0, h = 0.0;
                if (d.t[i] != d.o.ignore_index) {
                    const int64_t y = d.t[i];
                    const double wy = d.o.class_weights ? d.o.class_weights[y] : 1.0;
                    for (int j = 0; j < V; j++) {
                        const double wj = d.o.class_weights ? d.o.class_weights[j] : 1.0;
                        const double q = (j == y ? (1.0 - eps) * wy : 0.0) + eps / V * wj;
                        ce -= q * (z[j] - l);
                        h -= exp(z[j]) / s * (z[j] - l);
                    }
                    zl = d.o.z_loss * l * l;
                    lp = z[y] - l;
                    if (d.o.token_scaling) {
                        ce *= exp(z[y]) / s;
                        zl *= exp(z[y]) / s;
                    }
                    wsum += wy;
                    count += 1.0;
                    correct += first_max == y;
                }
                TU_CHECK(fabs(ptl[i] - (ce + zl)) <= 1e-12 * (1.0 + fabs(ce + zl)) && fabs(lse[i] - l) <= 1e-12 * (1.0 + fabs(l)) &&
                             fabs(logp[i] - lp) <= 1e-12 * (1.0 + fabs(lp)) && fabs(entropy[i] - h) <= 1e-12 * (1.0 + h) &&
                             am[i] == first_max,
                         "options %d, reduction %d, row %d: reference (%.17g, %.17g, %.17g, %.17g, %lld) vs formula (%.17g, "
                         "%.17g, %.17g, %.17g, %d) for (loss, lse, logp, entropy, argmax)",
                         options, red, i, ptl[i], lse[i], logp[i], entropy[i], (long long)am[i], ce + zl, l, lp, h,
                         first_max);
                ce_sum += ce;
                zl_sum += zl;
            }
            if (red == 0) {
                ce_sum /= wsum;
                zl_sum /= count;
            }
            const double loss = ce_sum + zl_sum;
            TU_CHECK(fabs(r.loss - loss) <= 1e-12 * fabs(loss) && fabs(r.z_loss - zl_sum) <= 1e-12 * (1.0 + fabs(zl_sum)) &&
                         r.correct == correct,
                     "options %d, reduction %d: reference loss %.17g z %.17g correct %lld, formula %.17g z %.17g correct "
                     "%lld", options, red, r.loss, r.z_loss, (long long)r.correct, loss, zl_sum, (long long)correct);
        }
}

static const tu_test tests[] = {
    {"finite differences, no options", test_fd_plain},
    {"finite differences, every option", test_fd_all_options},
    {"finite differences, every option and DFT (p_y held fixed)", test_fd_dft},
    {"forward matches the documented formula", test_forward_formula},
};
const tu_suite suite_reference = {tests, TU_COUNT(tests)};
