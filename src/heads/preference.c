/* Preference head (DPO, ORPO, SimPO, CPO; TRL semantics, formulas in fusedhead.h): option and batch checks,
 * token log-probs -> sequence log-probs -> per-pair losses, metrics and backward coefficients. The batch is
 * chosen sequences then rejected ones, so pair b's two sequences are rows b T .. and (B + b) T .. (packed: at
 * cu_seqlens[b] and cu_seqlens[B + b]): the
 * single-call step runs the engine's paired row blocks, which hold both, unless a loss type sorts over every pair
 * (aot), which streams. Scalar math on [2B, T] vectors; TRL's current DPO loss types are dpo_loss_types.c's. */
#include "dpo_loss_types.h"
#include "sequences.h"
#include "engine/engine.h"
#include "core/linear.h"

#include <math.h>

/* Workspace slots ([n] per token, or [2B] per sequence). The streaming backward's coefficients a, b and c take the
 * slots of the statistics only the metrics read (SUM_Z, SUM_PZ, ARGMAX), once their totals are taken. */
enum {
    SLOT_LSE,
    SLOT_Z_TARGET,
    SLOT_SUM_EXP,
    SLOT_SUM_Z_THEN_A,  /* sum_j z_j, for the logits metrics */
    SLOT_SUM_PZ_THEN_B, /* sum_j p_j z_j, for the entropy metric */
    SLOT_ARGMAX_THEN_C, /* int64 argmax, for mean_token_accuracy */
    SLOT_SEQ_LOGP,      /* [2B] l */
    SLOT_SEQ_REF,       /* [2B] reference l (dpo), else 0 */
    SLOT_SEQ_D,         /* [2B] grad_output d loss / d (sum_t m logp of the sequence) */
    SLOT_SEQ_ORDER,     /* [2B] int64: aot's sort orders */
    SLOTS
};
_Static_assert(SLOTS <= FH_WORKSPACE_SLOTS, "the plan reserves too few workspace slots");

FH_API fh_status fh_preference_options_init(fh_preference_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_preference_options defaults = {.loss = FH_PREFERENCE_DPO,
                                            .loss_type = FH_PREFERENCE_SIGMOID,
                                            .beta = 0.1,
                                            .simpo_gamma = 0.5,
                                            .cpo_alpha = 1.0,
                                            .dpo_semantics = FH_PREFERENCE_TRL_CURRENT,
                                            .discopop_tau = 0.05};
    *options = defaults;
    return FH_OK;
}

static const char *loss_name(fh_preference_loss loss)
{
    static const char *const names[] = {"dpo", "orpo", "simpo", "cpo"};
    return names[loss];
}

static const char *type_name(fh_preference_loss_type type)
{
    static const char *const names[] = {"sigmoid",  "hinge",    "ipo",          "robust",   "exo_pair",
                                        "nca_pair", "bco_pair", "sppo_hard",    "aot",      "aot_unpaired",
                                        "apo_zero", "apo_down", "discopop",     "sft",      "sigmoid_norm"};
    return names[type];
}

/* Sequence s's first row (s = 2B: n). */
static int64_t row_of(const fh_preference_batch *bt, int64_t s)
{
    return fh_sequence_first(bt->cu_seqlens, bt->seq, s);
}

/* dpo at TRL's current semantics (fusedhead.h); the other losses, and dpo at v0.28, keep their formulas. */
static int current(const fh_preference_options *o)
{
    return o->loss == FH_PREFERENCE_DPO && o->dpo_semantics == FH_PREFERENCE_TRL_CURRENT;
}

/* TRL's loss_type choices of each loss. */
static int has_loss_type(const fh_preference_options *o, fh_preference_loss_type type)
{
    switch (o->loss) {
    case FH_PREFERENCE_DPO: return current(o) || type <= FH_PREFERENCE_ROBUST;
    case FH_PREFERENCE_CPO: return type <= FH_PREFERENCE_IPO;
    default: return type == FH_PREFERENCE_SIGMOID;
    }
}

/* Sequence log-probs are averaged over their tokens (TRL's average_log_prob) for these, else summed (always at
 * TRL's current semantics, whose ipo and sigmoid_norm divide inside their terms). */
static int averaged(const fh_preference_options *o)
{
    return !current(o) &&
           (o->loss == FH_PREFERENCE_SIMPO || o->loss == FH_PREFERENCE_ORPO || o->loss_type == FH_PREFERENCE_IPO);
}

/* The NLL term's weight: the sft entries' (dpo, current), rpo_alpha (dpo, v0.28), cpo_alpha (cpo, simpo), 1 (orpo). */
static double nll_weight(const fh_preference_options *o)
{
    if (current(o))
        return fh_dpo_weight_of(o, FH_PREFERENCE_SFT);
    return o->loss == FH_PREFERENCE_DPO ? o->rpo_alpha : o->loss == FH_PREFERENCE_ORPO ? 1.0 : o->cpo_alpha;
}

/* The options of TRL's current DPO (the list, its weights, rpo_alpha gone, exo_pair's smoothing, discopop's tau),
 * once loss and dpo_semantics are known good. */
static fh_status check_current(fh_context *ctx, const fh_preference_options *o)
{
    for (int k = 0; k < o->loss_type_count; k++)
        if (!isfinite(o->loss_weights[k]))
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "loss_weights[%d] = %g must be finite", k,
                           o->loss_weights[k]);
    if (o->rpo_alpha != 0.0)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "rpo_alpha = %g is TRL v0.28's; at TRL's current semantics list the sft loss type with that "
                       "weight (or set dpo_semantics to FH_PREFERENCE_TRL_0_28)",
                       o->rpo_alpha);
    if (fh_dpo_lists(o, FH_PREFERENCE_EXO_PAIR) && !(o->label_smoothing > 0.0))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "exo_pair needs label_smoothing > 0 (its log(label_smoothing)), got %g", o->label_smoothing);
    if (fh_dpo_lists(o, FH_PREFERENCE_DISCOPOP) && !(o->discopop_tau > 0.0 && isfinite(o->discopop_tau)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "discopop_tau = %g must be finite and > 0",
                       o->discopop_tau);
    return FH_OK;
}

static fh_status check_options(fh_context *ctx, const fh_preference_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if ((unsigned)o->loss > FH_PREFERENCE_CPO)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "loss = %d is not one of dpo (0) .. cpo (3)",
                       (int)o->loss);
    if ((unsigned)o->dpo_semantics > FH_PREFERENCE_TRL_0_28)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "dpo_semantics = %d is neither FH_PREFERENCE_TRL_CURRENT (0) nor FH_PREFERENCE_TRL_0_28 (1)",
                       (int)o->dpo_semantics);
    if (o->loss_type_count < 0 || o->loss_type_count > FH_PREFERENCE_MAX_LOSS_TYPES ||
        (o->loss_type_count > 0 && !current(o)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "loss_type_count = %d: a list of 1 .. %d loss types is dpo's at TRL's current semantics; "
                       "0 uses loss_type",
                       o->loss_type_count, FH_PREFERENCE_MAX_LOSS_TYPES);
    for (int k = 0; k < fh_dpo_type_count(o); k++) {
        const fh_preference_loss_type type = fh_dpo_type(o, k);
        if ((unsigned)type > FH_PREFERENCE_SIGMOID_NORM && o->loss_type_count)
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                           "loss_types[%d] = %d is not one of sigmoid (0) .. sigmoid_norm (14)", k, (int)type);
        if ((unsigned)type > FH_PREFERENCE_SIGMOID_NORM)
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                           "loss_type = %d is not one of sigmoid (0) .. sigmoid_norm (14)", (int)type);
        if (!has_loss_type(o, type))
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "%s%s has no loss_type %s", loss_name(o->loss),
                           o->loss == FH_PREFERENCE_DPO ? " at TRL v0.28's semantics" : "", type_name(type));
    }
    if (!(o->beta > 0.0 && isfinite(o->beta)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "beta = %g must be finite and > 0", o->beta);
    const int robust = fh_dpo_lists(o, FH_PREFERENCE_ROBUST); /* divides by 1 - 2 ls */
    if (!(o->label_smoothing >= 0.0 && (robust ? o->label_smoothing < 0.5 : o->label_smoothing <= 0.5)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "label_smoothing = %g must lie in [0, 0.5%s",
                       o->label_smoothing, robust ? ") for robust" : "]");
    if (!isfinite(o->simpo_gamma))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "simpo_gamma = %g must be finite", o->simpo_gamma);
    if (!(o->rpo_alpha >= 0.0 && isfinite(o->rpo_alpha)) || !(o->cpo_alpha >= 0.0 && isfinite(o->cpo_alpha)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "rpo_alpha = %g and cpo_alpha = %g must be finite and >= 0",
                       o->rpo_alpha, o->cpo_alpha);
    if (o->use_weighting)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "use_weighting (TRL's WPO weights) is not implemented: they need log sum_j p_j^2 of every "
                       "token, a statistic the engine does not fold");
    return current(o) ? check_current(ctx, o) : FH_OK;
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
    const fh_status st = fh_check_sequence_rows(ctx, lin, "2 x pairs", bt->pairs, 2, bt->seq, bt->cu_seqlens);
    if (st != FH_OK)
        return st;
    const int64_t sequences = 2 * bt->pairs;
    for (int64_t i = 0; i < lin->n; i++) {
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
        for (int64_t i = row_of(bt, s); i < row_of(bt, s + 1); i++)
            count += bt->mask[i];
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
                                {"cu_seqlens", bt->cu_seqlens, (sequences + 1) * sizeof(int64_t)},
                                {"grad_output", grad_output, sizeof(float)}};
    const fh_buffer outputs[] = {{"loss", out->loss, sizeof(double)},
                                 {"metrics", out->metrics, sizeof(fh_preference_metrics)},
                                 {"sequence_logps", out->sequence_logps, sequences * sizeof(float)},
                                 {"rewards", out->rewards, sequences * sizeof(float)},
                                 {"per_token_logp", out->per_token_logp, n * sizeof(float)}};
    return fh_check_apart(ctx, lin, grads, outputs, 5, inputs, 6);
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

typedef struct pair_result {
    double loss;                 /* the pair's loss, before the mean (without aot's and the NLL's terms) */
    double d_chosen, d_rejected; /* d loss / d (sum_t m logp) of the chosen and rejected sequences */
    double reward_chosen, reward_rejected;
    double log_odds, log_odds_ratio; /* orpo */
} pair_result;

/* Loss of the margin u under TRL v0.28's loss_type (dpo, cpo, simpo), and d loss / d u. */
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
        *slope = (-(1.0 - ls) * beta * fh_sigmoid(-beta * u) - ls * beta * fh_sigmoid(beta * u)) / (1.0 - 2.0 * ls);
        return (-(1.0 - ls) * fh_log_sigmoid(beta * u) + ls * fh_log_sigmoid(-beta * u)) / (1.0 - 2.0 * ls);
    default:
        *slope = -(1.0 - ls) * beta * fh_sigmoid(-beta * u) + ls * beta * fh_sigmoid(beta * u);
        return -(1.0 - ls) * fh_log_sigmoid(beta * u) - ls * fh_log_sigmoid(-beta * u);
    }
}

/* Pair b of l and ref (averaged or summed as the options say) with token counts n_c, n_r. */
static pair_result pair(const fh_preference_options *o, double c, double r, double ref_c, double ref_r, double n_c,
                        double n_r)
{
    pair_result p = {0};
    const double beta = o->beta;
    p.reward_chosen = beta * (c - ref_c);
    p.reward_rejected = beta * (r - ref_r);
    p.log_odds = p.log_odds_ratio = NAN;
    if (current(o)) {
        const fh_dpo_pair v = {c, r, ref_c, ref_r, n_c, n_r};
        p.loss = fh_dpo_pair_terms(o, &v, &p.d_chosen, &p.d_rejected);
        return p;
    }
    double slope;
    switch (o->loss) {
    case FH_PREFERENCE_ORPO: {
        /* log odds(p) = l - log(1 - exp l); d/dl = 1 / (1 - exp l). With D = e^r (1 - e^c) + e^c (1 - e^r),
         * sigmoid(-log_odds) / (1 - e^c) = e^r / D and sigmoid(-log_odds) / (1 - e^r) = e^r (1 - e^c) / ((1 - e^r) D):
         * finite where a mean log-prob reaches 0 (p = 1) on one side, where the quotients above are 0 / 0. */
        p.log_odds = (c - r) - (log(-expm1(c)) - log(-expm1(r)));
        p.log_odds_ratio = fh_log_sigmoid(p.log_odds);
        p.loss = -beta * p.log_odds_ratio;
        const double d = -exp(r) * expm1(c) - exp(c) * expm1(r);
        p.d_chosen = -beta * exp(r) / d / n_c;
        p.d_rejected = beta * exp(r) * -expm1(c) / (-expm1(r) * d) / n_r;
        return p;
    }
    case FH_PREFERENCE_SIMPO: p.loss = margin_loss(o, c - r - o->simpo_gamma / beta, &slope); break;
    case FH_PREFERENCE_CPO: p.loss = margin_loss(o, c - r, &slope); break;
    default: p.loss = margin_loss(o, (c - ref_c) - (r - ref_r), &slope); break;
    }
    p.d_chosen = slope / (averaged(o) ? n_c : 1.0);
    p.d_rejected = -slope / (averaged(o) ? n_r : 1.0);
    return p;
}

/* ---- the head: [2B, T] vectors -> loss, metrics, coefficients ------------------------------------ */

/* The call's sums over tokens, taken once the statistics are final and before the streaming backward reuses their
 * slots: NLL, and for the metrics the logits' (per half), the entropies' and the chosen half's correct argmaxes. */
typedef struct token_totals {
    double nll, z[2], z_weight[2], entropy, mask, correct;
} token_totals;

typedef struct head {
    const fh_preference_batch *bt;
    const fh_preference_options *o;
    double *const *slot;
    int64_t vocab;
    int metrics;        /* the engine folds sum_z (and, at current semantics, sum_pz and argmax) */
    double chosen_mask; /* sum of m over the chosen half */
    double nll_coef;    /* grad_output nll_weight / max(chosen_mask, 1) */
    token_totals totals;
} head;

static double sequence_count(const head *h, int64_t s)
{
    double count = 0.0;
    for (int64_t i = row_of(h->bt, s); i < row_of(h->bt, s + 1); i++)
        count += h->bt->mask[i];
    return fmax(count, 1.0);
}

/* logp of row i from the final statistics (0 where the target is outside [0, vocab)). */
static double token_logp(const head *h, int64_t i)
{
    const int64_t id = h->bt->targets[i];
    return id >= 0 && id < h->vocab ? h->slot[SLOT_Z_TARGET][i] - h->slot[SLOT_LSE][i] : 0.0;
}

/* l of sequence s (and its reference's) from its tokens' logp. */
static void sequence_logp(const head *h, int64_t s)
{
    const fh_preference_batch *bt = h->bt;
    double *const *slot = h->slot;
    const double scale = averaged(h->o) ? 1.0 / sequence_count(h, s) : 1.0;
    double l = 0.0, ref = 0.0;
    for (int64_t i = row_of(bt, s); i < row_of(bt, s + 1); i++) {
        l += bt->mask[i] * token_logp(h, i);
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
    return pair(h->o, l[b], l[r], ref[b], ref[r], sequence_count(h, b), sequence_count(h, r));
}

/* aot's and aot_unpaired's terms over every pair (their sum over sorted positions), adding grad times their
 * gradient over the mean to SLOT_SEQ_D when with_gradient. */
static double sorted_terms(const head *h, double grad, int with_gradient)
{
    if (!current(h->o) || !(fh_dpo_lists(h->o, FH_PREFERENCE_AOT) || fh_dpo_lists(h->o, FH_PREFERENCE_AOT_UNPAIRED)))
        return 0.0;
    const int64_t B = h->bt->pairs;
    return fh_dpo_sorted_terms(h->o, B, h->slot[SLOT_SEQ_LOGP], h->slot[SLOT_SEQ_REF],
                               (int64_t *)h->slot[SLOT_SEQ_ORDER], grad / (double)B,
                               with_gradient ? h->slot[SLOT_SEQ_D] : NULL);
}

/* Pairs [b0, b1) whose rows' statistics are final: their sequence log-probs, and grad times their own terms'
 * gradient over the mean in SLOT_SEQ_D. */
static void pair_coefficients(const head *h, int64_t b0, int64_t b1, double grad)
{
    const int64_t B = h->bt->pairs;
    for (int64_t half = 0; half < 2; half++)
        for (int64_t b = b0; b < b1; b++)
            sequence_logp(h, half * B + b);
    for (int64_t b = b0; b < b1; b++) {
        const pair_result p = pair_of(h, b);
        h->slot[SLOT_SEQ_D][b] = grad * p.d_chosen / (double)B;
        h->slot[SLOT_SEQ_D][B + b] = grad * p.d_rejected / (double)B;
    }
}

/* g_logp of row i = grad d loss / d logp_i: its sequence's share, and on the chosen half the NLL's. */
static double token_gradient(const head *h, int64_t i)
{
    const int64_t s = fh_sequence_of_row(h->bt->cu_seqlens, h->bt->seq, 2 * h->bt->pairs, i);
    return h->bt->mask[i] * (h->slot[SLOT_SEQ_D][s] - (s < h->bt->pairs ? h->nll_coef : 0.0));
}

/* The token totals, from the final statistics of every row. */
static void take_totals(head *h)
{
    const fh_preference_batch *bt = h->bt;
    const int64_t rejected = row_of(bt, bt->pairs), n = row_of(bt, 2 * bt->pairs);
    double *const *slot = h->slot;
    const int64_t *argmax = (const int64_t *)slot[SLOT_ARGMAX_THEN_C];
    /* Logits means: DPOTrainer's are masked, CPOTrainer's and ORPOTrainer's over every token of the half. */
    const int masked_logits = h->o->loss == FH_PREFERENCE_DPO, token_metrics = h->metrics && current(h->o);
    token_totals t = {0};
    for (int64_t i = 0; i < n; i++) {
        const int half = i >= rejected;
        const double m = bt->mask[i], w = masked_logits ? m : 1.0;
        if (!half)
            t.nll -= m * token_logp(h, i);
        t.z_weight[half] += w;
        if (h->metrics)
            t.z[half] += w * slot[SLOT_SUM_Z_THEN_A][i];
        if (token_metrics) {
            t.entropy += m * (slot[SLOT_LSE][i] - slot[SLOT_SUM_PZ_THEN_B][i]);
            t.mask += m;
            t.correct += !half && argmax[i] == bt->targets[i] ? m : 0.0;
        }
    }
    h->totals = t;
}

/* Loss, metrics and per-sequence outputs from the sequence log-probs of every pair and the totals. */
static void head_finish(const head *h, fh_preference_outputs *out)
{
    const fh_preference_batch *bt = h->bt;
    const fh_preference_options *o = h->o;
    const int64_t B = bt->pairs, n = row_of(bt, 2 * B);
    double *const *slot = h->slot;
    double loss = sorted_terms(h, 0.0, 0), rc = 0.0, rr = 0.0, acc = 0.0, lc = 0.0, lr = 0.0, odds = 0.0,
           odds_ratio = 0.0;
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
    const token_totals *t = &h->totals;
    const double nll = t->nll / fmax(h->chosen_mask, 1.0);
    if (out->loss)
        *out->loss = loss / (double)B + (nll_weight(o) != 0.0 ? nll_weight(o) * nll : 0.0);
    if (out->metrics) {
        /* TRL: DPOTrainer v0.28 logs nll_loss only with rpo_alpha, the current one never; CPOTrainer sets it to 0
         * when cpo_alpha is 0. The current DPOTrainer logs 0 for means over no token. */
        const int orpo = o->loss == FH_PREFERENCE_ORPO, dpo = o->loss == FH_PREFERENCE_DPO, now = current(o);
        const double logged_nll = now ? NAN : nll_weight(o) != 0.0 ? nll : dpo ? NAN : 0.0;
        double logits[2];
        for (int half = 0; half < 2; half++) /* over every vocabulary entry of the tokens: NaN with no tokens */
            logits[half] = now && t->z_weight[half] == 0.0 ? 0.0 : t->z[half] / (t->z_weight[half] * (double)h->vocab);
        const fh_preference_metrics m = {rc / B,
                                         rr / B,
                                         acc / B,
                                         (rc - rr) / B,
                                         lc / B,
                                         lr / B,
                                         logits[0],
                                         logits[1],
                                         logged_nll,
                                         orpo ? odds_ratio / B : NAN,
                                         orpo ? odds / B : NAN,
                                         !now ? NAN : t->mask > 0.0 ? t->entropy / t->mask : 0.0,
                                         !now ? NAN : h->chosen_mask > 0.0 ? t->correct / h->chosen_mask : 0.0};
        *out->metrics = m;
    }
    for (int64_t s = 0; s < 2 * B && out->sequence_logps; s++)
        out->sequence_logps[s] = (float)slot[SLOT_SEQ_LOGP][s];
    for (int64_t i = 0; i < n && out->per_token_logp; i++)
        out->per_token_logp[i] = (float)token_logp(h, i);
}

/* ---- calls ------------------------------------------------------------------------------------------ */

FH_API fh_status fh_preference_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_every_bytes(ctx, lin, bytes);
}

/* One call's head over whole sequences (sequences.h): the arguments, and the head over the workspace from begin. */
typedef struct preference_call {
    const fh_linear *lin;
    const fh_preference_batch *batch;
    const fh_preference_options *options;
    fh_preference_outputs *out;
    head h;
} preference_call;

static void begin(void *state, const fh_workspace *ws, double grad)
{
    preference_call *c = state;
    const fh_preference_batch *bt = c->batch;
    head h = {.bt = bt, .o = c->options, .slot = ws->slot, .vocab = c->lin->vocab, .metrics = c->out->metrics != NULL};
    for (int64_t i = 0; i < row_of(bt, bt->pairs); i++)
        h.chosen_mask += bt->mask[i];
    h.nll_coef = grad * nll_weight(c->options) / fmax(h.chosen_mask, 1.0);
    c->h = h;
}

/* The engine's statistics: sum_z for the metrics, sum_pz and argmax for the current DPOTrainer's. */
static fh_token_stats stats_of(const void *state)
{
    const head *h = &((const preference_call *)state)->h;
    double *const *slot = h->slot;
    const int token_metrics = h->metrics && current(h->o);
    const fh_token_stats stats = {slot[SLOT_LSE],
                                  slot[SLOT_Z_TARGET],
                                  h->metrics ? slot[SLOT_SUM_Z_THEN_A] : NULL,
                                  token_metrics ? slot[SLOT_SUM_PZ_THEN_B] : NULL,
                                  slot[SLOT_SUM_EXP],
                                  token_metrics ? (int64_t *)slot[SLOT_ARGMAX_THEN_C] : NULL};
    return stats;
}

static fh_engine_pass pass_of(const void *state, const fh_plan *plan, const fh_workspace *ws)
{
    const preference_call *c = state;
    const fh_engine_pass p = {
        .plan = plan, .ws = ws, .lin = c->lin, .tf = FH_IDENTITY_TRANSFORM, .targets = c->batch->targets};
    return p;
}

/* Every sequence's log-prob, and the token totals. */
static void after_forward(void *state)
{
    head *h = &((preference_call *)state)->h;
    for (int64_t s = 0; s < 2 * h->bt->pairs; s++)
        sequence_logp(h, s);
    take_totals(h);
}

/* Row blocks of whole pairs: the chosen sequences' rows are the first segment, so its sequences are the pairs. */
static void block_pairs(void *state, int64_t b0, int64_t b1, double grad)
{
    pair_coefficients(&((const preference_call *)state)->h, b0, b1, grad);
}

static void row_coefficients(const void *state, int64_t i, fh_coef *k)
{
    const double g_logp = token_gradient(&((const preference_call *)state)->h, i);
    k->a = -g_logp; /* dZ_j = g_logp (onehot_j - p_j) */
    k->b = g_logp;
}

static void after_blocks(void *state)
{
    take_totals(&((preference_call *)state)->h);
}

/* Every pair's coefficients (aot's need them all), then each row's. */
static fh_coef_arrays streaming_coefs(void *state, const fh_workspace *ws, double grad)
{
    const preference_call *c = state;
    const head *h = &c->h;
    pair_coefficients(h, 0, h->bt->pairs, grad);
    sorted_terms(h, grad, 1);
    double *const *slot = ws->slot;
    for (int64_t i = 0; i < c->lin->n; i++) {
        const double g_logp = token_gradient(h, i);
        slot[SLOT_SUM_Z_THEN_A][i] = -g_logp;
        slot[SLOT_SUM_PZ_THEN_B][i] = g_logp;
        slot[SLOT_ARGMAX_THEN_C][i] = 0.0;
    }
    const fh_coef_arrays coefs = {slot[SLOT_LSE], slot[SLOT_SUM_Z_THEN_A], slot[SLOT_SUM_PZ_THEN_B],
                                  slot[SLOT_ARGMAX_THEN_C], NULL, NULL};
    return coefs;
}

static void finish(const void *state)
{
    const preference_call *c = state;
    head_finish(&c->h, c->out);
}

static fh_sequence_head sequence_head(preference_call *c)
{
    const fh_preference_options *o = c->options;
    /* aot and aot_unpaired sort every pair's values before any coefficient: the streaming passes. */
    const int sorts =
        current(o) && (fh_dpo_lists(o, FH_PREFERENCE_AOT) || fh_dpo_lists(o, FH_PREFERENCE_AOT_UNPAIRED));
    const fh_sequence_head hd = {.groups = fh_sequence_groups(c->batch->pairs, c->batch->seq, c->batch->cu_seqlens, 1),
                                 .streaming_only = sorts,
                                 .state = c,
                                 .begin = begin,
                                 .pass = pass_of,
                                 .stats = stats_of,
                                 .after_forward = after_forward,
                                 .sequences = block_pairs,
                                 .row = row_coefficients,
                                 .after_blocks = after_blocks,
                                 .streaming_coefs = streaming_coefs,
                                 .finish = finish};
    return hd;
}

FH_API fh_status fh_preference_forward(fh_context *ctx, const fh_linear *lin, const fh_preference_batch *batch,
                                       const fh_preference_options *options, fh_preference_outputs *out)
{
    const fh_status st = check_call(ctx, lin, batch, options, out);
    if (st != FH_OK)
        return st;
    preference_call c = {lin, batch, options, out, {0}};
    const fh_sequence_head hd = sequence_head(&c);
    return fh_sequence_forward(ctx, lin, &hd);
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
    preference_call c = {lin, batch, options, out, {0}};
    const fh_sequence_head hd = sequence_head(&c);
    return fh_sequence_train_step(ctx, lin, grads, &hd, grad_output[0]);
}
