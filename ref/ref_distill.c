/* The distillation reference: forward KL, reverse KL and TRL's generalized JSD written out in double, all logits
 * materialized, log-softmaxes from max-shifted log-sum-exps.
 *
 * Gradients, with a_j = log p_j - log r_j for a fixed distribution r and d log p_k / d s_j = [k == j] - p_j:
 *  - forward KL: d/ds_j sum_k q_k (log q_k - log p_k) = p_j - q_j.
 *  - reverse KL: d/dp_k of sum p (log p - log q) is a_k + 1 (r = q); through the softmax the constant drops out:
 *    dD/ds_j = p_j (a_j - D).
 *  - jsd: with m = beta q + (1 - beta) p, dD/dp_k = -beta (1 - beta) q_k / m_k + (1 - beta) (a_k + 1)
 *    - (1 - beta)^2 p_k / m_k = (1 - beta) (a_k + 1 - m_k / m_k) = (1 - beta) a_k (r = m); through the softmax:
 *    dD/ds_j = (1 - beta) p_j (a_j - K), K = sum_k p_k a_k.
 *  - d/du_s = (1 / temperature) d/ds; the hard part's d/du_s = softmax(u_s) - onehot(target). */
#include "ref_distill.h"

#include <math.h>
#include <stdlib.h>

void ref_distill_options_default(ref_distill_options *o)
{
    o->divergence = REF_DIVERGENCE_JSD;
    o->beta = 0.5;
    o->temperature = 1.0;
    o->weight_soft_loss = 1.0;
    o->weight_hard_loss = 0.0;
    o->ignore_index = -100;
    o->reduction = 0;
    o->top_k = 0;
    o->add_tail = 1;
}

static int options_valid(const ref_distill_options *o)
{
    return o && o->divergence >= REF_DIVERGENCE_FORWARD_KL && o->divergence <= REF_DIVERGENCE_JSD &&
           o->beta >= 0.0 && o->beta <= 1.0 && o->temperature > 0.0 && isfinite(o->temperature) &&
           o->weight_soft_loss >= 0.0 && isfinite(o->weight_soft_loss) && o->weight_hard_loss >= 0.0 &&
           isfinite(o->weight_hard_loss) && o->reduction >= 0 && o->reduction <= 2 && o->top_k >= 0 &&
           (o->add_tail == 0 || o->add_tail == 1);
}

/* TRL's special cases: jsd at beta 0 is forward KL, at beta 1 reverse KL. */
static ref_divergence effective_divergence(const ref_distill_options *o)
{
    if (o->divergence != REF_DIVERGENCE_JSD)
        return o->divergence;
    return o->beta == 0.0 ? REF_DIVERGENCE_FORWARD_KL
           : o->beta == 1.0 ? REF_DIVERGENCE_REVERSE_KL
                            : REF_DIVERGENCE_JSD;
}

/* a (la - lb), 0 when a == 0: 0 log 0 = 0, and an entry whose probability underflowed (or whose logit is -inf)
 * adds nothing rather than 0 * inf = NaN. */
static double plog(double a, double la, double lb)
{
    return a == 0.0 ? 0.0 : a * (la - lb);
}

static double logaddexp(double a, double b)
{
    const double hi = a > b ? a : b, lo = a > b ? b : a;
    return hi == -INFINITY ? -INFINITY : hi + log1p(exp(lo - hi));
}

/* log_softmax(u / temperature) into out. */
static void log_softmax(const double *u, int64_t v, double temperature, double *scaled, double *out)
{
    for (int64_t j = 0; j < v; j++)
        scaled[j] = u[j] / temperature;
    const double lse = ref_linear_row_lse(scaled, v);
    for (int64_t j = 0; j < v; j++)
        out[j] = scaled[j] - lse;
}

/* One row's D from the log-softmaxes lp, lq, and dD/ds into g if g is non-NULL. lm: [v] scratch. */
static double row_divergence(const double *lp, const double *lq, int64_t v, ref_divergence div, double beta,
                             double *lm, double *g)
{
    double d = 0.0;
    switch (div) {
    case REF_DIVERGENCE_FORWARD_KL:
        for (int64_t j = 0; j < v; j++)
            d += plog(exp(lq[j]), lq[j], lp[j]);
        for (int64_t j = 0; g && j < v; j++)
            g[j] = exp(lp[j]) - exp(lq[j]);
        break;
    case REF_DIVERGENCE_REVERSE_KL:
        for (int64_t j = 0; j < v; j++)
            d += plog(exp(lp[j]), lp[j], lq[j]);
        for (int64_t j = 0; g && j < v; j++)
            g[j] = plog(exp(lp[j]), lp[j], lq[j]) - exp(lp[j]) * d;
        break;
    default: { /* jsd, 0 < beta < 1 */
        const double log_b = log(beta), log_1mb = log1p(-beta);
        double kq = 0.0, kp = 0.0;
        for (int64_t j = 0; j < v; j++) {
            lm[j] = logaddexp(log_1mb + lp[j], log_b + lq[j]);
            kq += plog(exp(lq[j]), lq[j], lm[j]);
            kp += plog(exp(lp[j]), lp[j], lm[j]);
        }
        d = beta * kq + (1.0 - beta) * kp;
        for (int64_t j = 0; g && j < v; j++)
            g[j] = (1.0 - beta) * (plog(exp(lp[j]), lp[j], lm[j]) - exp(lp[j]) * kp);
        break;
    }
    }
    return d;
}

/* The k largest of a[0 .. v) into ids, largest first, ties to the lower index (insertion, O(v k)). */
static void top_ids(const double *a, int64_t v, int64_t k, int64_t *ids)
{
    int64_t m = 0;
    for (int64_t j = 0; j < v; j++) {
        if (m == k && !(a[j] > a[ids[k - 1]]))
            continue;
        int64_t at = m < k ? m++ : k - 1;
        for (; at > 0 && a[j] > a[ids[at - 1]]; at--)
            ids[at] = ids[at - 1];
        ids[at] = j;
    }
}

/* One entry's divergence term f(xs, xt) and G = df/dxs. */
static double entry_term(ref_divergence div, double beta, double xs, double xt, double *g)
{
    const double p = exp(xs), q = exp(xt);
    if (div == REF_DIVERGENCE_FORWARD_KL) {
        *g = -q;
        return plog(q, xt, xs);
    }
    if (div == REF_DIVERGENCE_REVERSE_KL) {
        *g = p * (xs - xt) + p;
        return plog(p, xs, xt);
    }
    const double lm = log(beta * q + (1.0 - beta) * p);
    *g = (1.0 - beta) * plog(p, xs, lm);
    return beta * plog(q, xt, lm) + (1.0 - beta) * plog(p, xs, lm);
}

static double lse_at(const double *a, const int64_t *ids, int64_t m)
{
    double max = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < m; e++)
        max = fmax(max, a[ids[e]]);
    for (int64_t e = 0; e < m; e++)
        sum += exp(a[ids[e]] - max);
    return max + log(sum);
}

/* One row's D over its top-k support (ref_distill.h) from the log-softmaxes lp, lq, and dD/ds into g if non-NULL.
 * ids: [2 k] scratch, in: [v] zeroed scratch (left zeroed). The gradient, with pi = softmax over S of lp:
 *   G_e = df/dxs_e;  renormalised: dD/dlp_e = G_e - pi_e sum G;  tail: dD/dlp_e = G_e + G_tail c pi_e,
 *   c = d tail / d logsumexp_S(lp) = -exp(L) / (1 - exp(L)) unless the clamp holds L (then 0);
 *   dD/ds_j = dD/dlp_j [j in S] - p_j sum_e dD/dlp_e. */
static double row_topk_divergence(const double *lp, const double *lq, int64_t v, ref_divergence div, double beta,
                                  int64_t k, int add_tail, int64_t *ids, unsigned char *in, double *g)
{
    static const double clamp = -1e-7; /* TRL's _add_tail_bucket */
    int64_t m = 0;
    for (int side = 0; side < 2; side++) { /* the teacher's top-k, then the student's */
        if ((side == 0 && div == REF_DIVERGENCE_REVERSE_KL) || (side == 1 && div == REF_DIVERGENCE_FORWARD_KL))
            continue;
        int64_t *top = ids + m;
        top_ids(side == 0 ? lq : lp, v, k, top);
        for (int64_t e = 0; e < k; e++)
            if (!in[top[e]]) {
                in[top[e]] = 1;
                ids[m++] = top[e];
            }
    }
    const double l_p = lse_at(lp, ids, m), l_q = lse_at(lq, ids, m);
    const double shift_p = add_tail ? 0.0 : l_p, shift_q = add_tail ? 0.0 : l_q;
    double d = 0.0, sum_g = 0.0, g_tail = 0.0, c = 0.0;
    for (int64_t e = 0; e < m; e++) {
        double ge;
        d += entry_term(div, beta, lp[ids[e]] - shift_p, lq[ids[e]] - shift_q, &ge);
        sum_g += ge;
    }
    if (add_tail) {
        d += entry_term(div, beta, log(-expm1(fmin(l_p, clamp))), log(-expm1(fmin(l_q, clamp))), &g_tail);
        c = l_p <= clamp ? -exp(l_p) / -expm1(l_p) : 0.0;
    }
    if (g) {
        for (int64_t j = 0; j < v; j++)
            g[j] = 0.0;
        double sum_dlp = 0.0;
        for (int64_t e = 0; e < m; e++) {
            double ge;
            (void)entry_term(div, beta, lp[ids[e]] - shift_p, lq[ids[e]] - shift_q, &ge);
            const double pi = exp(lp[ids[e]] - l_p);
            g[ids[e]] = add_tail ? ge + g_tail * c * pi : ge - pi * sum_g;
            sum_dlp += g[ids[e]];
        }
        for (int64_t j = 0; j < v; j++)
            g[j] -= exp(lp[j]) * sum_dlp;
    }
    for (int64_t e = 0; e < m; e++)
        in[ids[e]] = 0;
    return d;
}

int ref_distill_head(int64_t n, int64_t vocab, const double *u_s, const double *u_t, const int64_t *targets,
                     const ref_distill_options *o, const double *grad_output, ref_distill_result *r, double *du_s)
{
    if (n <= 0 || vocab <= 0 || !u_s || !u_t || !options_valid(o) || (du_s && !grad_output) ||
        (!targets && o->weight_hard_loss != 0.0))
        return -2;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (targets && targets[i] == o->ignore_index)
            continue;
        if (targets && (targets[i] < 0 || targets[i] >= vocab))
            return -2;
        count++;
    }
    const int64_t v = vocab;
    const int64_t top_k = o->top_k > 0 && o->top_k < v ? o->top_k : 0;
    double *scratch = malloc(sizeof(double) * (size_t)(4 * v));
    int64_t *ids = top_k ? malloc(sizeof(int64_t) * (size_t)(2 * top_k)) : NULL;
    unsigned char *in = top_k ? calloc((size_t)v, 1) : NULL;
    if (!scratch || (top_k && (!ids || !in))) {
        free(scratch), free(ids), free(in);
        return -1;
    }
    double *scaled = scratch, *lp = scratch + v, *lq = scratch + 2 * v, *lm = scratch + 3 * v;
    const ref_divergence div = effective_divergence(o);
    const double ws = o->weight_soft_loss, wh = o->weight_hard_loss, temp = o->temperature;
    /* mean divides by the counted tokens; nothing counted leaves loss and gradients 0. */
    const double scale = o->reduction == 0 ? (count > 0 ? 1.0 / (double)count : 0.0) : 1.0;
    double loss = 0.0, soft = 0.0, hard = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double *us = u_s + i * v;
        double *g = du_s ? du_s + i * v : NULL;
        if (targets && targets[i] == o->ignore_index) {
            if (r && r->per_token_loss)
                r->per_token_loss[i] = 0.0;
            for (int64_t j = 0; g && j < v; j++)
                g[j] = 0.0;
            continue;
        }
        log_softmax(us, v, temp, scaled, lp);
        log_softmax(u_t + i * v, v, temp, scaled, lq);
        const double d = top_k ? row_topk_divergence(lp, lq, v, div, o->beta, top_k, o->add_tail, ids, in, g)
                               : row_divergence(lp, lq, v, div, o->beta, lm, g);
        const double lse = ref_linear_row_lse(us, v); /* untempered, for the hard part */
        const double ce = targets ? lse - us[targets[i]] : 0.0;
        /* Weights of 0 drop their term outright, so an infinite D or ce does not turn into NaN. */
        const double l = (ws != 0.0 ? ws * d : 0.0) + (wh != 0.0 ? wh * ce : 0.0);
        if (r && r->per_token_loss)
            r->per_token_loss[i] = l;
        loss += l;
        soft += d;
        hard += ce;
        if (!g)
            continue;
        const double go = (o->reduction == 2 ? grad_output[i] : grad_output[0]) * scale;
        const double gs = ws != 0.0 ? go * ws / temp : 0.0, gh = wh != 0.0 ? go * wh : 0.0;
        for (int64_t j = 0; j < v; j++)
            g[j] = (gs != 0.0 ? gs * g[j] : 0.0) + (gh != 0.0 ? gh * exp(us[j] - lse) : 0.0);
        if (gh != 0.0)
            g[targets[i]] -= gh;
    }
    if (r) {
        r->loss = loss * scale;
        r->soft_loss = soft * scale;
        r->hard_loss = hard * scale;
    }
    free(scratch), free(ids), free(in);
    return 0;
}

static int linear_valid(const ref_linear *lin)
{
    return lin && lin->n > 0 && lin->hidden > 0 && lin->vocab > 0 && lin->x && lin->weight;
}

int ref_distill_linear(const ref_linear *student, const ref_linear *teacher, const int64_t *targets,
                       const ref_distill_options *o, const double *grad_output, ref_distill_result *r, double *dx,
                       double *dweight, double *dbias)
{
    const int backward = dx || dweight || dbias;
    if (!linear_valid(student) || !linear_valid(teacher) || student->n != teacher->n ||
        student->vocab != teacher->vocab || (backward && !grad_output))
        return -2;
    double *us = ref_linear_logits(student);
    double *ut = ref_linear_logits(teacher);
    double *du = backward ? malloc(sizeof(double) * (size_t)(student->n * student->vocab)) : NULL;
    int rc = !us || !ut || (backward && !du) ? -1 : 0;
    if (rc == 0)
        rc = ref_distill_head(student->n, student->vocab, us, ut, targets, o, grad_output, r, du);
    if (rc == 0 && backward)
        ref_linear_backward(student, du, dx, dweight, dbias);
    free(us), free(ut), free(du);
    return rc;
}
