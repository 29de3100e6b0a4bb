/* Preference head (DPO, ORPO, SimPO, CPO; TRL semantics, formulas in fusedhead.h): option and batch checks,
 * token log-probs -> sequence log-probs -> per-pair losses, metrics and backward coefficients. The batch is
 * chosen sequences then rejected ones, so pair b's two sequences are rows b T .. and (B + b) T ..: the
 * single-call step runs the engine's paired row blocks, which hold both. Scalar math on [2B, T] vectors. */
#include "engine/engine.h"
#include "linear.h"

#include <math.h>

/* Workspace slots ([n] per token, or [2B] per sequence). */
enum {
    SLOT_LSE,
    SLOT_Z_TARGET_THEN_A,
    SLOT_G_LOGP_AS_B,
    SLOT_SUM_EXP_THEN_C,
    SLOT_SUM_Z,        /* sum_j z_j, for the logits metrics */
    SLOT_LOGP,
    SLOT_SEQ_COUNT,    /* [2B] max(sum_t m, 1) */
    SLOT_SEQ_LOGP,     /* [2B] l */
    SLOT_SEQ_REF,      /* [2B] reference l (dpo), else 0 */
    SLOTS
};
_Static_assert(SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

FH_API fh_status fh_preference_options_init(fh_preference_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_preference_options defaults = {FH_PREFERENCE_DPO, FH_PREFERENCE_SIGMOID, 0.1, 0.0, 0.5, 0.0, 1.0};
    *options = defaults;
    return FH_OK;
}

static const char *loss_name(fh_preference_loss loss)
{
    static const char *const names[] = {"dpo", "orpo", "simpo", "cpo"};
    return names[loss];
}

/* TRL's loss_type choices of each loss. */
static int has_loss_type(fh_preference_loss loss, fh_preference_loss_type type)
{
    switch (loss) {
    case FH_PREFERENCE_DPO: return 1;
    case FH_PREFERENCE_CPO: return type != FH_PREFERENCE_ROBUST;
    default: return type == FH_PREFERENCE_SIGMOID;
    }
}

/* Sequence log-probs are averaged over their tokens (TRL's average_log_prob) for these, else summed. */
static int averaged(const fh_preference_options *o)
{
    return o->loss == FH_PREFERENCE_SIMPO || o->loss == FH_PREFERENCE_ORPO || o->loss_type == FH_PREFERENCE_IPO;
}

/* The NLL term's weight: rpo_alpha (dpo), cpo_alpha (cpo, simpo), 1 (orpo). */
static double nll_weight(const fh_preference_options *o)
{
    return o->loss == FH_PREFERENCE_DPO ? o->rpo_alpha : o->loss == FH_PREFERENCE_ORPO ? 1.0 : o->cpo_alpha;
}

static fh_status check_options(fh_context *ctx, const fh_preference_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if ((unsigned)o->loss > FH_PREFERENCE_CPO)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "loss = %d is not one of dpo (0) .. cpo (3)",
                       (int)o->loss);
    static const char *const types[] = {"sigmoid", "hinge", "ipo", "robust"};
    if ((unsigned)o->loss_type > FH_PREFERENCE_ROBUST)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "loss_type = %d is not one of sigmoid (0) .. robust (3)",
                       (int)o->loss_type);
    if (!has_loss_type(o->loss, o->loss_type))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "%s has no loss_type %s", loss_name(o->loss),
                       types[o->loss_type]);
    if (!(o->beta > 0.0 && isfinite(o->beta)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "beta = %g must be finite and > 0", o->beta);
    const int robust = o->loss_type == FH_PREFERENCE_ROBUST; /* divides by 1 - 2 ls */
    if (!(o->label_smoothing >= 0.0 && (robust ? o->label_smoothing < 0.5 : o->label_smoothing <= 0.5)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "label_smoothing = %g must lie in [0, 0.5%s",
                       o->label_smoothing, robust ? ") for robust" : "]");
    if (!isfinite(o->simpo_gamma))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "simpo_gamma = %g must be finite", o->simpo_gamma);
    if (!(o->rpo_alpha >= 0.0 && isfinite(o->rpo_alpha)) || !(o->cpo_alpha >= 0.0 && isfinite(o->cpo_alpha)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "rpo_alpha = %g and cpo_alpha = %g must be finite and >= 0",
                       o->rpo_alpha, o->cpo_alpha);
    return FH_OK;
}

static fh_status check_batch(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *bt,
                             const fh_preference_options *o)
{
    if (!bt)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_preference_batch is NULL");
    if (!bt->targets || !bt->mask)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !bt->targets ? "targets" : "mask");
    if (bt->ref_logps && bt->ref_per_token_logps)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "ref_logps and ref_per_token_logps are both given; pass at most one");
    if ((bt->ref_logps || bt->ref_per_token_logps) && o->loss != FH_PREFERENCE_DPO)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "%s takes no reference log-probs (only dpo does)",
                       loss_name(o->loss));
    int64_t sequences, n;
    if (bt->pairs < 1 || bt->seq < 1 || __builtin_mul_overflow(bt->pairs, 2, &sequences) ||
        __builtin_mul_overflow(sequences, bt->seq, &n) || n != lin->n)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "2 x pairs = %lld x seq = %lld must be >= 1 and equal n = %lld",
                       (long long)bt->pairs, (long long)bt->seq, (long long)lin->n);
    for (int64_t i = 0; i < n; i++) {
        const float m = bt->mask[i];
        if (!(m >= 0.0f && isfinite(m)))
            return fh_fail(ctx, FH_ERR_INVALID_MASK, "mask[%lld] = %g must be finite and >= 0", (long long)i, (double)m);
        if (m != 0.0f && (bt->targets[i] < 0 || bt->targets[i] >= lin->vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE, "targets[%lld] = %lld is outside [0, %lld) at an unmasked position",
                           (long long)i, (long long)bt->targets[i], (long long)lin->vocab);
    }
    /* ORPO's odds are those of exp(the mean log-prob): over no token that mean is undefined (TRL's 0 / 0), and the
     * sum-over-count-clamped-to-1 the other losses use would make p = 1 and the odds infinite. */
    for (int64_t s = 0; o->loss == FH_PREFERENCE_ORPO && s < sequences; s++) {
        double count = 0.0;
        for (int64_t t = 0; t < bt->seq; t++)
            count += bt->mask[s * bt->seq + t];
        if (count == 0.0)
            return fh_fail(ctx, FH_ERR_INVALID_MASK,
                           "orpo: sequence %lld (the %s half of pair %lld) has no unmasked token, so its odds are "
                           "undefined; leave such pairs out of the batch",
                           (long long)s, s < bt->pairs ? "chosen" : "rejected", (long long)(s % bt->pairs));
    }
    return FH_OK;
}

/* No output (out's arrays, grads' gradients when not NULL) overlaps an input, another output or the workspace. */
static fh_status check_apart(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *bt,
                             const float *grad_output, const fh_preference_outputs *out, const fh_linear_grads *grads)
{
    const size_t n = (size_t)lin->n, sequences = 2 * (size_t)bt->pairs;
    const fh_buffer inputs[] = {{"targets", bt->targets, n * sizeof(int64_t)},
                                {"mask", bt->mask, n * sizeof(float)},
                                {"ref_logps", bt->ref_logps, sequences * sizeof(float)},
                                {"ref_per_token_logps", bt->ref_per_token_logps, n * sizeof(float)},
                                {"grad_output", grad_output, sizeof(float)}};
    const fh_buffer outputs[] = {{"loss", out->loss, sizeof(double)},
                                 {"metrics", out->metrics, sizeof(fh_preference_metrics)},
                                 {"sequence_logps", out->sequence_logps, sequences * sizeof(float)},
                                 {"rewards", out->rewards, sequences * sizeof(float)},
                                 {"per_token_logp", out->per_token_logp, n * sizeof(float)}};
    return fh_check_apart(ctx, lin, grads, outputs, 5, inputs, 5);
}

static fh_status check_call(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *bt,
                            const fh_preference_options *o, fh_preference_outputs *out)
{
    fh_status st = fh_check_call(ctx, lin);
    if (st == FH_OK)
        st = check_options(ctx, o);
    if (st == FH_OK)
        st = check_batch(ctx, lin, bt, o);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = check_apart(ctx, lin, bt, NULL, out, NULL);
    return st;
}

/* ---- per-pair math ------------------------------------------------------------------------------- */

/* log sigmoid(x) and sigmoid(x) without overflow. */
static double log_sigmoid(double x)
{
    return x >= 0.0 ? -log1p(exp(-x)) : x - log1p(exp(x));
}

static double sigmoid(double x)
{
    return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

typedef struct pair_result {
    double loss;                 /* the pair's loss, before the mean */
    double d_chosen, d_rejected; /* d loss / d c, d loss / d r */
    double reward_chosen, reward_rejected;
    double log_odds, log_odds_ratio; /* orpo */
} pair_result;

/* Loss of the margin u under TRL's loss_type, and d loss / d u. */
static double margin_loss(const fh_preference_options *o, double u, double *slope)
{
    const double beta = o->beta, ls = o->label_smoothing;
    switch (o->loss_type) {
    case FH_PREFERENCE_HINGE:
        *slope = 1.0 - beta * u > 0.0 ? -beta : 0.0; /* relu's gradient is 0 at 0, as torch's */
        return fmax(1.0 - beta * u, 0.0);
    case FH_PREFERENCE_IPO:
        *slope = 2.0 * (u - 1.0 / (2.0 * beta));
        return (u - 1.0 / (2.0 * beta)) * (u - 1.0 / (2.0 * beta));
    case FH_PREFERENCE_ROBUST:
        *slope = (-(1.0 - ls) * beta * sigmoid(-beta * u) - ls * beta * sigmoid(beta * u)) / (1.0 - 2.0 * ls);
        return (-(1.0 - ls) * log_sigmoid(beta * u) + ls * log_sigmoid(-beta * u)) / (1.0 - 2.0 * ls);
    default:
        *slope = -(1.0 - ls) * beta * sigmoid(-beta * u) + ls * beta * sigmoid(beta * u);
        return -(1.0 - ls) * log_sigmoid(beta * u) - ls * log_sigmoid(-beta * u);
    }
}

static pair_result pair(const fh_preference_options *o, double c, double r, double ref_c, double ref_r)
{
    pair_result p = {0};
    const double beta = o->beta;
    p.reward_chosen = beta * (c - ref_c);
    p.reward_rejected = beta * (r - ref_r);
    p.log_odds = p.log_odds_ratio = NAN;
    double slope;
    switch (o->loss) {
    case FH_PREFERENCE_ORPO: {
        /* log odds(p) = l - log(1 - exp l); d/dl = 1 / (1 - exp l). With D = e^r (1 - e^c) + e^c (1 - e^r),
         * sigmoid(-log_odds) / (1 - e^c) = e^r / D and sigmoid(-log_odds) / (1 - e^r) = e^r (1 - e^c) / ((1 - e^r) D):
         * finite where a mean log-prob reaches 0 (p = 1) on one side, where the quotients above are 0 / 0. */
        p.log_odds = (c - r) - (log(-expm1(c)) - log(-expm1(r)));
        p.log_odds_ratio = log_sigmoid(p.log_odds);
        p.loss = -beta * p.log_odds_ratio;
        const double d = -exp(r) * expm1(c) - exp(c) * expm1(r);
        p.d_chosen = -beta * exp(r) / d;
        p.d_rejected = beta * exp(r) * -expm1(c) / (-expm1(r) * d);
        return p;
    }
    case FH_PREFERENCE_SIMPO: p.loss = margin_loss(o, c - r - o->simpo_gamma / beta, &slope); break;
    case FH_PREFERENCE_CPO: p.loss = margin_loss(o, c - r, &slope); break;
    default: p.loss = margin_loss(o, (c - ref_c) - (r - ref_r), &slope); break;
    }
    p.d_chosen = slope;
    p.d_rejected = -slope;
    return p;
}

/* ---- the head: [2B, T] vectors -> loss, metrics, coefficients ------------------------------------ */

typedef struct head {
    const fh_preference_batch *bt;
    const fh_preference_options *o;
    double *const *slot;
    double chosen_mask; /* sum of m over the chosen half */
} head;

/* Per-sequence counts and the chosen half's mask sum: from the mask alone. */
static void head_count(head *h)
{
    const fh_preference_batch *bt = h->bt;
    double chosen = 0.0;
    for (int64_t s = 0; s < 2 * bt->pairs; s++) {
        double count = 0.0;
        for (int64_t t = 0; t < bt->seq; t++)
            count += bt->mask[s * bt->seq + t];
        if (s < bt->pairs)
            chosen += count;
        h->slot[SLOT_SEQ_COUNT][s] = fmax(count, 1.0);
    }
    h->chosen_mask = chosen;
}

/* logp of rows [i0, i1) from the final statistics (0 where the target is outside [0, vocab)). */
static void token_logps(const head *h, int64_t i0, int64_t i1, int64_t vocab)
{
    double *const *slot = h->slot;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t id = h->bt->targets[i];
        slot[SLOT_LOGP][i] = id >= 0 && id < vocab ? slot[SLOT_Z_TARGET_THEN_A][i] - slot[SLOT_LSE][i] : 0.0;
    }
}

/* l of sequence s (and its reference's) from its tokens' logp. */
static void sequence_logp(const head *h, int64_t s)
{
    const fh_preference_batch *bt = h->bt;
    double *const *slot = h->slot;
    const double scale = averaged(h->o) ? 1.0 / slot[SLOT_SEQ_COUNT][s] : 1.0;
    double l = 0.0, ref = 0.0;
    for (int64_t t = 0; t < bt->seq; t++) {
        const int64_t i = s * bt->seq + t;
        l += bt->mask[i] * slot[SLOT_LOGP][i];
        if (bt->ref_per_token_logps)
            ref += bt->mask[i] * (double)bt->ref_per_token_logps[i];
    }
    slot[SLOT_SEQ_LOGP][s] = l * scale;
    slot[SLOT_SEQ_REF][s] = bt->ref_logps ? (double)bt->ref_logps[s] : ref * scale;
}

static pair_result pair_of(const head *h, int64_t b)
{
    const double *l = h->slot[SLOT_SEQ_LOGP], *ref = h->slot[SLOT_SEQ_REF];
    const int64_t r = h->bt->pairs + b;
    return pair(h->o, l[b], l[r], ref[b], ref[r]);
}

/* Pairs [b0, b1): their tokens' logp (rows from the engine's statistics), sequence log-probs, and g_logp =
 * grad d loss / d logp of each token: the pair's slope spread over the sequence's mask, and on the chosen
 * half the NLL's. */
static void pair_coefficients(const head *h, int64_t b0, int64_t b1, int64_t vocab, double grad)
{
    const fh_preference_batch *bt = h->bt;
    const int64_t B = bt->pairs, T = bt->seq;
    double *const *slot = h->slot;
    const double nll = nll_weight(h->o) / fmax(h->chosen_mask, 1.0);
    for (int64_t half = 0; half < 2; half++) {
        token_logps(h, (half * B + b0) * T, (half * B + b1) * T, vocab);
        for (int64_t b = b0; b < b1; b++)
            sequence_logp(h, half * B + b);
    }
    for (int64_t b = b0; b < b1; b++) {
        const pair_result p = pair_of(h, b);
        for (int64_t half = 0; half < 2; half++) {
            const int64_t s = half * B + b;
            const double scale = averaged(h->o) ? 1.0 / slot[SLOT_SEQ_COUNT][s] : 1.0;
            const double d = (half ? p.d_rejected : p.d_chosen) * scale / (double)B - (half ? 0.0 : nll);
            for (int64_t t = 0; t < T; t++)
                slot[SLOT_G_LOGP_AS_B][s * T + t] = grad * d * bt->mask[s * T + t];
        }
    }
}

/* Loss, metrics and per-sequence outputs from the sequence log-probs of every pair; logits means from sum_z
 * when the metrics are asked for. */
static void head_finish(const head *h, int64_t vocab, fh_preference_outputs *out)
{
    const fh_preference_batch *bt = h->bt;
    const fh_preference_options *o = h->o;
    const int64_t B = bt->pairs, T = bt->seq;
    double *const *slot = h->slot;
    double loss = 0.0, rc = 0.0, rr = 0.0, acc = 0.0, lc = 0.0, lr = 0.0, odds = 0.0, odds_ratio = 0.0;
    for (int64_t b = 0; b < B; b++) {
        const pair_result p = pair_of(h, b);
        loss += p.loss;
        rc += p.reward_chosen;
        rr += p.reward_rejected;
        acc += p.reward_chosen > p.reward_rejected;
        lc += slot[SLOT_SEQ_LOGP][b];
        lr += slot[SLOT_SEQ_LOGP][B + b];
        odds += p.log_odds;
        odds_ratio += p.log_odds_ratio;
        if (out->rewards) {
            out->rewards[b] = (float)p.reward_chosen;
            out->rewards[B + b] = (float)p.reward_rejected;
        }
    }
    double nll_sum = 0.0, z_sum[2] = {0.0, 0.0}, mask_sum[2] = {0.0, 0.0};
    /* Logits means: DPOTrainer's are masked, CPOTrainer's and ORPOTrainer's over every token of the half. */
    const int masked_logits = o->loss == FH_PREFERENCE_DPO;
    for (int64_t i = 0; i < 2 * B * T; i++) {
        const int half = i >= B * T;
        const double m = bt->mask[i], w = masked_logits ? m : 1.0;
        if (!half)
            nll_sum -= m * slot[SLOT_LOGP][i];
        mask_sum[half] += w;
        if (out->metrics)
            z_sum[half] += w * slot[SLOT_SUM_Z][i];
    }
    const double nll = nll_sum / fmax(h->chosen_mask, 1.0);
    if (out->loss)
        *out->loss = loss / (double)B + (nll_weight(o) != 0.0 ? nll_weight(o) * nll : 0.0);
    if (out->metrics) {
        /* TRL: DPOTrainer logs nll_loss only with rpo_alpha; CPOTrainer sets it to 0 when cpo_alpha is 0. */
        const int orpo = o->loss == FH_PREFERENCE_ORPO, dpo = o->loss == FH_PREFERENCE_DPO;
        const double logged_nll = nll_weight(o) != 0.0 ? nll : dpo ? NAN : 0.0;
        /* Means over every vocabulary entry of the tokens above: NaN with no tokens. */
        const fh_preference_metrics m = {rc / B,
                                         rr / B,
                                         acc / B,
                                         (rc - rr) / B,
                                         lc / B,
                                         lr / B,
                                         z_sum[0] / (mask_sum[0] * (double)vocab),
                                         z_sum[1] / (mask_sum[1] * (double)vocab),
                                         logged_nll,
                                         orpo ? odds_ratio / B : NAN,
                                         orpo ? odds / B : NAN};
        *out->metrics = m;
    }
    for (int64_t s = 0; s < 2 * B && out->sequence_logps; s++)
        out->sequence_logps[s] = (float)slot[SLOT_SEQ_LOGP][s];
    for (int64_t i = 0; i < 2 * B * T && out->per_token_logp; i++)
        out->per_token_logp[i] = (float)slot[SLOT_LOGP][i];
}

/* ---- calls ------------------------------------------------------------------------------------------ */

FH_API fh_status fh_preference_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_every_bytes(ctx, lin, bytes);
}

static head head_in(const fh_workspace *ws, const fh_preference_batch *bt, const fh_preference_options *o)
{
    head h = {bt, o, ws->slot, 0.0};
    head_count(&h);
    return h;
}

/* The engine's statistics: sum_z only for the metrics. */
static fh_token_stats stats_in(const fh_workspace *ws, const fh_preference_outputs *out)
{
    double *const *slot = ws->slot;
    const fh_token_stats stats = {slot[SLOT_LSE], slot[SLOT_Z_TARGET_THEN_A], out->metrics ? slot[SLOT_SUM_Z] : NULL,
                                  NULL, slot[SLOT_SUM_EXP_THEN_C], NULL};
    return stats;
}

static fh_engine_pass pass_of(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin,
                              const fh_preference_batch *bt)
{
    const fh_engine_pass p = {.plan = plan, .ws = ws, .lin = lin, .tf = {0.0f, 1.0f}, .targets = bt->targets};
    return p;
}

/* Streams the forward; leaves the statistics, token and sequence log-probs in the workspace. */
static fh_status forward_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const head *h,
                              const fh_preference_outputs *out)
{
    const fh_token_stats stats = stats_in(ws, out);
    fh_engine_pass pass = pass_of(plan, ws, lin, h->bt);
    pass.stats = &stats;
    const fh_status st = fh_engine_forward(&pass);
    if (st == FH_OK) {
        token_logps(h, 0, lin->n, lin->vocab);
        for (int64_t s = 0; s < 2 * h->bt->pairs; s++)
            sequence_logp(h, s);
    }
    return st;
}

FH_API fh_status fh_preference_forward(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *batch,
                                       const fh_preference_options *options, fh_preference_outputs *out)
{
    fh_status st = check_call(ctx, lin, batch, options, out);
    fh_plan plan;
    fh_workspace ws;
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    if (st != FH_OK)
        return st;
    const head h = head_in(&ws, batch, options);
    st = forward_pass(&plan, &ws, lin, &h, out);
    if (st != FH_OK)
        return fh_gemm_failure(ctx, st);
    head_finish(&h, lin->vocab, out);
    return FH_OK;
}

/* The single-call step's hook and rows (self: the head). */
typedef struct pair_blocks {
    const head *h;
    int64_t vocab;
    double grad;
} pair_blocks;

static fh_status block_coefficients(const void *self, int64_t first_row, int64_t rows, const fh_token_stats *stats)
{
    const pair_blocks *s = self;
    const int64_t T = s->h->bt->seq;
    (void)stats; /* the same arrays as the workspace's slots */
    pair_coefficients(s->h, first_row / T, (first_row + rows) / T, s->vocab, s->grad);
    return FH_OK;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    const double g_logp = ((const pair_blocks *)self)->h->slot[SLOT_G_LOGP_AS_B][i];
    k->a = -g_logp; /* dZ_j = g_logp (onehot_j - p_j) */
    k->b = g_logp;
}

static fh_status pair_block_step(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const head *h,
                                 double grad, const fh_linear_grads *grads, fh_preference_outputs *out)
{
    const pair_blocks self = {h, lin->vocab, grad};
    const fh_coef_source source = {row_coefficients, block_coefficients, &self};
    const fh_token_stats stats = stats_in(ws, out);
    fh_engine_pass pass = pass_of(plan, ws, lin, h->bt);
    pass.stats = &stats;
    pass.source = &source;
    pass.grads = grads;
    pass.paired_rows = lin->n / 2;
    return fh_engine_row_blocks(&pass);
}

/* Streaming: the forward, every pair's coefficients, then the engine's backward. */
static fh_status streaming_step(const fh_plan plans[2], const fh_workspace ws[2], const fh_linear *lin,
                                const head *h, double grad, const fh_linear_grads *grads,
                                const fh_preference_outputs *out)
{
    fh_engine_pass pass = pass_of(&plans[1], &ws[1], lin, h->bt);
    pass.grads = grads;
    fh_status st = fh_engine_prepare(&pass);
    if (st == FH_OK)
        st = forward_pass(&plans[0], &ws[0], lin, h, out);
    if (st != FH_OK)
        return st;
    pair_coefficients(h, 0, h->bt->pairs, lin->vocab, grad);
    double *const *slot = ws[1].slot;
    for (int64_t i = 0; i < lin->n; i++) {
        slot[SLOT_Z_TARGET_THEN_A][i] = -slot[SLOT_G_LOGP_AS_B][i];
        slot[SLOT_SUM_EXP_THEN_C][i] = 0.0;
    }
    const fh_coef_arrays coefs = {slot[SLOT_LSE], slot[SLOT_Z_TARGET_THEN_A], slot[SLOT_G_LOGP_AS_B],
                                  slot[SLOT_SUM_EXP_THEN_C], NULL, NULL};
    pass.coefs = &coefs;
    return fh_engine_backward(&pass);
}

/* The call's arguments, for its train step (fh_engine_train_step). */
typedef struct preference_step {
    const fh_linear *lin;
    const fh_preference_batch *batch;
    const fh_preference_options *options;
    double grad;
    fh_preference_outputs *out;
} preference_step;

static fh_status preference_step_run(const void *self, int row_blocks, const fh_plan plans[2],
                                     const fh_workspace ws[2], const fh_linear_grads *grads)
{
    const preference_step *c = self;
    const head h = head_in(&ws[0], c->batch, c->options);
    const fh_status st = row_blocks ? pair_block_step(&plans[0], &ws[0], c->lin, &h, c->grad, grads, c->out)
                                    : streaming_step(plans, ws, c->lin, &h, c->grad, grads, c->out);
    if (st == FH_OK)
        head_finish(&h, c->lin->vocab, c->out);
    return st;
}

FH_API fh_status fh_preference_forward_backward(fh_context *ctx, const fh_linear *lin,
                                                const fh_preference_batch *batch,
                                                const fh_preference_options *options, const float *grad_output,
                                                fh_preference_outputs *out, fh_linear_grads *grads)
{
    fh_status st = check_call(ctx, lin, batch, options, out);
    if (st == FH_OK && !grad_output)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "grad_output is NULL");
    if (st == FH_OK && !isfinite(grad_output[0]))
        st = fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output = %g is not finite", (double)grad_output[0]);
    if (st == FH_OK)
        st = fh_check_grads(ctx, lin, grads);
    if (st == FH_OK)
        st = check_apart(ctx, lin, batch, grad_output, out, grads);
    if (st != FH_OK)
        return st;
    const preference_step step = {lin, batch, options, grad_output[0], out};
    const fh_train_step_head step_head = {2 * batch->seq, NULL, 1, 0, preference_step_run, &step};
    return fh_engine_train_step(ctx, lin, grads, &step_head);
}
