/* ref_logprob_fdcheck: checks ref_logprob's gradients against central finite differences of its objective
 * L = sum_i g_logp_i logp_i + g_entropy_i H_i + g_lse_i lse_i (ref_logprob.h), over temperatures 0.3, 1 and 2.5,
 * softcap off and 2, logit_scale 1 and 0.7, and the entropy and lse gradients each on and off, with two ignored
 * tokens; and each case again over a support (ref_logprob_support: about half the columns of each row, its target
 * among them). Prints one line per case, exits non-zero on any failure.
 *
 * Tolerance. For each gradient entry g (analytic) and f (finite difference) the error is
 * |f - g| / max(|f|, |g|, 1e-2 S), S the largest |g| of the case; every case must stay <= 1e-6. L is a smooth sum of
 * O(1) terms (logits O(1) before the temperature: at 0.3 they reach ~7, third derivatives stay O(10)): central
 * differences with h = 1e-6 have truncation error ~h^2 |L'''| / 6 ~ 2e-12 and rounding error ~1e-16 |L| / h ~ 1e-10,
 * so a correct gradient lands at 1e-8 to 2e-7 (the largest seen over the cases), while a wrong term (a missing 1/temperature, the
 * softcap's or the scale's chain factor, the entropy's lse - H shift, a gradient on an ignored row) is off by at
 * least a tenth of S. */
#include "fdcheck.h"
#include "ref_logprob.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 6, HID = 4, V = 7 };
static const double STEP = 1e-6, TOLERANCE = 1e-6;

/* The largest scaled error over the entries of one parameter array p (analytic gradient grad). */
static double check_array(ref_linear *lin, double *p, const double *grad, size_t count, const int64_t *targets,
                          const unsigned char *support, const ref_logprob_options *o, const ref_logprob_grads *g,
                          double scale)
{
    double worst = 0.0;
    for (size_t k = 0; k < count; k++) {
        const double keep = p[k];
        p[k] = keep + STEP;
        const double up = ref_logprob_support_objective(lin, targets, support, o, g);
        p[k] = keep - STEP;
        const double down = ref_logprob_support_objective(lin, targets, support, o, g);
        p[k] = keep;
        const double f = (up - down) / (2.0 * STEP);
        const double err = fabs(f - grad[k]) / fmax(fmax(fabs(f), fabs(grad[k])), 1e-2 * scale);
        worst = fmax(worst, err);
    }
    return worst;
}

static double largest(const double *a, size_t count, double m)
{
    for (size_t k = 0; k < count; k++)
        m = fmax(m, fabs(a[k]));
    return m;
}

int main(void)
{
    double x[N * HID], w[HID * V], b[V], g_logp[N], g_entropy[N], g_lse[N];
    fd_rng_state = 12345;
    fd_fill(x, N * HID, -1.0, 1.0);
    fd_fill(w, HID * V, -1.0, 1.0);
    fd_fill(b, V, -0.5, 0.5);
    int64_t targets[N];
    for (int i = 0; i < N; i++) {
        targets[i] = (int64_t)fd_uniform(0.0, V);
        g_logp[i] = fd_uniform(-1.0, 1.0);
        g_entropy[i] = fd_uniform(-1.0, 1.0);
        g_lse[i] = fd_uniform(-1.0, 1.0);
    }
    targets[1] = targets[4] = -100;
    unsigned char half[N * V];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < V; j++)
            half[i * V + j] = j == targets[i] || fd_uniform(0.0, 1.0) < 0.5;
    ref_linear lin = {N, HID, V, x, w, b};
    static const double temperatures[] = {0.3, 1.0, 2.5}, softcaps[] = {0.0, 2.0}, scales[] = {1.0, 0.7};
    for (int ti = 0; ti < 3; ti++)
        for (int ci = 0; ci < 2; ci++)
            for (int si = 0; si < 2; si++)
                for (int with = 0; with < 8; with++) {
                    const unsigned char *support = with & 4 ? half : NULL;
                    const ref_logprob_options o = {-100, temperatures[ti], softcaps[ci], scales[si]};
                    const ref_logprob_grads g = {g_logp, with & 1 ? g_entropy : NULL, with & 2 ? g_lse : NULL};
                    double dx[N * HID], dw[HID * V], db[V];
                    if (ref_logprob_support(&lin, targets, support, &o, NULL, NULL, NULL, &g, dx, dw, db) != 0)
                        return 2;
                    int ignored_rows_clean = 1;
                    for (int k = 0; k < HID; k++)
                        ignored_rows_clean &= dx[1 * HID + k] == 0.0 && dx[4 * HID + k] == 0.0;
                    const double scale = largest(db, V, largest(dw, HID * V, largest(dx, N * HID, 0.0)));
                    double err = check_array(&lin, x, dx, N * HID, targets, support, &o, &g, scale);
                    err = fmax(err, check_array(&lin, w, dw, HID * V, targets, support, &o, &g, scale));
                    err = fmax(err, check_array(&lin, b, db, V, targets, support, &o, &g, scale));
                    const int ok = err <= TOLERANCE && ignored_rows_clean;
                    fd_failures += !ok;
                    printf("%s temperature %.1f softcap %.0f logit_scale %.1f g_entropy %s g_lse %s%s: error %.2e%s\n",
                           ok ? "ok  " : "FAIL", o.temperature, o.softcap, o.logit_scale, with & 1 ? "on " : "off",
                           with & 2 ? "on " : "off", support ? " over a support" : "", err,
                           ignored_rows_clean ? "" : " (an ignored row has dx)");
                }
    return fd_failures != 0;
}
