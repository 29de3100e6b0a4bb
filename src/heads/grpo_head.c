/* The GRPO head's math (formulas in fusedhead.h): per-sequence values, per-token losses and backward
 * coefficients, partial sums and their loss and metrics, and the top-entropy threshold. Scalar math on [B, T]
 * vectors in double; the engine does every tile (grpo.c, src/mpi/grpo_mpi.c). */
#include "grpo_head.h"
#include "sequences.h"

#include <math.h>
#include <string.h>

double fh_grpo_epsilon_high(const fh_grpo_options *o)
{
    return isnan(o->epsilon_high) ? o->epsilon_low : o->epsilon_high;
}

static int delta_on(const fh_grpo_options *o)
{
    return o->delta > 0.0; /* NaN and 0 are off */
}

static int clipped_family(fh_grpo_loss_type t)
{
    return t == FH_GRPO_LOSS_GRPO || t == FH_GRPO_LOSS_BNPO || t == FH_GRPO_LOSS_DR_GRPO || t == FH_GRPO_LOSS_DAPO ||
           t == FH_GRPO_LOSS_LUSPO;
}

int fh_grpo_is_sequence_mode(fh_grpo_vllm_is_mode mode)
{
    return mode == FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE || mode == FH_GRPO_VLLM_IS_SEQUENCE_MASK;
}

int fh_grpo_is_correction(const fh_grpo_batch *bt, const fh_grpo_options *o)
{
    return bt->sampling_per_token_logps != NULL && o->vllm_importance_sampling_correction;
}

/* torch.min / torch.clamp semantics: NaN propagates (fmin and fmax would drop it and hide a NaN log-prob). */
static double min_nan(double x, double y)
{
    return isnan(x) || isnan(y) ? NAN : x < y ? x : y;
}

static double max_nan(double x, double y)
{
    return isnan(x) || isnan(y) ? NAN : x > y ? x : y;
}

static double clamp(double x, double lo, double hi)
{
    return min_nan(max_nan(x, lo), hi);
}

/* torch.min(x, y) backward: the whole gradient to the smaller, halves on a tie. */
static double share_of_first(double x, double y)
{
    return x < y ? 1.0 : x > y ? 0.0 : 0.5;
}

/* ---- per-token policy term ----------------------------------------------------------------- */

typedef struct token_policy {
    double ratio; /* forward value of r (TRL's coef_1) */
    double loss;  /* pol_i */
    double slope; /* d pol / d r (clipped family, sapo), or d pol / d logp (cispo, vespo) */
} token_policy;

static token_policy policy(const fh_grpo_options *o, double log_ratio, double logp, double advantage, double phi)
{
    token_policy p;
    p.ratio = exp(log_ratio);
    const double r = p.ratio, a = advantage;
    if (o->loss_type == FH_GRPO_LOSS_CISPO) {
        const double capped = min_nan(r, fh_grpo_epsilon_high(o)); /* detached */
        p.loss = -capped * a * logp;
        p.slope = -capped * a;
    } else if (o->loss_type == FH_GRPO_LOSS_VESPO) {
        p.loss = -phi * a * logp;
        p.slope = -phi * a;
    } else if (o->loss_type == FH_GRPO_LOSS_SAPO) {
        const double tau = a > 0.0 ? o->sapo_temperature_pos : o->sapo_temperature_neg;
        const double sig = 1.0 / (1.0 + exp(-tau * (r - 1.0)));
        p.loss = -sig * (4.0 / tau) * a;
        p.slope = -4.0 * sig * (1.0 - sig) * a;
    } else {
        const double lo = 1.0 - o->epsilon_low, hi = 1.0 + fh_grpo_epsilon_high(o);
        const double c2 = clamp(r, lo, hi), dc2 = (r >= lo && r <= hi) ? 1.0 : 0.0;
        const double c1 = delta_on(o) && r > o->delta ? o->delta : r;
        const double dc1 = delta_on(o) && r > o->delta ? 0.0 : 1.0;
        const double share = share_of_first(c1 * a, c2 * a);
        p.loss = -min_nan(c1 * a, c2 * a);
        p.slope = -(share * dc1 + (1.0 - share) * dc2) * a;
    }
    return p;
}

/* The vLLM importance-sampling ratio's bounds: *_truncate clamps, *_mask zeroes what lies outside. */
static double bounded_is_ratio(const fh_grpo_options *o, double ratio)
{
    const double lo = o->vllm_importance_sampling_clip_min, hi = o->vllm_importance_sampling_clip_max;
    if (o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_TOKEN_TRUNCATE ||
        o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE) {
        if (!isnan(lo))
            ratio = max_nan(ratio, lo);
        return isnan(hi) ? ratio : min_nan(ratio, hi);
    }
    return (!isnan(lo) && ratio < lo) || (!isnan(hi) && ratio > hi) ? 0.0 : ratio;
}

/* ---- per-sequence values ------------------------------------------------------------------- */

/* Sequence b's first row (b = B: n). */
static int64_t first_row(const fh_grpo_batch *bt, int64_t b)
{
    return fh_sequence_first(bt->cu_seqlens, bt->seq, b);
}

static double old_logp(const fh_grpo_head *h, int64_t i, const double *logp)
{
    return h->bt->old_per_token_logps ? (double)h->bt->old_per_token_logps[i] : logp[i];
}

/* Token i's importance-sampling ratio in a token mode (TRL computes it with the mask applied to the gap). */
static double token_is_ratio(const fh_grpo_head *h, int64_t i, const double *logp)
{
    const double gap = (old_logp(h, i, logp) - (double)h->bt->sampling_per_token_logps[i]) *
                       (double)h->bt->completion_mask[i];
    return bounded_is_ratio(h->o, exp(gap));
}

typedef struct sequence_values {
    double length;   /* sum_t m */
    double keep;     /* the off-policy mask (1 without it) */
    double is_ratio; /* the sequence modes' importance-sampling ratio (1 otherwise) */
    double phi;      /* VESPO's gamma weight (vespo) */
} sequence_values;

static sequence_values sequence_values_of(const fh_grpo_head *h, int64_t b, const double *logp)
{
    const fh_grpo_batch *bt = h->bt;
    const fh_grpo_options *o = h->o;
    const int correction = fh_grpo_is_correction(bt, o);
    const double a = bt->advantages[b];
    sequence_values v = {0.0, 1.0, 1.0, 0.0};
    double sampling_gap = 0.0, is_gap = 0.0, vespo_log_ratio = 0.0;
    for (int64_t i = first_row(bt, b); i < first_row(bt, b + 1); i++) {
        const double m = bt->completion_mask[i], old = old_logp(h, i, logp);
        v.length += m;
        const double samp = bt->sampling_per_token_logps ? (double)bt->sampling_per_token_logps[i] : old;
        sampling_gap += (samp - logp[i]) * m;
        if (correction)
            is_gap += (old - samp) * m;
        if (o->loss_type == FH_GRPO_LOSS_VESPO) {
            vespo_log_ratio += clamp(logp[i] - old, -20.0, 20.0) * m;
            if (correction) /* token modes only (checked); over every position, as TRL sums them */
                vespo_log_ratio += clamp(log(token_is_ratio(h, i, logp)), log(1e-8), 20.0);
        }
    }
    if (!isnan(o->off_policy_mask_threshold))
        v.keep = a >= 0.0 || sampling_gap / fmax(v.length, 1.0) <= o->off_policy_mask_threshold;
    if (correction && fh_grpo_is_sequence_mode(o->vllm_importance_sampling_mode))
        v.is_ratio = bounded_is_ratio(o, exp(is_gap));
    if (o->loss_type == FH_GRPO_LOSS_VESPO) {
        const double log_w = clamp(vespo_log_ratio, log(1e-8), 20.0);
        const double k = a >= 0.0 ? o->vespo_k_pos : o->vespo_k_neg;
        const double lambda = fmax(a >= 0.0 ? o->vespo_lambda_pos : o->vespo_lambda_neg, 1e-4);
        const double phi = exp(lambda + k * log_w - lambda * exp(log_w));
        v.phi = isfinite(phi) ? phi : 0.0; /* TRL's nan_to_num(nan=0, posinf=0, neginf=0) */
    }
    return v;
}

/* ---- the head: [B, T] vectors -> loss, metrics, coefficients ------------------------------- */

void fh_grpo_head_count(fh_grpo_head *h)
{
    const fh_grpo_batch *bt = h->bt;
    double total = 0.0;
    for (int64_t b = 0; b < bt->batch; b++) {
        double count = 0.0;
        for (int64_t i = first_row(bt, b); i < first_row(bt, b + 1); i++)
            count += bt->completion_mask[i];
        total += count;
        h->seq_count[b] = fmax(count, 1.0);
    }
    h->mask_sum = total;
    h->mask_total = fmax(total, 1.0);
    h->batch_total = (double)bt->batch;
    h->entropy_threshold = NAN;
}

void fh_grpo_head_log_ratios(fh_grpo_head *h, const double *logp, int64_t b0, int64_t b1)
{
    const fh_grpo_batch *bt = h->bt;
    for (int64_t b = b0; b < b1; b++) {
        double acc = 0.0;
        for (int64_t i = first_row(bt, b); i < first_row(bt, b + 1); i++)
            acc += (logp[i] - old_logp(h, i, logp)) * bt->completion_mask[i];
        h->seq_log_ratio[b] = acc / h->seq_count[b];
    }
}

void fh_grpo_head_prepare(fh_grpo_head *h, const double *logp)
{
    fh_grpo_head_count(h);
    fh_grpo_head_log_ratios(h, logp, 0, h->bt->batch);
}

/* ---- the top-entropy threshold ------------------------------------------------------------ */

/* Doubles as unsigned keys in the same order (the sign bit flipped, negatives' bits inverted), and back. */
static uint64_t order_key(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u >> 63 ? ~u : u | (UINT64_C(1) << 63);
}

static double key_value(uint64_t key)
{
    const uint64_t u = key >> 63 ? key & ~(UINT64_C(1) << 63) : ~key;
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The entropy the mask compares: the fp32 value the forward outputs and a backward gets back. */
static double stored_entropy(const double *entropy, int64_t i)
{
    return (double)(float)entropy[i];
}

static fh_status sum_over_ranks(const fh_grpo_reducer *r, double *values, int n)
{
    return r ? r->sum(r->self, values, n) : FH_OK;
}

fh_status fh_grpo_head_entropy_threshold(fh_grpo_head *h, const double *entropy, const fh_grpo_reducer *reducer)
{
    const fh_grpo_batch *bt = h->bt;
    const int64_t n = first_row(bt, bt->batch);
    if (!(h->o->top_entropy_quantile < 1.0))
        return FH_OK;
    double count = 0.0;
    for (int64_t i = 0; i < n; i++)
        count += bt->completion_mask[i] != 0.0f;
    fh_status st = sum_over_ranks(reducer, &count, 1);
    if (st != FH_OK)
        return st;
    if (count == 0.0) { /* TRL: no valid token, every entropy-mask entry false */
        h->entropy_threshold = INFINITY;
        h->kept_total = 1.0;
        return FH_OK;
    }
    /* torch.quantile of an fp32 tensor: the rank q (count - 1) in fp32, then linear interpolation between the
     * order statistics at its floor and ceil, each found exactly by bisecting the keys with one (all-reduced) count
     * per step, so no rank gathers entropies. */
    const float position = (float)(1.0 - h->o->top_entropy_quantile) * (float)(count - 1.0);
    const double rank[2] = {floorf(position), ceilf(position)};
    uint64_t low[2] = {0, 0}, high[2] = {UINT64_MAX, UINT64_MAX};
    while (low[0] < high[0] || low[1] < high[1]) {
        uint64_t mid[2];
        double at_most[2] = {0.0, 0.0};
        for (int k = 0; k < 2; k++)
            mid[k] = low[k] + (high[k] - low[k]) / 2;
        for (int64_t i = 0; i < n; i++)
            if (bt->completion_mask[i] != 0.0f) {
                const uint64_t key = order_key(stored_entropy(entropy, i));
                at_most[0] += key <= mid[0];
                at_most[1] += key <= mid[1];
            }
        st = sum_over_ranks(reducer, at_most, 2);
        if (st != FH_OK)
            return st;
        for (int k = 0; k < 2; k++) {
            if (low[k] == high[k])
                continue;
            if (at_most[k] > rank[k])
                high[k] = mid[k];
            else
                low[k] = mid[k] + 1;
        }
    }
    /* torch.lerp in fp32 (the entropies are fp32 values, so the keys' values are exact) */
    const float below = (float)key_value(low[0]), above = (float)key_value(low[1]), w = position - (float)rank[0];
    h->entropy_threshold = w < 0.5f ? below + w * (above - below) : above - (above - below) * (1.0f - w);
    double kept = 0.0;
    for (int64_t i = 0; i < n; i++)
        kept += fh_grpo_entropy_kept(h, entropy, i) * bt->completion_mask[i];
    st = sum_over_ranks(reducer, &kept, 1);
    h->kept_total = fmax(kept, 1.0);
    return st;
}

int fh_grpo_entropy_kept(const fh_grpo_head *h, const double *entropy, int64_t i)
{
    const double m = h->bt->completion_mask[i];
    if (isnan(h->entropy_threshold))
        return 1;
    return m != 0.0 && (float)stored_entropy(entropy, i) * (float)m >= h->entropy_threshold; /* fp32, as TRL */
}

/* d loss / d l_i per unit of mask weight: the loss type's normalisation of sequence b. */
static double sequence_weight(const fh_grpo_head *h, int64_t b)
{
    const fh_grpo_options *o = h->o;
    const double batch = h->batch_total;
    switch (o->loss_type) {
    case FH_GRPO_LOSS_GRPO:
    case FH_GRPO_LOSS_SAPO: return 1.0 / (batch * h->seq_count[b]);
    case FH_GRPO_LOSS_BNPO: return 1.0 / h->mask_total;
    case FH_GRPO_LOSS_DR_GRPO:
        return 1.0 / (batch * (double)(o->max_completion_length > 0 ? o->max_completion_length : h->bt->seq));
    case FH_GRPO_LOSS_LUSPO: return 1.0 / batch; /* TRL 1.16.0: (l m).sum(-1).mean() */
    default: return 1.0 / fh_grpo_items(h);
    }
}

double fh_grpo_items(const fh_grpo_head *h)
{
    /* TRL: num_items_in_batch.clamp(min=1.0) */
    return h->o->num_items_in_batch > 0.0 ? fmax(h->o->num_items_in_batch, 1.0) : h->mask_total;
}

/* The entropy bonus's denominator, whatever the loss type (TRL 1.16.0): the count of the tokens it covers,
 * max(sum e m, 1), never num_items_in_batch. */
static double bonus_scale(const fh_grpo_head *h)
{
    return isnan(h->entropy_threshold) ? h->mask_total : h->kept_total;
}

static void partials_init(fh_grpo_partials *p)
{
    memset(&p->sum, 0, sizeof p->sum);
    p->max.neg_clip_low_min = p->max.clip_high_max = p->max.logp_difference_max = -INFINITY;
    p->max.neg_is_ratio_min = p->max.is_ratio_max = -INFINITY;
}

/* The sampling metrics' share of one ratio and, for a token, its log-prob gap. */
static void count_is_ratio(fh_grpo_partials *p, double ratio)
{
    p->sum.is_ratio += ratio;
    p->sum.is_ratio_count += 1.0;
    p->max.neg_is_ratio_min = fmax(p->max.neg_is_ratio_min, -ratio);
    p->max.is_ratio_max = fmax(p->max.is_ratio_max, ratio);
}

/* One sequence's clip flags (mask-weighted sums, or the sequence's flags): the batch means' share, and the
 * sequence's means for the extremes. */
static void count_clips(fh_grpo_partials *p, double low, double high, double length, int sequence_level)
{
    p->sum.clip_low += low;
    p->sum.clip_high += high;
    const double low_mean = sequence_level ? low : low / length, high_mean = sequence_level ? high : high / length;
    if (!isnan(low_mean)) /* TRL's nanmin / nanmax skip a sequence without tokens (0 / 0) */
        p->max.neg_clip_low_min = fmax(p->max.neg_clip_low_min, -low_mean);
    if (!isnan(high_mean))
        p->max.clip_high_max = fmax(p->max.clip_high_max, high_mean);
}

void fh_grpo_head_evaluate(const fh_grpo_head *h, int64_t b0, int64_t b1, const double *logp, const double *entropy,
                           double grad, const fh_grpo_head_outputs *out, fh_grpo_partials *partials)
{
    const fh_grpo_batch *bt = h->bt;
    const fh_grpo_options *o = h->o;
    const int sequence_level = o->importance_sampling_level == FH_GRPO_IS_SEQUENCE;
    const int correction = fh_grpo_is_correction(bt, o);
    const int token_is = correction && !fh_grpo_is_sequence_mode(o->vllm_importance_sampling_mode);
    const int is_weighs_policy = correction && o->loss_type != FH_GRPO_LOSS_VESPO;
    const int direct = o->loss_type == FH_GRPO_LOSS_CISPO || o->loss_type == FH_GRPO_LOSS_VESPO;
    const double lo = 1.0 - o->epsilon_low, hi = 1.0 + fh_grpo_epsilon_high(o), eh = fh_grpo_epsilon_high(o);
    const double bonus_denominator = bonus_scale(h);
    fh_grpo_partials p;
    partials_init(&p);
    for (int64_t b = b0; b < b1; b++) {
        const double a = bt->advantages[b];
        const sequence_values sv = sequence_values_of(h, b, logp);
        const double weight = sequence_weight(h, b);
        double seq_loss = 0.0, seq_slope = 0.0, seq_low = 0.0, seq_high = 0.0;
        p.sum.phi += sv.phi;
        if (correction && !token_is)
            count_is_ratio(&p, sv.is_ratio);
        for (int64_t i = first_row(bt, b); i < first_row(bt, b + 1); i++) {
            const double m = bt->completion_mask[i];
            const double log_ratio = sequence_level ? h->seq_log_ratio[b] : logp[i] - old_logp(h, i, logp);
            const token_policy pol = policy(o, log_ratio, logp[i], a, sv.phi);
            const double is_ratio = token_is ? token_is_ratio(h, i, logp) : sv.is_ratio;
            const int kept = entropy ? fh_grpo_entropy_kept(h, entropy, i) : 1;
            const double factor = sv.keep * kept * (is_weighs_policy ? is_ratio : 1.0); /* detached */
            double l = factor * pol.loss, dl_dlogp = 0.0, dl_dratio = factor * pol.slope;
            if (direct) {
                dl_dlogp += factor * pol.slope;
                dl_dratio = 0.0;
            }
            if (o->beta != 0.0) {
                const double d = (double)bt->ref_per_token_logps[i] - logp[i];
                const double kl = exp(d) - d - 1.0, correct = o->use_bias_correction_kl ? pol.ratio : 1.0;
                l += o->beta * kl * correct;
                p.sum.kl += kl * correct * m;
                dl_dlogp += o->beta * (1.0 - exp(d)) * correct;
                if (o->use_bias_correction_kl)
                    dl_dratio += o->beta * kl; /* d (kl r) / d r */
            }
            if (sequence_level)
                seq_slope += weight * m * dl_dratio * pol.ratio; /* d loss / d s_b */
            else
                dl_dlogp += dl_dratio * pol.ratio; /* d r / d logp = r */
            seq_loss += l * m;
            if (entropy) {
                p.sum.entropy += entropy[i] * m;
                p.sum.bonus_entropy += entropy[i] * m * kept;
            }
            if (out->per_token_loss)
                out->per_token_loss[i] = (float)l;
            if (out->g_logp) /* logp is the constant 0 where the id is outside the vocabulary (masked padding) */
                out->g_logp[i] = bt->completion_ids[i] >= 0 && bt->completion_ids[i] < h->vocab
                                     ? grad * weight * m * dl_dlogp
                                     : 0.0;
            if (out->g_entropy)
                out->g_entropy[i] = -grad * o->entropy_coef * m * kept / bonus_denominator;
            if (correction && m != 0.0) {
                const double gap = fabs(old_logp(h, i, logp) - (double)bt->sampling_per_token_logps[i]);
                p.sum.logp_difference += gap;
                p.sum.logp_difference_count += 1.0;
                p.max.logp_difference_max = fmax(p.max.logp_difference_max, gap);
                if (token_is)
                    count_is_ratio(&p, is_ratio);
            }
            /* Clip flags on coef_1 after the delta clamp (TRL): token means, or one flag per sequence. */
            if (!sequence_level || i == first_row(bt, b)) {
                const double w = sequence_level ? 1.0 : m;
                const double c1 = delta_on(o) && pol.ratio > o->delta ? o->delta : pol.ratio;
                const int low = c1 < lo && a < 0.0, high = c1 > hi && a > 0.0;
                seq_low += low * w;
                seq_high += high * w;
                p.sum.clip_region += (low || high) * w;
                p.sum.cispo_clip += (pol.ratio > eh && a > 0.0) * w;
            }
        }
        count_clips(&p, seq_low, seq_high, sv.length, sequence_level);
        p.sum.loss += seq_loss * weight;
        if (out->g_logp && seq_slope != 0.0)
            for (int64_t i = first_row(bt, b); i < first_row(bt, b + 1); i++)
                out->g_logp[i] += grad * seq_slope * bt->completion_mask[i] / h->seq_count[b];
    }
    if (!entropy)
        p.sum.entropy = p.sum.bonus_entropy = NAN;
    *partials = p;
}

static double extreme(double maximum, double sign)
{
    return maximum == -INFINITY ? NAN : sign * maximum;
}

void fh_grpo_head_finish(const fh_grpo_head *h, const fh_grpo_partials *p, const fh_grpo_head_outputs *out)
{
    const fh_grpo_options *o = h->o;
    double loss = p->sum.loss;
    if (o->entropy_coef != 0.0)
        loss -= o->entropy_coef * p->sum.bonus_entropy / bonus_scale(h);
    if (out->loss)
        *out->loss = loss;
    if (!out->metrics)
        return;
    const double den = o->importance_sampling_level == FH_GRPO_IS_SEQUENCE ? h->batch_total : h->mask_total;
    const int clipped = clipped_family(o->loss_type), cispo = o->loss_type == FH_GRPO_LOSS_CISPO;
    const int bonus = o->entropy_coef != 0.0, correction = fh_grpo_is_correction(h->bt, o);
    const double diffs = p->sum.logp_difference_count, ratios = p->sum.is_ratio_count;
    fh_grpo_metrics m;
    m.kl = o->beta != 0.0 ? p->sum.kl / h->mask_total : NAN;
    m.entropy = p->sum.entropy / h->mask_total;
    m.clip_ratio_low_mean = clipped ? p->sum.clip_low / den : NAN;
    m.clip_ratio_high_mean = clipped ? p->sum.clip_high / den : NAN;
    m.clip_ratio_region_mean = clipped ? p->sum.clip_region / den : NAN;
    m.cispo_clip_ratio = cispo ? p->sum.cispo_clip / den : NAN;
    m.clip_ratio_low_min = clipped ? extreme(p->max.neg_clip_low_min, -1.0) : NAN;
    m.clip_ratio_high_max = clipped ? extreme(p->max.clip_high_max, 1.0) : NAN;
    m.policy_loss = bonus ? p->sum.loss : NAN;
    m.entropy_coef = bonus ? o->entropy_coef : NAN;
    m.vespo_phi_seq_mean = o->loss_type == FH_GRPO_LOSS_VESPO ? p->sum.phi / h->batch_total : NAN;
    m.sampling_logp_difference_mean = !correction ? NAN : diffs > 0.0 ? p->sum.logp_difference / diffs : 0.0;
    m.sampling_logp_difference_max = !correction ? NAN : diffs > 0.0 ? p->max.logp_difference_max : 0.0;
    m.importance_sampling_ratio_min = !correction ? NAN : ratios > 0.0 ? -p->max.neg_is_ratio_min : 0.0;
    m.importance_sampling_ratio_mean = !correction ? NAN : ratios > 0.0 ? p->sum.is_ratio / ratios : 0.0;
    m.importance_sampling_ratio_max = !correction ? NAN : ratios > 0.0 ? p->max.is_ratio_max : 0.0;
    *out->metrics = m;
}
