/* The KTO reference: TRL's KTOTrainer losses written out in double, all logits materialized.
 *
 * TRL facts this follows (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/kto_trainer.py,
 * KTOTrainer._compute_loss; loss_type choices from trl/trainer/kto_config.py):
 *  - completion log-probs are per_token_logps with masked positions zeroed, summed over the sequence (no average);
 *    the reference's likewise (or precomputed ref_logps).
 *  - kl = (KL_logps - ref_KL_logps).mean().detach(), gathered and clamped at 0; only for loss_type "kto"
 *    (calculate_KL is False for "apo_zero_unpaired", and kl is 0 there).
 *  - losses: kto chosen 1 - sigmoid(beta (logratio - kl)), rejected 1 - sigmoid(beta (kl - logratio));
 *    apo_zero_unpaired chosen 1 - sigmoid(beta logratio), rejected sigmoid(beta logratio); the chosen ones times
 *    desirable_weight, the rejected ones times undesirable_weight, concatenated, nanmean.
 *  - metrics: rewards/chosen = sum of chosen rewards / number of chosen (logged only when there are some), likewise
 *    logps and the rejected ones; rewards/margins when both exist; logits/chosen =
 *    chosen_logits[chosen_mask.bool()].mean(-1).sum() / chosen_mask.sum() (logged when that sum > 0); entropy =
 *    sum(H m) / sum(m), 0 without tokens; kl. */
#include "ref_kto.h"

#include "ref_grpo.h"
#include "ref_linear.h"

#include <math.h>
#include <stdlib.h>

static int options_valid(const ref_kto_options *o)
{
    return o && (o->loss_type == REF_KTO_LOSS_KTO || o->loss_type == REF_KTO_LOSS_APO_ZERO_UNPAIRED) &&
           o->beta > 0.0 && isfinite(o->beta) && o->desirable_weight >= 0.0 && isfinite(o->desirable_weight) &&
           o->undesirable_weight >= 0.0 && isfinite(o->undesirable_weight);
}

static int inputs_valid(int64_t batch, const uint8_t *labels, const double *ref, const double *ref_tok,
                        const double *kl, const double *kl_logratios, const ref_kto_options *o)
{
    if (!labels || (ref != NULL) == (ref_tok != NULL))
        return 0;
    const int kl_inputs = (kl != NULL) + (kl_logratios != NULL);
    if (kl_inputs != (o->loss_type == REF_KTO_LOSS_KTO ? 1 : 0))
        return 0;
    for (int64_t s = 0; s < batch; s++)
        if (labels[s] > 1)
            return 0;
    return 1;
}

static double sigmoid(double x)
{
    return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

int ref_kto_head(const ref_kto_tokens *tk, const ref_kto_options *o, double grad_output, ref_kto_result *r,
                 double *g_logp)
{
    if (!options_valid(o) || !tk || tk->batch <= 0 || tk->seq <= 0 || !tk->logp || !tk->mask ||
        !inputs_valid(tk->batch, tk->labels, tk->ref_logps, tk->ref_per_token_logps, tk->kl, tk->kl_logratios, o))
        return -2;
    const int64_t B = tk->batch, T = tk->seq;
    const double *mask = tk->mask, beta = o->beta;
    double kl = 0.0;
    if (tk->kl)
        kl = *tk->kl;
    if (tk->kl_logratios) {
        for (int64_t s = 0; s < B; s++)
            kl += tk->kl_logratios[s] / (double)B;
        kl = kl < 0.0 ? 0.0 : kl;
    }
    double loss = 0.0, num[2] = {0}, rew[2] = {0}, lps[2] = {0};
    for (int64_t s = 0; s < B; s++) {
        double l = 0.0, ref = 0.0;
        for (int64_t t = 0; t < T; t++) {
            l += mask[s * T + t] * tk->logp[s * T + t];
            if (tk->ref_per_token_logps)
                ref += mask[s * T + t] * tk->ref_per_token_logps[s * T + t];
        }
        if (tk->ref_logps)
            ref = tk->ref_logps[s];
        const double ratio = l - ref;
        const int chosen = tk->labels[s] == 1, k = chosen ? 0 : 1;
        const double w = chosen ? o->desirable_weight : o->undesirable_weight;
        const double shift = o->loss_type == REF_KTO_LOSS_KTO ? kl : 0.0;
        double L, dL; /* the sequence's loss and d L / d ratio */
        if (chosen) {
            const double x = beta * (ratio - shift);
            L = 1.0 - sigmoid(x);
            dL = -beta * sigmoid(x) * (1.0 - sigmoid(x));
        } else if (o->loss_type == REF_KTO_LOSS_KTO) {
            const double y = beta * (kl - ratio);
            L = 1.0 - sigmoid(y);
            dL = beta * sigmoid(y) * (1.0 - sigmoid(y));
        } else {
            const double x = beta * ratio;
            L = sigmoid(x);
            dL = beta * sigmoid(x) * (1.0 - sigmoid(x));
        }
        loss += w * L / (double)B;
        for (int64_t t = 0; g_logp && t < T; t++)
            g_logp[s * T + t] = grad_output * w * dL / (double)B * mask[s * T + t];
        num[k] += 1.0;
        rew[k] += beta * ratio;
        lps[k] += l;
        if (r && r->rewards)
            r->rewards[s] = beta * ratio;
        if (r && r->sequence_logps)
            r->sequence_logps[s] = l;
    }
    if (!r)
        return 0;
    ref_kto_metrics *m = &r->metrics;
    r->loss = loss;
    m->kl = kl;
    m->rewards_chosen = num[0] > 0.0 ? rew[0] / num[0] : NAN;
    m->rewards_rejected = num[1] > 0.0 ? rew[1] / num[1] : NAN;
    m->rewards_margins = num[0] > 0.0 && num[1] > 0.0 ? m->rewards_chosen - m->rewards_rejected : NAN;
    m->logps_chosen = num[0] > 0.0 ? lps[0] / num[0] : NAN;
    m->logps_rejected = num[1] > 0.0 ? lps[1] / num[1] : NAN;
    double zsum[2] = {0}, msum[2] = {0}, hsum = 0.0;
    for (int64_t i = 0; i < B * T; i++) {
        const int k = tk->labels[i / T] == 1 ? 0 : 1;
        msum[k] += mask[i];
        if (tk->logit_means && mask[i] != 0.0)
            zsum[k] += tk->logit_means[i];
        if (tk->entropy)
            hsum += mask[i] * tk->entropy[i];
    }
    m->logits_chosen = tk->logit_means && msum[0] > 0.0 ? zsum[0] / msum[0] : NAN;
    m->logits_rejected = tk->logit_means && msum[1] > 0.0 ? zsum[1] / msum[1] : NAN;
    m->entropy = msum[0] + msum[1] > 0.0 ? hsum / (msum[0] + msum[1]) : 0.0;
    return 0;
}

static int problem_valid(const ref_kto_problem *p)
{
    if (!p || p->batch <= 0 || p->seq <= 0 || p->hidden <= 0 || p->vocab <= 0 || !p->x || !p->weight ||
        !p->targets || !p->mask)
        return 0;
    for (int64_t i = 0; i < p->batch * p->seq; i++)
        if (p->mask[i] != 0.0 && (p->targets[i] < 0 || p->targets[i] >= p->vocab))
            return 0;
    return 1;
}

static ref_linear linear_of(const ref_kto_problem *p)
{
    const ref_linear lin = {p->batch * p->seq, p->hidden, p->vocab, p->x, p->weight, p->bias};
    return lin;
}

/* Logits, then per token logp (0 for an out-of-range target), the mean logit and the entropy. On success the four
 * arrays are the caller's to free. */
static int materialize(const ref_kto_problem *p, double **u_out, double **logp_out, double **mean_out,
                       double **entropy_out)
{
    const ref_linear lin = linear_of(p);
    const int64_t n = lin.n, v = p->vocab;
    double *u = ref_linear_logits(&lin);
    double *lp = malloc(sizeof(double) * (size_t)n);
    double *mean = malloc(sizeof(double) * (size_t)n);
    double *ent = malloc(sizeof(double) * (size_t)n);
    if (!u || !lp || !mean || !ent) {
        free(u), free(lp), free(mean), free(ent);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        const double *ui = u + i * v;
        const int64_t y = p->targets[i];
        const double lse = ref_linear_row_lse(ui, v);
        double sum = 0.0, pz = 0.0;
        for (int64_t j = 0; j < v; j++) {
            sum += ui[j];
            pz += exp(ui[j] - lse) * ui[j];
        }
        mean[i] = sum / (double)v;
        ent[i] = lse - pz;
        lp[i] = y >= 0 && y < v ? ui[y] - lse : 0.0;
    }
    *u_out = u;
    *logp_out = lp;
    *mean_out = mean;
    *entropy_out = ent;
    return 0;
}

static ref_kto_tokens tokens_of(const ref_kto_problem *p, const double *logp, const double *mean, const double *ent)
{
    const ref_kto_tokens tk = {p->batch, p->seq,          logp,          p->mask, p->labels, p->ref_logps,
                               p->ref_per_token_logps,     p->kl,         p->kl_logratios, mean, ent};
    return tk;
}

int ref_kto_forward(const ref_kto_problem *p, const ref_kto_options *o, ref_kto_result *r)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    double *u, *lp, *mean, *ent;
    if (materialize(p, &u, &lp, &mean, &ent))
        return -1;
    free(u);
    const ref_kto_tokens tk = tokens_of(p, lp, mean, ent);
    const int rc = ref_kto_head(&tk, o, 1.0, r, NULL);
    for (int64_t i = 0; rc == 0 && r && r->logp && i < p->batch * p->seq; i++)
        r->logp[i] = lp[i];
    free(lp), free(mean), free(ent);
    return rc;
}

int ref_kto_backward(const ref_kto_problem *p, const ref_kto_options *o, double grad_output, double *dx,
                     double *dweight, double *dbias)
{
    if (!problem_valid(p) || !options_valid(o))
        return -2;
    const ref_linear lin = linear_of(p);
    const int64_t n = lin.n, v = p->vocab;
    double *u, *lp, *mean, *ent;
    if (materialize(p, &u, &lp, &mean, &ent))
        return -1;
    double *g = malloc(sizeof(double) * (size_t)n);
    double *du = malloc(sizeof(double) * (size_t)(n * v));
    int rc = !g || !du ? -1 : 0;
    if (rc == 0) {
        const ref_kto_tokens tk = tokens_of(p, lp, mean, ent);
        rc = ref_kto_head(&tk, o, grad_output, NULL, g);
    }
    if (rc == 0) {
        /* d logp / d u_j = onehot_j - p_j: GRPO's row gradient at temperature 1 without an entropy term. */
        for (int64_t i = 0; i < n; i++)
            ref_grpo_row_grad(u + i * v, v, 1.0, p->targets[i], g[i], 0.0, du + i * v);
        ref_linear_backward(&lin, du, dx, dweight, dbias);
    }
    free(u), free(lp), free(mean), free(ent), free(g), free(du);
    return rc;
}
