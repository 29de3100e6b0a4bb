/* Top-k teacher distillation in double over materialized logits (ref_distill_topk.h): TRL's tensors entry by entry,
 * and the gradient by the chain rule through them. */
#include "ref_distill_topk.h"

#include <math.h>
#include <stdlib.h>

static const double TAIL_CLAMP = -1e-7; /* TRL's _add_tail_bucket: log_sum = clamp(log_sum, max=-1e-7) */

void ref_distill_topk_options_default(ref_distill_topk_options *o)
{
    const ref_distill_topk_options d = {1, 1.0, 1.0, 0.0, -100, 0};
    *o = d;
}

static int options_valid(const ref_distill_topk_options *o)
{
    return o && (o->add_tail == 0 || o->add_tail == 1) && o->temperature > 0.0 && o->weight_soft_loss >= 0.0 &&
           o->weight_hard_loss >= 0.0 && o->reduction >= 0 && o->reduction <= 2;
}

/* logsumexp of the valid entries of x (-inf when none). */
static double valid_lse(const double *x, const int *valid, int64_t k)
{
    double max = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < k; e++)
        if (valid[e] && x[e] > max)
            max = x[e];
    if (max == -INFINITY)
        return -INFINITY;
    for (int64_t e = 0; e < k; e++)
        if (valid[e])
            sum += exp(x[e] - max);
    return max + log(sum);
}

/* The sparse distributions of one side (k entries, then the tail at [k] when add_tail): x = log-probs as TRL forms
 * them; *lse the valid entries' logsumexp. */
static void sparse_side(const double *l, const int *valid, int64_t k, int add_tail, double *x, double *lse)
{
    *lse = valid_lse(l, valid, k);
    for (int64_t e = 0; e < k; e++)
        x[e] = valid[e] ? (add_tail ? l[e] : l[e] - *lse) : 0.0;
    if (add_tail)
        x[k] = log(-expm1(fmin(*lse, TAIL_CLAMP)));
}

/* D of one row and, with gs (k + 1 scratch) and g (vocab, may be NULL), g += scale dD/ds over the vocabulary. lp: the
 * row's log p (tempered log-softmax). */
static double row_kl(const double *lp, int64_t vocab, const ref_topk_teacher *t, int64_t i, int add_tail,
                     double *scratch, double *g, double scale)
{
    const int64_t k = t->k;
    int *valid = malloc(sizeof(int) * (size_t)k);
    double *ls = scratch, *lt = scratch + k, *xs = scratch + 2 * k, *xt = scratch + 3 * k + 1;
    if (!valid)
        return NAN;
    int64_t any = 0;
    for (int64_t e = 0; e < k; e++) {
        const double a = t->logprobs[i * k + e];
        valid[e] = a > -INFINITY;
        any += valid[e];
        lt[e] = a;
        ls[e] = valid[e] ? lp[t->ids[i * k + e]] : -INFINITY;
    }
    double lse_s, lse_t;
    sparse_side(ls, valid, k, add_tail, xs, &lse_s);
    sparse_side(lt, valid, k, add_tail, xt, &lse_t);
    double d = 0.0;
    for (int64_t e = 0; e < k + add_tail; e++)
        if (e == k || valid[e])
            d += exp(xt[e]) * (xt[e] - xs[e]);
    if (!any) {
        free(valid);
        return 0.0; /* TRL: every entry masked (no tail: NaN masked to 0; tail: 1 (0 - 0)) */
    }
    if (g) {
        /* dD/dxs_e = -qt_e. Without the tail xs_e = ls_e - lse_s; with it the tail's xs depends on lse_s through
         * d xs_tail / d lse_s = -exp(lse_s) / (1 - exp(lse_s)) (0 where the clamp holds it). Then
         * d ls_e / ds_j = [j = id_e] - p_j and d lse_s / d ls_e = exp(ls_e - lse_s). */
        double dlse = 0.0; /* dD / d lse_s */
        double *dls = xs;  /* reused: dD / d ls_e */
        for (int64_t e = 0; e < k; e++)
            dls[e] = valid[e] ? -exp(xt[e]) : 0.0;
        if (add_tail)
            dlse = lse_s <= TAIL_CLAMP ? -exp(xt[k]) * (-exp(lse_s) / -expm1(lse_s)) : 0.0;
        else
            for (int64_t e = 0; e < k; e++)
                dlse -= dls[e]; /* xs_e = ls_e - lse_s */
        for (int64_t e = 0; e < k; e++)
            if (valid[e])
                dls[e] += dlse * exp(ls[e] - lse_s);
        double sum_dls = 0.0;
        for (int64_t e = 0; e < k; e++)
            if (valid[e]) {
                g[t->ids[i * k + e]] += scale * dls[e];
                sum_dls += dls[e];
            }
        for (int64_t j = 0; j < vocab; j++)
            g[j] -= scale * sum_dls * exp(lp[j]);
    }
    free(valid);
    return d;
}

int ref_distill_topk_head(int64_t n, int64_t vocab, const double *u, const ref_topk_teacher *t,
                          const int64_t *targets, const ref_distill_topk_options *o, const double *grad_output,
                          ref_distill_result *r, double *du)
{
    if (n <= 0 || vocab <= 0 || !u || !t || t->k < 1 || !t->ids || !t->logprobs || !options_valid(o) ||
        (du && !grad_output) || (!targets && o->weight_hard_loss != 0.0))
        return -2;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (targets && targets[i] == o->ignore_index)
            continue;
        if (targets && (targets[i] < 0 || targets[i] >= vocab))
            return -2;
        for (int64_t e = 0; e < t->k; e++) {
            const double a = t->logprobs[i * t->k + e];
            const int64_t id = t->ids[i * t->k + e];
            if (isnan(a) || a == INFINITY || (a > -INFINITY && (id < 0 || id >= vocab)))
                return -2;
        }
        count++;
    }
    double *lp = malloc(sizeof(double) * (size_t)vocab), *scratch = malloc(sizeof(double) * (size_t)(4 * t->k + 2));
    if (!lp || !scratch) {
        free(lp), free(scratch);
        return -1;
    }
    const double ws = o->weight_soft_loss, wh = o->weight_hard_loss, temp = o->temperature;
    const double scale = o->reduction == 0 ? (count > 0 ? 1.0 / (double)count : 0.0) : 1.0;
    double loss = 0.0, soft = 0.0, hard = 0.0;
    int rc = 0;
    for (int64_t i = 0; i < n && rc == 0; i++) {
        const double *ui = u + i * vocab;
        double *g = du ? du + i * vocab : NULL;
        for (int64_t j = 0; g && j < vocab; j++)
            g[j] = 0.0;
        if (targets && targets[i] == o->ignore_index) {
            if (r && r->per_token_loss)
                r->per_token_loss[i] = 0.0;
            continue;
        }
        double max = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < vocab; j++)
            max = fmax(max, ui[j] / temp);
        for (int64_t j = 0; j < vocab; j++)
            sum += exp(ui[j] / temp - max);
        for (int64_t j = 0; j < vocab; j++)
            lp[j] = ui[j] / temp - max - log(sum);
        const double go = g ? (o->reduction == 2 ? grad_output[i] : grad_output[0]) * scale : 0.0;
        /* dD/ds / T: the chain rule through s = u / T. */
        const double d = row_kl(lp, vocab, t, i, o->add_tail, scratch, g && ws != 0.0 ? g : NULL, go * ws / temp);
        if (isnan(d)) {
            rc = -1;
            break;
        }
        const double lse = ref_linear_row_lse(ui, vocab);
        const double ce = targets ? lse - ui[targets[i]] : 0.0;
        const double l = ws * d + (wh != 0.0 ? wh * ce : 0.0);
        if (r && r->per_token_loss)
            r->per_token_loss[i] = l;
        loss += l;
        soft += d;
        hard += ce;
        if (g && wh != 0.0) {
            for (int64_t j = 0; j < vocab; j++)
                g[j] += go * wh * exp(ui[j] - lse);
            g[targets[i]] -= go * wh;
        }
    }
    if (r && rc == 0) {
        r->loss = loss * scale;
        r->soft_loss = soft * scale;
        r->hard_loss = hard * scale;
    }
    free(lp), free(scratch);
    return rc;
}

int ref_distill_topk_linear(const ref_linear *student, const ref_topk_teacher *teacher, const int64_t *targets,
                            const ref_distill_topk_options *o, const double *grad_output, ref_distill_result *r,
                            double *dx, double *dweight, double *dbias)
{
    const int backward = dx || dweight || dbias;
    if (!student || student->n <= 0 || student->hidden <= 0 || student->vocab <= 0 || !student->x ||
        !student->weight || (backward && !grad_output))
        return -2;
    double *u = ref_linear_logits(student);
    double *du = backward ? malloc(sizeof(double) * (size_t)(student->n * student->vocab)) : NULL;
    int rc = !u || (backward && !du) ? -1 : 0;
    if (rc == 0)
        rc = ref_distill_topk_head(student->n, student->vocab, u, teacher, targets, o, grad_output, r, du);
    if (rc == 0 && backward)
        ref_linear_backward(student, du, dx, dweight, dbias);
    free(u), free(du);
    return rc;
}
