/* The GRPO reference: TRL's GRPOTrainer._compute_loss written out in double, all logits materialized.
 *
 * TRL facts this follows (huggingface/trl, trl/trainer/grpo_trainer.py, _compute_loss; GRPOConfig in
 * trl/trainer/grpo_config.py; GSPO-token in trl/experimental/gspo_token/grpo_trainer.py):
 *  - logits are divided by the sampling temperature before log_softmax (selective_log_softmax) and the
 *    entropy (entropy_from_logits: -sum p log p of the tempered distribution).
 *  - old_per_token_logps absent: old = per_token_logps.detach(), so the ratio is exactly 1 and the gradient
 *    still flows through the numerator.
 *  - "sequence": log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0), unsqueezed
 *    to (B, 1): no stop-gradient, every masked token of the row gets d s_b / d logp_t = mask_t / max(n_b, 1).
 *    The stop-gradient form logp - sg(logp) + sg(s_b) is TRL's *experimental* GSPO-token
 *    ("sequence_token"), offered here as REF_GRPO_IS_SEQUENCE_TOKEN. With a 0/1 mask and a per-sequence
 *    advantage the two give the same loss and the same gradient (every reduction weights a row's tokens
 *    equally: sum_t' w_t' * mask_t / n_b = w_t); they differ in the clip metrics (row mean vs token mean) and,
 *    for rows whose mask sums to less than 1, in the gradient.
 *  - coef_1 = exp(log_importance_weights); coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high);
 *    with delta set, coef_1 = clamp(coef_1, max=delta) (after coef_2 was taken); per_token_loss =
 *    -min(coef_1 * A, coef_2 * A). epsilon_high defaults to epsilon.
 *  - cispo: -clamp(coef_1, max=epsilon_high).detach() * A * per_token_logps.
 *  - sapo: temperatures = where(A > 0, sapo_temperature_pos, sapo_temperature_neg);
 *    -sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * A  (A == 0 takes the negative temperature).
 *  - KL (beta != 0): exp(ref - logp) - (ref - logp) - 1, added as beta * kl after the policy term.
 *  - reductions: grpo and sapo ((l * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(); bnpo
 *    (l * mask).sum() / mask.sum().clamp(min=1); dr_grpo (l * mask).sum() / (B * max_completion_length);
 *    dapo and cispo (l * mask).sum() / normalizer, normalizer from num_items_in_batch (the completion tokens
 *    of the whole generation batch, clamped to >= 1, over processes and accumulation steps).
 *  - metrics: masked_batch_mean = (x * mask).sum() / mask.sum().clamp(min=1), except for (B, 1) tensors
 *    (sequence level) where it is x.mean() over the rows; the clip flags use coef_1 after the delta clamp;
 *    clip metrics exist for the clipped family only, cispo logs cispo_clip_ratio, sapo no clip metric.
 *  - entropy bonus: TRL's GRPOTrainer had none for most of its history; recent GRPOConfig has entropy_coef
 *    (default 0) entering as loss -= coef * masked mean entropy, independent of loss_type. The issue's
 *    per-token form (l_i -= coef H_i before the reduction) is not a TRL term; both are offered.
 *
 * Autograd semantics reproduced in the coefficients: torch.min(a, b) sends the whole gradient to the smaller
 * operand and half to each on a tie; clamp passes the gradient on its closed interval [lo, hi] and blocks it
 * outside; detach() blocks it. */
#include "ref_grpo.h"

#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

void ref_grpo_options_default(ref_grpo_options *o)
{
    o->loss_type = REF_GRPO_LOSS_GRPO;
    o->filter = NULL;
    o->importance_sampling_level = REF_GRPO_IS_TOKEN;
    o->temperature = 1.0;
    o->epsilon_low = 0.2;
    o->epsilon_high = NAN;
    o->delta = NAN;
    o->beta = 0.0;
    o->sapo_temperature_pos = 1.0;
    o->sapo_temperature_neg = 1.05;
    o->num_items_in_batch = NAN;
    o->max_completion_length = 0;
    o->entropy_coef = 0.0;
    o->entropy_bonus = REF_GRPO_ENTROPY_PER_TOKEN;
}

static int clipped_family(ref_grpo_loss_type t)
{
    return t == REF_GRPO_LOSS_GRPO || t == REF_GRPO_LOSS_BNPO || t == REF_GRPO_LOSS_DR_GRPO || t == REF_GRPO_LOSS_DAPO;
}

static int options_valid(const ref_grpo_options *o)
{
    return o && o->loss_type >= REF_GRPO_LOSS_GRPO && o->loss_type <= REF_GRPO_LOSS_SAPO &&
           o->importance_sampling_level >= REF_GRPO_IS_TOKEN &&
           o->importance_sampling_level <= REF_GRPO_IS_SEQUENCE_TOKEN &&
           (o->entropy_bonus == REF_GRPO_ENTROPY_PER_TOKEN || o->entropy_bonus == REF_GRPO_ENTROPY_MASKED_MEAN) &&
           o->temperature > 0.0;
}

/* torch.clamp: NaN stays NaN. */
static double clamp(double v, double lo, double hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

/* torch.min(a, b) elementwise, with the share of the gradient that goes to a (the rest goes to b). */
static double min_with_share(double a, double b, double *share_a)
{
    if (a < b) {
        *share_a = 1.0;
        return a;
    }
    if (a > b) {
        *share_a = 0.0;
        return b;
    }
    *share_a = 0.5;
    return a == b ? a : NAN;
}

int ref_grpo_head(const ref_grpo_tokens *tk, const ref_grpo_options *o, double grad_output, ref_grpo_result *r,
                  double *g_logp, double *g_entropy)
{
    if (!tk || !options_valid(o) || tk->batch <= 0 || tk->seq <= 0 || !tk->logp || !tk->completion_mask ||
        !tk->advantages)
        return -2;
    if (o->beta != 0.0 && !tk->ref_logp)
        return -2;
    if (o->entropy_coef != 0.0 && !tk->entropy)
        return -2;

    const int64_t B = tk->batch, T = tk->seq, n = B * T;
    const ref_grpo_loss_type lt = o->loss_type;
    const ref_grpo_is_level lvl = o->importance_sampling_level;
    const double *logp = tk->logp, *mask = tk->completion_mask, *adv = tk->advantages, *H = tk->entropy;
    const double *sg = tk->sg_logp ? tk->sg_logp : tk->logp;
    const double el = o->epsilon_low, eh = isnan(o->epsilon_high) ? o->epsilon_low : o->epsilon_high;
    const int has_delta = !isnan(o->delta) && o->delta > 0.0;
    const int ent_per_token = o->entropy_coef != 0.0 && o->entropy_bonus == REF_GRPO_ENTROPY_PER_TOKEN;
    const int ent_mean = o->entropy_coef != 0.0 && o->entropy_bonus == REF_GRPO_ENTROPY_MASKED_MEAN;

    /* Per token: ratio r (forward value), the per-token loss l, d pol / d r (clipped family, sapo) or
     * d pol / d logp (cispo), d kl / d logp, and the reduction weight w = d loss / d l. Per row: n_b, s_b. */
    double *rt = malloc(sizeof(double) * (size_t)n);
    double *l = malloc(sizeof(double) * (size_t)n);
    double *dpol = malloc(sizeof(double) * (size_t)n);
    double *dkl = malloc(sizeof(double) * (size_t)n);
    double *w = malloc(sizeof(double) * (size_t)n);
    double *nclamp = malloc(sizeof(double) * (size_t)B);
    double *s = malloc(sizeof(double) * (size_t)B);
    double *s_sg = malloc(sizeof(double) * (size_t)B);
    if (!rt || !l || !dpol || !dkl || !w || !nclamp || !s || !s_sg) {
        free(rt), free(l), free(dpol), free(dkl), free(w), free(nclamp), free(s), free(s_sg);
        return -1;
    }

    /* Row lengths and sequence log-ratios (from logp, and from the stop-gradient anchor). */
    double msum = 0.0;
    for (int64_t b = 0; b < B; b++) {
        double nb = 0.0, acc = 0.0, acc_sg = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const double old = tk->old_logp ? tk->old_logp[i] : sg[i];
            nb += mask[i];
            acc += (logp[i] - old) * mask[i];
            acc_sg += (sg[i] - old) * mask[i];
        }
        msum += nb;
        nclamp[b] = nb < 1.0 ? 1.0 : nb;
        s[b] = acc / nclamp[b];
        s_sg[b] = acc_sg / nclamp[b];
    }
    const double mclamp = msum < 1.0 ? 1.0 : msum;
    const double tmax = o->max_completion_length > 0 ? (double)o->max_completion_length : (double)T;
    const double nitems = o->num_items_in_batch > 0.0 ? o->num_items_in_batch : mclamp;

    /* Per-token values. */
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const double A = adv[b];
            const double old = tk->old_logp ? tk->old_logp[i] : sg[i];
            double lw, lw_sg; /* log importance weight, and its value with logp := sg_logp */
            if (lvl == REF_GRPO_IS_TOKEN) {
                lw = logp[i] - old;
                lw_sg = sg[i] - old;
            } else if (lvl == REF_GRPO_IS_SEQUENCE) {
                lw = s[b];
                lw_sg = s_sg[b];
            } else {
                lw = logp[i] - sg[i] + s_sg[b];
                lw_sg = s_sg[b];
            }
            const double ratio = exp(lw);
            double pol, dp;
            if (clipped_family(lt)) {
                const double c2 = clamp(ratio, 1.0 - el, 1.0 + eh);
                const double c1 = has_delta ? (ratio > o->delta ? o->delta : ratio) : ratio;
                const double dc1 = has_delta ? (ratio <= o->delta ? 1.0 : 0.0) : 1.0;
                const double dc2 = ratio >= 1.0 - el && ratio <= 1.0 + eh ? 1.0 : 0.0;
                double share1;
                pol = -min_with_share(c1 * A, c2 * A, &share1);
                dp = -(share1 * dc1 * A + (1.0 - share1) * dc2 * A);
            } else if (lt == REF_GRPO_LOSS_CISPO) {
                const double rs = exp(lw_sg), cr = rs > eh ? eh : rs; /* clamp(max=eps_high).detach() */
                pol = -cr * A * logp[i];
                dp = -cr * A;
            } else { /* sapo */
                const double tau = A > 0.0 ? o->sapo_temperature_pos : o->sapo_temperature_neg;
                const double sig = 1.0 / (1.0 + exp(-(tau * (ratio - 1.0))));
                pol = -(sig * 4.0 / tau) * A;
                dp = -(4.0 * sig * (1.0 - sig)) * A;
            }
            double li = pol, kl = 0.0, dk = 0.0;
            if (o->beta != 0.0) {
                const double d = tk->ref_logp[i] - logp[i];
                kl = exp(d) - d - 1.0;
                dk = 1.0 - exp(d);
                li = li + o->beta * kl;
            }
            if (ent_per_token)
                li -= o->entropy_coef * H[i];
            rt[i] = ratio;
            l[i] = li;
            dpol[i] = dp;
            dkl[i] = dk;
            if (r && r->per_token_loss)
                r->per_token_loss[i] = li;
            if (r && r->ratio)
                r->ratio[i] = ratio;
            if (r && r->per_token_kl)
                r->per_token_kl[i] = kl;
            switch (lt) {
            case REF_GRPO_LOSS_GRPO:
            case REF_GRPO_LOSS_SAPO:
                w[i] = mask[i] / nclamp[b] / (double)B;
                break;
            case REF_GRPO_LOSS_BNPO:
                w[i] = mask[i] / mclamp;
                break;
            case REF_GRPO_LOSS_DR_GRPO:
                w[i] = mask[i] / ((double)B * tmax);
                break;
            default: /* dapo, cispo */
                w[i] = mask[i] / nitems;
                break;
            }
        }

    /* The loss, summed in TRL's order. */
    double loss = 0.0;
    if (lt == REF_GRPO_LOSS_GRPO || lt == REF_GRPO_LOSS_SAPO) {
        for (int64_t b = 0; b < B; b++) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++)
                acc += l[b * T + t] * mask[b * T + t];
            loss += acc / nclamp[b];
        }
        loss /= (double)B;
    } else {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++)
            acc += l[i] * mask[i];
        loss = acc / (lt == REF_GRPO_LOSS_BNPO ? mclamp : lt == REF_GRPO_LOSS_DR_GRPO ? (double)B * tmax : nitems);
    }
    double ent_mean_value = NAN;
    if (H) {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++)
            acc += H[i] * mask[i];
        ent_mean_value = acc / mclamp;
    }
    if (ent_mean)
        loss -= o->entropy_coef * ent_mean_value;

    /* Coefficients: g_logp = d(grad_output loss)/d logp, g_entropy = d(grad_output loss)/d H. */
    if (g_logp) {
        for (int64_t b = 0; b < B; b++) {
            double gs = 0.0; /* sequence level: d loss / d s_b */
            for (int64_t t = 0; t < T; t++) {
                const int64_t i = b * T + t;
                const double gl = grad_output * w[i]; /* d loss / d l_i */
                double g = 0.0;
                if (o->beta != 0.0)
                    g += gl * o->beta * dkl[i];
                if (lt == REF_GRPO_LOSS_CISPO)
                    g += gl * dpol[i];
                else if (lvl == REF_GRPO_IS_SEQUENCE)
                    gs += gl * dpol[i] * rt[i];
                else /* token, sequence_token: d lw_i / d logp_i = 1, d r / d lw = r */
                    g += gl * dpol[i] * rt[i];
                g_logp[i] = g;
            }
            if (lt != REF_GRPO_LOSS_CISPO && lvl == REF_GRPO_IS_SEQUENCE)
                for (int64_t t = 0; t < T; t++)
                    g_logp[b * T + t] += gs * mask[b * T + t] / nclamp[b];
        }
    }
    if (g_entropy)
        for (int64_t i = 0; i < n; i++)
            g_entropy[i] = ent_per_token ? -o->entropy_coef * grad_output * w[i]
                           : ent_mean    ? -o->entropy_coef * grad_output * mask[i] / mclamp
                                         : 0.0;

    if (r) {
        ref_grpo_metrics *m = &r->metrics;
        r->loss = loss;
        m->entropy = ent_mean_value;
        m->kl = NAN;
        if (o->beta != 0.0) {
            double acc = 0.0;
            for (int64_t i = 0; i < n; i++) {
                const double d = tk->ref_logp[i] - logp[i];
                acc += (exp(d) - d - 1.0) * mask[i];
            }
            m->kl = acc / mclamp;
        }
        m->clip_low_mean = m->clip_high_mean = m->clip_region_mean = m->cispo_clip_ratio = NAN;
        if (clipped_family(lt) || lt == REF_GRPO_LOSS_CISPO) {
            double lo = 0.0, hi = 0.0, region = 0.0, cispo = 0.0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t t = 0; t < T; t++) {
                    const int64_t i = b * T + t;
                    /* sequence level: one (B, 1) value per row, averaged over rows with weight 1 */
                    if (lvl == REF_GRPO_IS_SEQUENCE && t > 0)
                        break;
                    const double wt = lvl == REF_GRPO_IS_SEQUENCE ? 1.0 : mask[i];
                    const double c1 = has_delta ? (rt[i] > o->delta ? o->delta : rt[i]) : rt[i];
                    const int is_lo = c1 < 1.0 - el && adv[b] < 0.0, is_hi = c1 > 1.0 + eh && adv[b] > 0.0;
                    lo += is_lo * wt;
                    hi += is_hi * wt;
                    region += (is_lo || is_hi) * wt;
                    cispo += (rt[i] > eh && adv[b] > 0.0) * wt;
                }
            const double den = lvl == REF_GRPO_IS_SEQUENCE ? (double)B : mclamp;
            if (lt == REF_GRPO_LOSS_CISPO)
                m->cispo_clip_ratio = cispo / den;
            else {
                m->clip_low_mean = lo / den;
                m->clip_high_mean = hi / den;
                m->clip_region_mean = region / den;
            }
        }
    }
    free(rt), free(l), free(dpol), free(dkl), free(w), free(nclamp), free(s), free(s_sg);
    return 0;
}

/* lse of z = u / temperature over one row. */
static double row_lse(const double *u, int64_t v, double temperature)
{
    double m = -INFINITY;
    for (int64_t j = 0; j < v; j++)
        if (u[j] / temperature > m)
            m = u[j] / temperature;
    double se = 0.0;
    for (int64_t j = 0; j < v; j++)
        se += exp(u[j] / temperature - m);
    return m + log(se);
}

/* logp of the target (0 if out of range, as for a masked padding id) and the entropy -sum p log p of the
 * tempered row, as TRL's selective_log_softmax and entropy_from_logits. */
static void row_stats(const double *u, int64_t v, double temperature, int64_t target, double *logp, double *ent)
{
    const double lse = row_lse(u, v, temperature);
    double h = 0.0;
    for (int64_t j = 0; j < v; j++) {
        const double lp = u[j] / temperature - lse;
        h -= exp(lp) * lp;
    }
    *logp = target >= 0 && target < v ? u[target] / temperature - lse : 0.0;
    *ent = h;
}

void ref_grpo_row_grad(const double *u, int64_t v, double temperature, int64_t target, double g_logp,
                       double g_entropy, double *du)
{
    const double lse = row_lse(u, v, temperature);
    double h = 0.0;
    for (int64_t j = 0; j < v; j++) {
        const double lp = u[j] / temperature - lse;
        h -= exp(lp) * lp;
    }
    /* d logp / d z_j = onehot_j - p_j.
     * d H / d z_j = -p_j (log p_j + H) = -p_j (z_j - sum_k p_k z_k)   (H = lse - sum p z, d lse / d z_j = p_j,
     * d (sum_k p_k z_k) / d z_j = p_j + p_j z_j - p_j sum_k p_k z_k).  dz / du = 1 / temperature. */
    for (int64_t j = 0; j < v; j++) {
        const double lp = u[j] / temperature - lse, p = exp(lp);
        const double onehot = j == target ? 1.0 : 0.0;
        du[j] = (g_logp * (onehot - p) - g_entropy * p * (lp + h)) / temperature;
    }
}

static int problem_valid(const ref_grpo_problem *p)
{
    if (!p || p->batch <= 0 || p->seq <= 0 || p->hidden <= 0 || p->vocab <= 0 || !p->x || !p->weight ||
        !p->completion_ids || !p->completion_mask || !p->advantages)
        return 0;
    for (int64_t i = 0; i < p->batch * p->seq; i++)
        if (p->completion_mask[i] != 0.0 && (p->completion_ids[i] < 0 || p->completion_ids[i] >= p->vocab))
            return 0;
    return 1;
}

/* The problem's linear layer, one row per token. */
static ref_linear linear_of(const ref_grpo_problem *p)
{
    const ref_linear lin = {p->batch * p->seq, p->hidden, p->vocab, p->x, p->weight, p->bias};
    return lin;
}

/* Logits, then logp and entropy per token. On success *u_out, *logp_out, *ent_out are the caller's to free. */
static int materialize(const ref_grpo_problem *p, const ref_grpo_options *o, double **u_out, double **logp_out,
                       double **ent_out)
{
    const int64_t n = p->batch * p->seq, v = p->vocab;
    const ref_linear lin = linear_of(p);
    double *u = ref_linear_logits(&lin);
    double *lp = malloc(sizeof(double) * (size_t)n);
    double *ent = malloc(sizeof(double) * (size_t)n);
    if (!u || !lp || !ent) {
        free(u), free(lp), free(ent);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        row_stats(u + i * v, v, o->temperature, p->completion_ids[i], &lp[i], &ent[i]);
    *u_out = u;
    *logp_out = lp;
    *ent_out = ent;
    return 0;
}

static ref_grpo_tokens tokens_of(const ref_grpo_problem *p, const double *logp, const double *ent)
{
    ref_grpo_tokens tk = {p->batch, p->seq, logp, ent, p->completion_mask, p->advantages,
                          p->old_logp, p->ref_logp, p->sg_logp};
    return tk;
}

int ref_grpo_forward(const ref_grpo_problem *p, const ref_grpo_options *o, ref_grpo_result *r)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    double *u, *lp, *ent;
    if (materialize(p, o, &u, &lp, &ent))
        return -1;
    free(u);
    const ref_grpo_tokens tk = tokens_of(p, lp, ent);
    const int rc = ref_grpo_head(&tk, o, 1.0, r, NULL, NULL);
    if (rc == 0 && r) {
        for (int64_t i = 0; i < p->batch * p->seq; i++) {
            if (r->logp)
                r->logp[i] = lp[i];
            if (r->entropy)
                r->entropy[i] = ent[i];
        }
    }
    free(lp), free(ent);
    return rc;
}

/* The gradients as a filter leaves them. Without a c w term (GRPO has none) every non-target dU is softmax terms;
 * a row's scale is max(|g_logp|, |g_entropy|) (the fused head's |a| = |b| and |e|). Returns 0 or -1. */
static int filtered_backward(const ref_filter *f, const ref_linear *lin, const int64_t *targets, const double *gl,
                             const double *gh, const double *du, double *dx, double *dweight, double *dbias)
{
    const int64_t n = lin->n, v = lin->vocab;
    double *scale = calloc((size_t)n, sizeof(double)), *no_c = calloc((size_t)n, sizeof(double));
    double *du_dx = malloc(sizeof(double) * (size_t)(n * v)), *du_dw = malloc(sizeof(double) * (size_t)(n * v));
    int ok = scale && no_c && du_dx && du_dw;
    if (ok) {
        for (int64_t i = 0; i < n; i++)
            scale[i] = fabs(gl[i]) > fabs(gh[i]) ? fabs(gl[i]) : fabs(gh[i]);
        const ref_filter_input in = {du, du, scale, no_c};
        ok = ref_filter_apply(f, n, v, targets, &in, du_dx, du_dw) == 0;
    }
    if (ok) {
        ref_linear_backward(lin, du_dx, dx, NULL, NULL);
        ref_linear_backward(lin, du_dw, NULL, dweight, NULL);
        ref_linear_backward(lin, du, NULL, NULL, dbias);
    }
    free(scale), free(no_c), free(du_dx), free(du_dw);
    return ok ? 0 : -1;
}

int ref_grpo_backward(const ref_grpo_problem *p, const ref_grpo_options *o, double grad_output, double *dx,
                      double *dweight, double *dbias)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    const int64_t n = p->batch * p->seq, v = p->vocab;
    double *u, *lp, *ent;
    if (materialize(p, o, &u, &lp, &ent))
        return -1;
    double *gl = malloc(sizeof(double) * (size_t)n);
    double *gh = malloc(sizeof(double) * (size_t)n);
    double *du = malloc(sizeof(double) * (size_t)(n * v));
    int rc = !gl || !gh || !du ? -1 : 0;
    if (rc == 0) {
        const ref_grpo_tokens tk = tokens_of(p, lp, ent);
        rc = ref_grpo_head(&tk, o, grad_output, NULL, gl, gh);
    }
    if (rc == 0) {
        for (int64_t i = 0; i < n; i++)
            ref_grpo_row_grad(u + i * v, v, o->temperature, p->completion_ids[i], gl[i], gh[i], du + i * v);
        const ref_linear lin = linear_of(p);
        if (o->filter)
            rc = filtered_backward(o->filter, &lin, p->completion_ids, gl, gh, du, dx, dweight, dbias);
        else
            ref_linear_backward(&lin, du, dx, dweight, dbias);
    }
    free(u), free(lp), free(ent), free(gl), free(gh), free(du);
    return rc;
}
