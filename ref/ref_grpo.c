/* The GRPO reference: TRL's GRPOTrainer._compute_loss written out in double, all logits materialized.
 *
 * TRL facts this follows (TRL 1.16.0, first read at huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8:
 * trl/trainer/grpo_trainer.py, _compute_loss, get_off_policy_mask, get_gamma_weights, get_high_entropy_mask and the
 * vLLM importance-sampling ratio in _generate_and_score_completions; GRPOConfig in trl/trainer/grpo_config.py;
 * GSPO-token in trl/experimental/gspo_token/grpo_trainer.py; 1.16.0 changed luspo's reduction and the entropy
 * bonus's normaliser, below with their 1.16.0 lines):
 *  - logits are divided by the sampling temperature before log_softmax (selective_log_softmax) and the
 *    entropy (entropy_from_logits: -sum p log p of the tempered distribution). The entropies carry a gradient
 *    when the entropy bonus is on.
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
 *    with delta set, coef_1 = clamp(coef_1, max=delta) (after coef_2 and the KL were taken); per_token_loss =
 *    -min(coef_1 * A, coef_2 * A) for grpo, bnpo, dr_grpo, dapo and luspo. epsilon_high defaults to epsilon.
 *  - cispo: -clamp(coef_1, max=epsilon_high).detach() * A * per_token_logps.
 *  - sapo: temperatures = where(A > 0, sapo_temperature_pos, sapo_temperature_neg);
 *    -sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * A  (A == 0 takes the negative temperature).
 *  - vespo: -phi_seq * A * per_token_logps, phi_seq from get_gamma_weights (@torch.no_grad) on log_ratio =
 *    per_token_logps - old (per token, whatever the level), the mask, and inputs["importance_sampling_ratio"]
 *    (present whenever the vLLM correction is on, summed over every position of the row, padding included;
 *    the trainer refuses vespo with a sequence mode then). lambda is clamped to >= 1e-4, phi's NaN and
 *    infinities become 0.
 *  - vLLM importance sampling (computed at generation time, no gradient): (old - sampling) * mask per token,
 *    summed over the row in the sequence modes (B, 1), exp; *_truncate: clamp(min=clip_min, max=clip_max)
 *    (None: no bound); *_mask: masked_fill(ratio < min | ratio > max, 0) (None: +-inf). It multiplies
 *    per_token_loss after the off-policy and entropy masks, before the KL is added, for every loss but vespo.
 *  - get_off_policy_mask: sampling = inputs.get("sampling_per_token_logps", old); kl = sampling -
 *    per_token_logps.detach(); keep = (A >= 0) | ((kl * mask).sum(1) / mask.sum(1).clamp(min=1) <= threshold).
 *  - get_high_entropy_mask: torch.quantile(entropies[mask.bool()], 1 - top_entropy_quantile) (linear: the rank
 *    q (n - 1) in the entropies' fp32, the two neighbours lerped in fp32); entropy_mask = entropies * mask >=
 *    threshold & mask.bool(), in fp32; none valid: all False. Only applied when top_entropy_quantile < 1.
 *  - KL (beta != 0): exp(ref - logp) - (ref - logp) - 1, times coef_1 (before the delta clamp, not detached)
 *    with use_bias_correction_kl; added as beta * kl after the policy term and its masks.
 *  - reductions: grpo and sapo ((l * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(); bnpo
 *    (l * mask).sum() / mask.sum().clamp(min=1); dr_grpo (l * mask).sum() / (B * max_completion_length);
 *    dapo, cispo and vespo (l * mask).sum() / normalizer, normalizer from num_items_in_batch (the completion
 *    tokens of the whole generation batch, clamped to >= 1, over processes and accumulation steps); luspo
 *    (l * mask).sum(-1).mean() (grpo_trainer.py:3179 at 1.16.0: each sequence's masked sum, the mean over B).
 *  - entropy bonus (entropy_coef != 0), every loss type alike (grpo_trainer.py:3189-3211 at 1.16.0):
 *    effective_mask = mask * entropy_mask (mask alone without the quantile); (entropies * effective_mask).sum() /
 *    effective_mask.sum().clamp(min=1) / current_gradient_accumulation_steps (1 here), never num_items_in_batch;
 *    loss -= entropy_coef * that. policy_loss (the loss before it) and entropy_coef are logged only then.
 *  - metrics: global_masked_mean = (x * mask).sum() / mask.sum().clamp(min=1), except for (B, 1) tensors
 *    (sequence level) where it is x.mean() over the rows; the clip flags use coef_1 after the delta clamp;
 *    clip metrics (low/high/region mean, low_min, high_max) exist for the clipped family and luspo, cispo logs
 *    cispo_clip_ratio, vespo vespo/phi_seq_mean (mean over the (B, 1) phi), sapo nothing. masked_seq_mean =
 *    (x * mask).sum(-1) / mask.sum(-1), unclamped (NaN for an empty row), reduced by nanmin / nanmax. The
 *    sampling metrics: |old - sampling| over mask.bool(), the ratio over mask.bool() (token modes) or flattened
 *    (sequence modes), 0 for an empty selection.
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
    o->loss_type = REF_GRPO_LOSS_DAPO;
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
    o->entropy_bonus = REF_GRPO_ENTROPY_TRL;
    o->top_entropy_quantile = 1.0;
    o->off_policy_mask_threshold = NAN;
    o->use_bias_correction_kl = 0;
    o->vllm_importance_sampling_correction = 1;
    o->vllm_importance_sampling_mode = REF_GRPO_VLLM_IS_SEQUENCE_MASK;
    o->vllm_importance_sampling_clip_min = NAN;
    o->vllm_importance_sampling_clip_max = 3.0;
    o->vespo_k_pos = 2.0;
    o->vespo_lambda_pos = 3.0;
    o->vespo_k_neg = 3.0;
    o->vespo_lambda_neg = 2.0;
}

/* The losses of -min(c1 A, c2 A) and TRL's clip metrics. */
static int clipped_family(ref_grpo_loss_type t)
{
    return t == REF_GRPO_LOSS_GRPO || t == REF_GRPO_LOSS_BNPO || t == REF_GRPO_LOSS_DR_GRPO ||
           t == REF_GRPO_LOSS_DAPO || t == REF_GRPO_LOSS_LUSPO;
}

static int sequence_is_mode(ref_grpo_vllm_is_mode m)
{
    return m == REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE || m == REF_GRPO_VLLM_IS_SEQUENCE_MASK;
}

static int options_valid(const ref_grpo_options *o)
{
    return o && o->loss_type >= REF_GRPO_LOSS_GRPO && o->loss_type <= REF_GRPO_LOSS_VESPO &&
           o->importance_sampling_level >= REF_GRPO_IS_TOKEN &&
           o->importance_sampling_level <= REF_GRPO_IS_SEQUENCE_TOKEN &&
           (o->entropy_bonus == REF_GRPO_ENTROPY_PER_TOKEN || o->entropy_bonus == REF_GRPO_ENTROPY_TRL) &&
           o->vllm_importance_sampling_mode >= REF_GRPO_VLLM_IS_TOKEN_TRUNCATE &&
           o->vllm_importance_sampling_mode <= REF_GRPO_VLLM_IS_SEQUENCE_MASK && o->top_entropy_quantile >= 0.0 &&
           o->top_entropy_quantile <= 1.0 && o->temperature > 0.0;
}

/* What TRL refuses where the importance-sampling correction applies (GRPOConfig.__post_init__ and
 * GRPOTrainer.__init__). */
static int is_options_valid(const ref_grpo_options *o)
{
    const double lo = o->vllm_importance_sampling_clip_min, hi = o->vllm_importance_sampling_clip_max;
    const int truncate = o->vllm_importance_sampling_mode == REF_GRPO_VLLM_IS_TOKEN_TRUNCATE ||
                         o->vllm_importance_sampling_mode == REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
    if (truncate && isnan(lo) && isnan(hi))
        return 0;
    if (!isnan(lo) && !isnan(hi) && lo >= hi)
        return 0;
    return !(o->loss_type == REF_GRPO_LOSS_VESPO && sequence_is_mode(o->vllm_importance_sampling_mode));
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

static int compare_doubles(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* torch.quantile(values, q) with linear interpolation, as torch 1.13 computes it for TRL's fp32 entropies and a
 * Python float q: q becomes an fp32 scalar, rank = q (n - 1) in fp32, below = (int64) rank, weight = rank - below,
 * above = ceil(rank), then torch.lerp(v[below], v[above], weight) in fp32 (lerp's two forms split at weight 0.5).
 * The fp32 rank matters: (1 - 0.7) * 30 is 9.000000000000002 in double but 0.3f * 30 rounds to 9 exactly, so the
 * threshold is the 10th entropy itself and that token is kept. values are rounded to fp32 and sorted in place;
 * n >= 1. */
double ref_grpo_quantile(double *values, int64_t n, double q)
{
    for (int64_t i = 0; i < n; i++)
        values[i] = (float)values[i];
    qsort(values, (size_t)n, sizeof *values, compare_doubles);
    const float rank = (float)q * (float)(n - 1);
    const int64_t below = (int64_t)rank, above = (int64_t)ceilf(rank);
    const float weight = rank - (float)below;
    const float a = (float)values[below], b = (float)values[above], d = b - a;
    const float lerp = weight < 0.5f ? a + weight * d : b - d * (1.0f - weight);
    return lerp;
}

/* Scratch of the head: one allocation for every per-token and per-row array. */
typedef struct head_scratch {
    double *rt, *l, *w, *dlw, *ddir, *factor, *is, *e, *entq; /* [n]; entq: the quantile's sorted entropies */
    double *nb, *nclamp, *s, *s_sg, *keep, *phi, *log_w;      /* [B] */
    double *block;
} head_scratch;

static int scratch_alloc(head_scratch *h, int64_t B, int64_t n)
{
    h->block = malloc(sizeof(double) * (size_t)(9 * n + 7 * B));
    if (!h->block)
        return -1;
    double *p = h->block;
    double **per_token[] = {&h->rt, &h->l, &h->w, &h->dlw, &h->ddir, &h->factor, &h->is, &h->e, &h->entq};
    for (size_t k = 0; k < sizeof per_token / sizeof per_token[0]; k++, p += n)
        *per_token[k] = p;
    double **per_row[] = {&h->nb, &h->nclamp, &h->s, &h->s_sg, &h->keep, &h->phi, &h->log_w};
    for (size_t k = 0; k < sizeof per_row / sizeof per_row[0]; k++, p += B)
        *per_row[k] = p;
    return 0;
}

/* The vLLM importance-sampling ratio of every token (detached; 1 everywhere when the correction does not apply),
 * truncated or masked by the mode's bounds. */
static void importance_sampling_ratios(const ref_grpo_tokens *tk, const ref_grpo_options *o, const double *sg,
                                       int applies, double *is)
{
    const int64_t B = tk->batch, T = tk->seq;
    const double lo = isnan(o->vllm_importance_sampling_clip_min) ? -INFINITY : o->vllm_importance_sampling_clip_min;
    const double hi = isnan(o->vllm_importance_sampling_clip_max) ? INFINITY : o->vllm_importance_sampling_clip_max;
    const ref_grpo_vllm_is_mode mode = o->vllm_importance_sampling_mode;
    for (int64_t b = 0; b < B; b++) {
        double seq = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const double old = tk->old_logp ? tk->old_logp[i] : sg[i];
            const double d = applies ? (old - tk->sampling_logp[i]) * tk->completion_mask[i] : 0.0;
            is[i] = exp(d);
            seq += d;
        }
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            double v = sequence_is_mode(mode) ? exp(seq) : is[i];
            if (applies) {
                if (mode == REF_GRPO_VLLM_IS_TOKEN_TRUNCATE || mode == REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE)
                    v = clamp(v, lo, hi);
                else if (v < lo || v > hi)
                    v = 0.0;
            }
            is[i] = applies ? v : 1.0;
        }
    }
}

/* TRL's get_high_entropy_mask on the anchor entropies: e_i in {0, 1}, in fp32 as TRL's entropies are
 * (entropies * mask >= threshold). */
static void entropy_mask(const ref_grpo_tokens *tk, double q, const double *H, double *scratch, double *e)
{
    const int64_t n = tk->batch * tk->seq;
    const double *m = tk->completion_mask;
    if (!(q < 1.0)) {
        for (int64_t i = 0; i < n; i++)
            e[i] = 1.0;
        return;
    }
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        if (m[i] != 0.0)
            scratch[count++] = H[i];
    if (count == 0) {
        for (int64_t i = 0; i < n; i++)
            e[i] = 0.0;
        return;
    }
    const double threshold = ref_grpo_quantile(scratch, count, 1.0 - q);
    for (int64_t i = 0; i < n; i++)
        e[i] = m[i] != 0.0 && (float)((float)H[i] * (float)m[i]) >= (float)threshold ? 1.0 : 0.0;
}

/* TRL's get_gamma_weights for row b (detached: from sg_logp); *log_w_out: its log w after the clamp. */
static double gamma_weight(const ref_grpo_tokens *tk, const ref_grpo_options *o, const double *sg, const double *is,
                           int applies, int64_t b, double *log_w_out)
{
    const int64_t T = tk->seq;
    const double lower = log(1e-8);
    double acc = 0.0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t i = b * T + t;
        const double old = tk->old_logp ? tk->old_logp[i] : sg[i];
        acc += clamp(sg[i] - old, -20.0, 20.0) * tk->completion_mask[i];
    }
    if (applies)
        for (int64_t t = 0; t < T; t++)
            acc += clamp(log(is[b * T + t]), lower, 20.0);
    const double log_w = clamp(acc, lower, 20.0), w = exp(log_w);
    *log_w_out = log_w;
    const int nonneg = tk->advantages[b] >= 0.0;
    const double k = nonneg ? o->vespo_k_pos : o->vespo_k_neg;
    double lam = nonneg ? o->vespo_lambda_pos : o->vespo_lambda_neg;
    lam = lam < 1e-4 ? 1e-4 : lam;
    const double phi = exp(lam + k * log_w - lam * w);
    return isfinite(phi) ? phi : 0.0;
}

/* One call of the head: its inputs, what the options make of them, the normalisers and the scratch. */
typedef struct head_call {
    const ref_grpo_tokens *tk;
    const ref_grpo_options *o;
    int64_t B, T, n;
    const double *logp, *mask, *adv, *H, *sg; /* sg: the stop-gradient anchor (logp without one) */
    double el, eh;                            /* the clip bounds */
    int has_delta, ent_per_token, ent_trl, bias_kl;
    int applies;                              /* the vLLM importance-sampling correction */
    double mclamp, tmax, nitems;              /* the reductions' denominators (sequence_sums) */
    head_scratch h;
} head_call;

/* The call's checks and constants, and its scratch: 0, -2 for a refused call, -1 without memory. */
static int head_begin(head_call *c, const ref_grpo_tokens *tk, const ref_grpo_options *o)
{
    if (!tk || !options_valid(o) || tk->batch <= 0 || tk->seq <= 0 || !tk->logp || !tk->completion_mask ||
        !tk->advantages)
        return -2;
    if (o->beta != 0.0 && !tk->ref_logp)
        return -2;
    if ((o->entropy_coef != 0.0 || o->top_entropy_quantile < 1.0) && !tk->entropy)
        return -2;
    c->applies = tk->sampling_logp && o->vllm_importance_sampling_correction;
    if (c->applies && !is_options_valid(o))
        return -2;
    c->tk = tk;
    c->o = o;
    c->B = tk->batch;
    c->T = tk->seq;
    c->n = c->B * c->T;
    c->logp = tk->logp;
    c->mask = tk->completion_mask;
    c->adv = tk->advantages;
    c->H = tk->entropy;
    c->sg = tk->sg_logp ? tk->sg_logp : tk->logp;
    c->el = o->epsilon_low;
    c->eh = isnan(o->epsilon_high) ? o->epsilon_low : o->epsilon_high;
    c->has_delta = !isnan(o->delta) && o->delta > 0.0;
    c->ent_per_token = o->entropy_coef != 0.0 && o->entropy_bonus == REF_GRPO_ENTROPY_PER_TOKEN;
    c->ent_trl = o->entropy_coef != 0.0 && o->entropy_bonus == REF_GRPO_ENTROPY_TRL;
    c->bias_kl = o->beta != 0.0 && o->use_bias_correction_kl;
    return scratch_alloc(&c->h, c->B, c->n);
}

/* The old log-prob of token i: the anchor's when the call is on-policy. */
static double old_logp(const head_call *c, int64_t i)
{
    return c->tk->old_logp ? c->tk->old_logp[i] : c->sg[i];
}

/* Row lengths and sequence log-ratios (from logp, and from the stop-gradient anchor); the reductions' denominators. */
static void sequence_sums(head_call *c)
{
    const int64_t B = c->B, T = c->T;
    const double *logp = c->logp, *mask = c->mask, *sg = c->sg;
    const head_scratch h = c->h;
    double msum = 0.0;
    for (int64_t b = 0; b < B; b++) {
        double nb = 0.0, acc = 0.0, acc_sg = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const double old = old_logp(c, i);
            nb += mask[i];
            acc += (logp[i] - old) * mask[i];
            acc_sg += (sg[i] - old) * mask[i];
        }
        msum += nb;
        h.nb[b] = nb;
        h.nclamp[b] = nb < 1.0 ? 1.0 : nb;
        h.s[b] = acc / h.nclamp[b];
        h.s_sg[b] = acc_sg / h.nclamp[b];
    }
    c->mclamp = msum < 1.0 ? 1.0 : msum;
    c->tmax = c->o->max_completion_length > 0 ? (double)c->o->max_completion_length : (double)T;
    /* TRL: inputs["num_items_in_batch"].clamp(min=1.0) */
    c->nitems = c->o->num_items_in_batch > 0.0 ? fmax(c->o->num_items_in_batch, 1.0) : c->mclamp;
}

/* The detached factors: importance-sampling ratios, the off-policy mask, the entropy mask, vespo's phi. */
static void detached_factors(const head_call *c)
{
    const ref_grpo_tokens *tk = c->tk;
    const ref_grpo_options *o = c->o;
    const int64_t B = c->B, T = c->T;
    const head_scratch h = c->h;
    importance_sampling_ratios(tk, o, c->sg, c->applies, h.is);
    for (int64_t b = 0; b < B; b++) {
        h.keep[b] = 1.0;
        if (!isnan(o->off_policy_mask_threshold)) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++) {
                const int64_t i = b * T + t;
                const double old = old_logp(c, i);
                const double samp = tk->sampling_logp ? tk->sampling_logp[i] : old;
                acc += (samp - c->sg[i]) * c->mask[i];
            }
            h.keep[b] = c->adv[b] >= 0.0 || acc / h.nclamp[b] <= o->off_policy_mask_threshold ? 1.0 : 0.0;
        }
        h.phi[b] = h.log_w[b] = NAN;
        if (o->loss_type == REF_GRPO_LOSS_VESPO)
            h.phi[b] = gamma_weight(tk, o, c->sg, h.is, c->applies, b, &h.log_w[b]);
    }
    entropy_mask(tk, o->top_entropy_quantile, tk->sg_entropy ? tk->sg_entropy : c->H, h.entq, h.e);
}

/* The policy term of token i in row b at ratio exp(lw) (lw_sg: lw with logp := sg_logp), with its derivatives
 * through the ratio (*dp_dr) and directly in logp (*dp_dlogp). */
static double policy_term(const head_call *c, int64_t b, int64_t i, double ratio, double lw_sg, double *dp_dr,
                          double *dp_dlogp)
{
    const ref_grpo_options *o = c->o;
    const ref_grpo_loss_type lt = o->loss_type;
    const double A = c->adv[b], el = c->el, eh = c->eh;
    *dp_dr = *dp_dlogp = 0.0;
    if (clipped_family(lt)) {
        const double c2 = clamp(ratio, 1.0 - el, 1.0 + eh);
        const double c1 = c->has_delta ? (ratio > o->delta ? o->delta : ratio) : ratio;
        const double dc1 = c->has_delta ? (ratio <= o->delta ? 1.0 : 0.0) : 1.0;
        const double dc2 = ratio >= 1.0 - el && ratio <= 1.0 + eh ? 1.0 : 0.0;
        double share1;
        const double pol = -min_with_share(c1 * A, c2 * A, &share1);
        *dp_dr = -(share1 * dc1 * A + (1.0 - share1) * dc2 * A);
        return pol;
    }
    if (lt == REF_GRPO_LOSS_CISPO) {
        const double rs = exp(lw_sg), cr = rs > eh ? eh : rs; /* clamp(max=eps_high).detach() */
        *dp_dlogp = -cr * A;
        return -cr * A * c->logp[i];
    }
    if (lt == REF_GRPO_LOSS_SAPO) {
        const double tau = A > 0.0 ? o->sapo_temperature_pos : o->sapo_temperature_neg;
        const double sig = 1.0 / (1.0 + exp(-(tau * (ratio - 1.0))));
        *dp_dr = -(4.0 * sig * (1.0 - sig)) * A;
        return -(sig * 4.0 / tau) * A;
    }
    /* vespo */
    *dp_dlogp = -c->h.phi[b] * A;
    return -c->h.phi[b] * A * c->logp[i];
}

/* Token i's weight in the loss type's reduction. */
static double reduction_weight(const head_call *c, int64_t b, int64_t i)
{
    const double *mask = c->mask;
    switch (c->o->loss_type) {
    case REF_GRPO_LOSS_GRPO:
    case REF_GRPO_LOSS_SAPO:
        return mask[i] / c->h.nclamp[b] / (double)c->B;
    case REF_GRPO_LOSS_LUSPO:
        return mask[i] / (double)c->B;
    case REF_GRPO_LOSS_BNPO:
        return mask[i] / c->mclamp;
    case REF_GRPO_LOSS_DR_GRPO:
        return mask[i] / ((double)c->B * c->tmax);
    default: /* dapo, cispo, vespo */
        return mask[i] / c->nitems;
    }
}

/* Per token: ratio, l, d l / d lw (through the log-ratio), d l / d logp (direct), reduction weight; and the result's
 * per-token outputs that r asks for. */
static void token_terms(const head_call *c, ref_grpo_result *r)
{
    const ref_grpo_tokens *tk = c->tk;
    const ref_grpo_options *o = c->o;
    const ref_grpo_is_level lvl = o->importance_sampling_level;
    const int64_t B = c->B, T = c->T;
    const double *logp = c->logp, *sg = c->sg;
    const head_scratch h = c->h;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            const double old = old_logp(c, i);
            double lw, lw_sg; /* log importance weight, and its value with logp := sg_logp */
            if (lvl == REF_GRPO_IS_TOKEN) {
                lw = logp[i] - old;
                lw_sg = sg[i] - old;
            } else if (lvl == REF_GRPO_IS_SEQUENCE) {
                lw = h.s[b];
                lw_sg = h.s_sg[b];
            } else {
                lw = logp[i] - sg[i] + h.s_sg[b];
                lw_sg = h.s_sg[b];
            }
            const double ratio = exp(lw);
            double dp_dr, dp_dlogp;
            const double pol = policy_term(c, b, i, ratio, lw_sg, &dp_dr, &dp_dlogp);
            const double factor = h.keep[b] * h.e[i] * (o->loss_type != REF_GRPO_LOSS_VESPO ? h.is[i] : 1.0);
            double li = pol * factor, kl = 0.0;
            double dlw = factor * dp_dr * ratio, ddir = factor * dp_dlogp;
            if (o->beta != 0.0) {
                const double d = tk->ref_logp[i] - logp[i];
                const double k3 = exp(d) - d - 1.0, dk3 = 1.0 - exp(d);
                kl = c->bias_kl ? k3 * ratio : k3;
                ddir += o->beta * (c->bias_kl ? dk3 * ratio : dk3);
                if (c->bias_kl)
                    dlw += o->beta * k3 * ratio;
                li += o->beta * kl;
            }
            if (c->ent_per_token)
                li -= o->entropy_coef * c->H[i];
            h.rt[i] = ratio;
            h.l[i] = li;
            h.dlw[i] = dlw;
            h.ddir[i] = ddir;
            h.factor[i] = factor;
            h.w[i] = reduction_weight(c, b, i);
            if (r && r->per_token_loss)
                r->per_token_loss[i] = li;
            if (r && r->ratio)
                r->ratio[i] = ratio;
            if (r && r->per_token_kl)
                r->per_token_kl[i] = kl;
            if (r && r->policy_factor)
                r->policy_factor[i] = factor;
            if (r && r->policy_term)
                r->policy_term[i] = pol * factor;
            if (r && r->is_ratio)
                r->is_ratio[i] = h.is[i];
            if (r && r->vespo_phi)
                r->vespo_phi[i] = h.phi[b];
            if (r && r->vespo_log_w)
                r->vespo_log_w[i] = h.log_w[b];
        }
    if (r && r->loss_weight)
        for (int64_t i = 0; i < c->n; i++)
            r->loss_weight[i] = h.w[i];
}

/* The loss before TRL's entropy bonus, summed in TRL's order. */
static double policy_loss(const head_call *c)
{
    const ref_grpo_loss_type lt = c->o->loss_type;
    const int64_t B = c->B, T = c->T, n = c->n;
    const double *mask = c->mask;
    const head_scratch h = c->h;
    double loss = 0.0;
    if (lt == REF_GRPO_LOSS_GRPO || lt == REF_GRPO_LOSS_SAPO || lt == REF_GRPO_LOSS_LUSPO) {
        for (int64_t b = 0; b < B; b++) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++)
                acc += h.l[b * T + t] * mask[b * T + t];
            loss += lt == REF_GRPO_LOSS_LUSPO ? acc : acc / h.nclamp[b];
        }
        return loss / (double)B;
    }
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++)
        acc += h.l[i] * mask[i];
    return acc / (lt == REF_GRPO_LOSS_BNPO ? c->mclamp : lt == REF_GRPO_LOSS_DR_GRPO ? (double)B * c->tmax : c->nitems);
}

/* TRL's entropy bonus over e m, to subtract from the loss; *norm: its normaliser. */
static double trl_entropy_bonus(const head_call *c, double *norm)
{
    double em = 0.0, acc = 0.0;
    for (int64_t i = 0; i < c->n; i++) {
        em += c->h.e[i] * c->mask[i];
        acc += c->H[i] * c->h.e[i] * c->mask[i];
    }
    *norm = em < 1.0 ? 1.0 : em;
    return c->o->entropy_coef * (acc / *norm);
}

/* Coefficients: g_logp = d(grad_output loss)/d logp, g_entropy = d(grad_output loss)/d H (ent_norm: TRL's entropy
 * bonus's normaliser). */
static void coefficients(const head_call *c, double grad_output, double ent_norm, double *g_logp, double *g_entropy)
{
    const int64_t B = c->B, T = c->T;
    const double *mask = c->mask;
    const head_scratch h = c->h;
    const int sequence_level = c->o->importance_sampling_level == REF_GRPO_IS_SEQUENCE;
    if (g_logp) {
        for (int64_t b = 0; b < B; b++) {
            double gs = 0.0; /* sequence level: d loss / d s_b */
            for (int64_t t = 0; t < T; t++) {
                const int64_t i = b * T + t;
                const double gl = grad_output * h.w[i]; /* d loss / d l_i */
                double g = gl * h.ddir[i];
                if (sequence_level)
                    gs += gl * h.dlw[i];
                else /* token, sequence_token: d lw_i / d logp_i = 1 */
                    g += gl * h.dlw[i];
                g_logp[i] = g;
            }
            if (sequence_level)
                for (int64_t t = 0; t < T; t++)
                    g_logp[b * T + t] += gs * mask[b * T + t] / h.nclamp[b];
        }
    }
    if (g_entropy)
        for (int64_t i = 0; i < c->n; i++)
            g_entropy[i] = c->ent_per_token ? -c->o->entropy_coef * grad_output * h.w[i]
                           : c->ent_trl     ? -c->o->entropy_coef * grad_output * h.e[i] * mask[i] / ent_norm
                                            : 0.0;
}

/* The clip metrics (TRL's clip_ratio/low_mean ... region_mean, nanmin / nanmax over rows; cispo's clip ratio). */
static void clip_metrics(const head_call *c, ref_grpo_metrics *m)
{
    const ref_grpo_options *o = c->o;
    const ref_grpo_is_level lvl = o->importance_sampling_level;
    const int64_t B = c->B, T = c->T;
    const double *mask = c->mask, *adv = c->adv, el = c->el, eh = c->eh;
    const head_scratch h = c->h;
    double lo = 0.0, hi = 0.0, region = 0.0, cispo = 0.0;
    for (int64_t b = 0; b < B; b++) {
        double row_lo = 0.0, row_hi = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = b * T + t;
            /* sequence level: one (B, 1) value per row, averaged over rows with weight 1 */
            if (lvl == REF_GRPO_IS_SEQUENCE && t > 0)
                break;
            const double wt = lvl == REF_GRPO_IS_SEQUENCE ? 1.0 : mask[i];
            const double c1 = c->has_delta ? (h.rt[i] > o->delta ? o->delta : h.rt[i]) : h.rt[i];
            const int is_lo = c1 < 1.0 - el && adv[b] < 0.0, is_hi = c1 > 1.0 + eh && adv[b] > 0.0;
            lo += is_lo * wt;
            hi += is_hi * wt;
            row_lo += is_lo * wt;
            row_hi += is_hi * wt;
            region += (is_lo || is_hi) * wt;
            cispo += (h.rt[i] > eh && adv[b] > 0.0) * wt;
        }
        /* masked_seq_mean, unclamped (0 / 0 = NaN for an empty row), then nanmin / nanmax */
        const double den = lvl == REF_GRPO_IS_SEQUENCE ? 1.0 : h.nb[b];
        const double seq_lo = row_lo / den, seq_hi = row_hi / den;
        if (!isnan(seq_lo) && !(seq_lo >= m->clip_low_min))
            m->clip_low_min = seq_lo;
        if (!isnan(seq_hi) && !(seq_hi <= m->clip_high_max))
            m->clip_high_max = seq_hi;
    }
    const double den = lvl == REF_GRPO_IS_SEQUENCE ? (double)B : c->mclamp;
    if (o->loss_type == REF_GRPO_LOSS_CISPO) {
        m->cispo_clip_ratio = cispo / den;
        m->clip_low_min = m->clip_high_max = NAN;
    } else {
        m->clip_low_mean = lo / den;
        m->clip_high_mean = hi / den;
        m->clip_region_mean = region / den;
    }
}

/* The sampler's metrics where the correction applies: |old - sampling| log-prob differences over the completion
 * tokens, and the importance-sampling ratios (one per row in the sequence modes). */
static void sampling_metrics(const head_call *c, ref_grpo_metrics *m)
{
    const int64_t T = c->T, n = c->n;
    const double *mask = c->mask, *is = c->h.is;
    double dsum = 0.0, dmax = 0.0, rsum = 0.0, rmin = INFINITY, rmax = -INFINITY, count = 0.0, rcount = 0.0;
    const int seq_mode = sequence_is_mode(c->o->vllm_importance_sampling_mode);
    for (int64_t i = 0; i < n; i++) {
        if (mask[i] == 0.0)
            continue;
        const double d = fabs(old_logp(c, i) - c->tk->sampling_logp[i]);
        dsum += d;
        dmax = count == 0.0 || d > dmax ? d : dmax;
        count += 1.0;
    }
    for (int64_t i = 0; i < n; i++) {
        if (seq_mode ? i % T != 0 : mask[i] == 0.0)
            continue;
        rsum += is[i];
        rmin = is[i] < rmin ? is[i] : rmin;
        rmax = is[i] > rmax ? is[i] : rmax;
        rcount += 1.0;
    }
    m->sampling_logp_diff_mean = count > 0.0 ? dsum / count : 0.0;
    m->sampling_logp_diff_max = count > 0.0 ? dmax : 0.0;
    m->is_ratio_min = rcount > 0.0 ? rmin : 0.0;
    m->is_ratio_mean = rcount > 0.0 ? rsum / rcount : 0.0;
    m->is_ratio_max = rcount > 0.0 ? rmax : 0.0;
}

/* Every metric TRL logs, NaN where it logs none (before_bonus: the loss before TRL's entropy bonus). */
static void metrics(const head_call *c, double before_bonus, ref_grpo_metrics *m)
{
    const ref_grpo_options *o = c->o;
    const int64_t n = c->n;
    const double *mask = c->mask, *logp = c->logp;
    m->entropy = NAN;
    if (c->H) {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++)
            acc += c->H[i] * mask[i];
        m->entropy = acc / c->mclamp;
    }
    m->kl = NAN;
    if (o->beta != 0.0) {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const double d = c->tk->ref_logp[i] - logp[i];
            acc += (exp(d) - d - 1.0) * (c->bias_kl ? c->h.rt[i] : 1.0) * mask[i];
        }
        m->kl = acc / c->mclamp;
    }
    m->clip_low_mean = m->clip_high_mean = m->clip_region_mean = m->cispo_clip_ratio = NAN;
    m->clip_low_min = m->clip_high_max = NAN;
    if (clipped_family(o->loss_type) || o->loss_type == REF_GRPO_LOSS_CISPO)
        clip_metrics(c, m);
    m->policy_loss = o->entropy_coef != 0.0 ? before_bonus : NAN;
    m->entropy_coef = o->entropy_coef != 0.0 ? o->entropy_coef : NAN;
    m->vespo_phi_seq_mean = NAN;
    if (o->loss_type == REF_GRPO_LOSS_VESPO) {
        double acc = 0.0;
        for (int64_t b = 0; b < c->B; b++)
            acc += c->h.phi[b];
        m->vespo_phi_seq_mean = acc / (double)c->B;
    }
    m->sampling_logp_diff_mean = m->sampling_logp_diff_max = NAN;
    m->is_ratio_min = m->is_ratio_mean = m->is_ratio_max = NAN;
    if (c->applies)
        sampling_metrics(c, m);
}

int ref_grpo_head(const ref_grpo_tokens *tk, const ref_grpo_options *o, double grad_output, ref_grpo_result *r,
                  double *g_logp, double *g_entropy)
{
    head_call c;
    const int status = head_begin(&c, tk, o);
    if (status)
        return status;
    sequence_sums(&c);
    detached_factors(&c);
    token_terms(&c, r);
    const double before_bonus = policy_loss(&c);
    double ent_norm = 1.0;
    const double loss = c.ent_trl ? before_bonus - trl_entropy_bonus(&c, &ent_norm) : before_bonus;
    coefficients(&c, grad_output, ent_norm, g_logp, g_entropy);
    if (r) {
        r->loss = loss;
        metrics(&c, before_bonus, &r->metrics);
    }
    free(c.h.block);
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
     * d (sum_k p_k z_k) / d z_j = p_j + p_j z_j - p_j sum_k p_k z_k).  dz / du = 1 / temperature.
     * An id outside the vocabulary has the constant log-prob 0: no g_logp term. */
    const double in_range = target >= 0 && target < v ? 1.0 : 0.0;
    for (int64_t j = 0; j < v; j++) {
        const double lp = u[j] / temperature - lse, p = exp(lp);
        const double onehot = j == target ? 1.0 : 0.0;
        du[j] = (in_range * g_logp * (onehot - p) - g_entropy * p * (lp + h)) / temperature;
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
    ref_grpo_tokens tk = {p->batch,      p->seq,      logp,          ent,          p->completion_mask,
                          p->advantages, p->old_logp, p->ref_logp,   p->sg_logp,   p->sampling_logp,
                          p->sg_entropy};
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
