/* The reference: logits = cap(m (x W + b)), log-softmax, torch's formulas, all in double, all materialized. */
#include "ref_ce.h"

#include <math.h>
#include <stdlib.h>

double ref_ce_transform(const ref_ce_options *o, double u, double *dzdu)
{
    const double m = o->logit_scale, c = o->softcap;
    double z = m * u, d = m;
    if (c > 0.0) {
        const double t = tanh(m * u / c);
        z = c * t;
        d = m * (1.0 - t * t);
    }
    if (dzdu)
        *dzdu = d;
    return z;
}

/* z = cap(m u) over the linear's logits u, in place. Also returns dz/du if dzdu != NULL. */
static double *logits(const ref_linear *lin, const ref_ce_options *o, double **dzdu)
{
    const int64_t n = lin->n, v = lin->vocab;
    double *z = ref_linear_logits(lin);
    double *d = dzdu ? malloc(sizeof(double) * (size_t)(n * v)) : NULL;
    if (!z || (dzdu && !d)) {
        free(z);
        free(d);
        return NULL;
    }
    for (int64_t i = 0; i < n * v; i++)
        z[i] = ref_ce_transform(o, z[i], d ? &d[i] : NULL);
    if (dzdu)
        *dzdu = d;
    return z;
}

static double weight_of(const ref_ce_options *o, int64_t j)
{
    return o->class_weights ? o->class_weights[j] : 1.0;
}

/* DFT's factor of token i (1 without token_scaling): the given constant, or p_y = exp(z_y - lse). */
static double token_scale(const ref_ce_options *o, int64_t i, double z_target, double lse)
{
    if (!o->token_scaling)
        return 1.0;
    return o->token_scales ? o->token_scales[i] : exp(z_target - lse);
}

/* Mean denominators: sum of the targets' weights (CE part), count of non-ignored tokens (z-loss). */
static void denominators(const ref_linear *lin, const int64_t *t, const ref_ce_options *o, double *wsum,
                         double *count)
{
    *wsum = *count = 0.0;
    for (int64_t i = 0; i < lin->n; i++)
        if (t[i] != o->ignore_index) {
            *wsum += weight_of(o, t[i]);
            *count += 1.0;
        }
}

int ref_ce_forward(const ref_linear *lin, const int64_t *t, const ref_ce_options *o, ref_ce_result *r)
{
    const int64_t n = lin->n, v = lin->vocab;
    double *z = logits(lin, o, NULL);
    if (!z)
        return -1;
    const double eps = o->label_smoothing;
    double ce_sum = 0.0, zl_sum = 0.0;
    r->correct = 0;
    for (int64_t i = 0; i < n; i++) {
        const double *zi = z + i * v;
        const double lse = ref_linear_row_lse(zi, v);
        int64_t am = 0;
        for (int64_t j = 1; j < v; j++)
            if (zi[j] > zi[am])
                am = j;
        double ce = 0.0, zl = 0.0, logp = 0.0, entropy = 0.0;
        if (t[i] != o->ignore_index) {
            logp = zi[t[i]] - lse;
            ce = -(1.0 - eps) * weight_of(o, t[i]) * logp;
            for (int64_t j = 0; j < v; j++) {
                ce -= eps / (double)v * weight_of(o, j) * (zi[j] - lse);
                entropy -= exp(zi[j] - lse) * (zi[j] - lse);
            }
            zl = o->z_loss * lse * lse;
            const double scale = token_scale(o, i, zi[t[i]], lse);
            ce *= scale;
            zl *= scale;
            r->correct += am == t[i];
        }
        ce_sum += ce;
        zl_sum += zl;
        if (r->per_token_loss)
            r->per_token_loss[i] = ce + zl;
        if (r->logp)
            r->logp[i] = logp;
        if (r->lse)
            r->lse[i] = lse;
        if (r->entropy)
            r->entropy[i] = entropy;
        if (r->argmax)
            r->argmax[i] = am;
    }
    if (o->reduction == 0) {
        double wsum, count;
        denominators(lin, t, o, &wsum, &count);
        ce_sum = wsum > 0.0 ? ce_sum / wsum : 0.0;
        zl_sum = count > 0.0 ? zl_sum / count : 0.0;
    }
    r->loss = ce_sum + zl_sum;
    r->z_loss = zl_sum;
    free(z);
    return 0;
}

int ref_ce_backward(const ref_linear *lin, const int64_t *t, const ref_ce_options *o, const double *grad_output,
                    double *dx, double *dweight, double *dbias)
{
    const int64_t n = lin->n, v = lin->vocab;
    double *dzdu = NULL;
    double *z = logits(lin, o, &dzdu);
    if (!z)
        return -1;
    double wsum, count;
    denominators(lin, t, o, &wsum, &count);
    const double eps = o->label_smoothing;
    double *soft = NULL, *row_c = NULL, *row_scale = NULL, *du_dx = NULL, *du_dw = NULL;
    if (o->filter) {
        soft = calloc((size_t)(n * v), sizeof(double));
        row_c = calloc((size_t)n, sizeof(double));
        row_scale = calloc((size_t)n, sizeof(double));
        du_dx = malloc((size_t)(n * v) * sizeof(double));
        du_dw = malloc((size_t)(n * v) * sizeof(double));
        if (!soft || !row_c || !row_scale || !du_dx || !du_dw) {
            free(soft), free(row_c), free(row_scale), free(du_dx), free(du_dw), free(z), free(dzdu);
            return -1;
        }
    }
    /* Overwrite z with du = d loss / d u, row by row. */
    for (int64_t i = 0; i < n; i++) {
        double *zi = z + i * v;
        const double lse = ref_linear_row_lse(zi, v);
        if (t[i] == o->ignore_index) {
            for (int64_t j = 0; j < v; j++)
                zi[j] = 0.0;
            continue;
        }
        /* DFT scales the token's loss by a constant: its gradient, by the same constant. */
        const double g = (o->reduction == 2 ? grad_output[i] : grad_output[0]) * token_scale(o, i, zi[t[i]], lse);
        const double g_ce = o->reduction == 0 ? (wsum > 0.0 ? g / wsum : 0.0) : g;
        const double g_z = o->reduction == 0 ? (count > 0.0 ? g / count : 0.0) : g;
        double wtotal = 0.0;
        for (int64_t j = 0; j < v; j++)
            wtotal += weight_of(o, j);
        /* The coefficients of p (a) and of the target's onehot (b), as the fused head has them. */
        const double a = g_ce * ((1.0 - eps) * weight_of(o, t[i]) + eps / (double)v * wtotal) + g_z * 2.0 * o->z_loss * lse;
        const double b = -g_ce * (1.0 - eps) * weight_of(o, t[i]);
        if (row_c) {
            row_c[i] = g_ce * eps;
            row_scale[i] = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
        }
        for (int64_t j = 0; j < v; j++) {
            const double p = exp(zi[j] - lse);
            const double onehot = j == t[i] ? 1.0 : 0.0;
            const double dce = (1.0 - eps) * weight_of(o, t[i]) * (p - onehot) +
                               eps / (double)v * (wtotal * p - weight_of(o, j));
            const double dzl = 2.0 * o->z_loss * lse * p;
            if (soft) /* the a p part of dce + dzl: what filtering may drop */
                soft[i * v + j] = a * p * dzdu[i * v + j];
            zi[j] = (g_ce * dce + g_z * dzl) * dzdu[i * v + j];
        }
    }
    if (o->filter) {
        const ref_filter_input in = {z, soft, row_scale, row_c};
        const int rc = ref_filter_apply(o->filter, n, v, t, &in, du_dx, du_dw);
        if (rc == 0) {
            ref_linear_backward(lin, du_dx, dx, NULL, NULL);
            ref_linear_backward(lin, du_dw, NULL, dweight, NULL);
            ref_linear_backward(lin, z, NULL, NULL, dbias);
        }
        free(soft), free(row_c), free(row_scale), free(du_dx), free(du_dw);
        if (rc != 0) {
            free(z), free(dzdu);
            return -1;
        }
    } else
        ref_linear_backward(lin, z, dx, dweight, dbias);
    free(z);
    free(dzdu);
    return 0;
}
