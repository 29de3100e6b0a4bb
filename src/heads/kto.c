/* KTO head (TRL's KTOTrainer, loss types kto and apo_zero_unpaired; formulas in fusedhead.h): option and batch
 * checks, the log-prob head's token values (logprob_head.h) -> sequence log-probs -> per-sequence losses, metrics
 * and backward coefficients (the pieces of kto_head.h, which src/mpi/ drives too), then the two calls. The KL term is
 * an input, so each sequence's loss depends on its own tokens only: the single-call step runs the engine's row
 * blocks of whole sequences, as GRPO's. */
#include "grpo_head.h" /* fh_grpo_check_grad_output */
#include "kto_head.h"
#include "sequences.h"
#include "core/linear.h"
#include "sigmoid.h"

#include <math.h>
#include <string.h>

FH_API fh_status fh_kto_options_init(fh_kto_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_kto_options defaults = {FH_KTO_LOSS_KTO, 0.1, 1.0, 1.0};
    *options = defaults;
    return FH_OK;
}

static fh_status check_options(fh_context *ctx, const fh_kto_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if ((unsigned)o->loss_type > FH_KTO_LOSS_APO_ZERO_UNPAIRED)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "kto loss_type = %d is not kto (0) or apo_zero_unpaired (1)", (int)o->loss_type);
    if (!(o->beta > 0.0 && isfinite(o->beta)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "kto beta = %g must be finite and > 0", o->beta);
    if (!(o->desirable_weight >= 0.0 && isfinite(o->desirable_weight)) ||
        !(o->undesirable_weight >= 0.0 && isfinite(o->undesirable_weight)))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "desirable_weight = %g and undesirable_weight = %g must be finite and >= 0",
                       o->desirable_weight, o->undesirable_weight);
    return FH_OK;
}

/* The KL inputs: exactly one for kto (finite; the scalar >= 0, as TRL clamps it), none for apo_zero_unpaired (TRL
 * does not compute the term then). */
static fh_status check_kl(fh_context *ctx, const fh_kto_batch *bt, const fh_kto_options *o)
{
    const int given = (bt->kl != NULL) + (bt->kl_logratios != NULL);
    if (o->loss_type == FH_KTO_LOSS_APO_ZERO_UNPAIRED)
        return given ? fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                               "apo_zero_unpaired has no KL term: pass neither kl nor kl_logratios")
                     : FH_OK;
    if (given != 1)
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "kto needs exactly one of kl and kl_logratios (%s given)",
                       given ? "both" : "neither");
    if (bt->kl && !(bt->kl[0] >= 0.0f && isfinite(bt->kl[0])))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "kl = %g must be finite and >= 0 (TRL clamps it at 0)",
                       (double)bt->kl[0]);
    for (int64_t s = 0; bt->kl_logratios && s < bt->batch; s++)
        if (!isfinite(bt->kl_logratios[s]))
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "kl_logratios[%lld] = %g is not finite",
                           (long long)s, (double)bt->kl_logratios[s]);
    return FH_OK;
}

static fh_status check_batch(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *bt, const fh_kto_options *o,
                             int64_t target_vocab)
{
    if (!bt)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_kto_batch is NULL");
    if (!bt->targets || !bt->mask || !bt->labels)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL",
                       !bt->targets ? "targets" : !bt->mask ? "mask" : "labels");
    if ((bt->ref_logps != NULL) == (bt->ref_per_token_logps != NULL))
        return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION,
                       "kto needs exactly one of ref_logps and ref_per_token_logps (%s given; TRL's KTO has no "
                       "reference-free mode)",
                       bt->ref_logps ? "both" : "neither");
    const int64_t n = lin->n;
    const fh_status st = fh_check_sequence_rows(ctx, lin, "batch", bt->batch, 1, bt->seq, bt->cu_seqlens);
    if (st != FH_OK)
        return st;
    for (int64_t s = 0; s < bt->batch; s++)
        if (bt->labels[s] > 1)
            return fh_fail(ctx, FH_ERR_INVALID_PREFERENCE_OPTION, "labels[%lld] = %d must be 0 (undesirable) or 1",
                           (long long)s, (int)bt->labels[s]);
    for (int64_t i = 0; i < n; i++) {
        const float m = bt->mask[i];
        if (!(m >= 0.0f && isfinite(m)))
            return fh_fail(ctx, FH_ERR_INVALID_MASK, "mask[%lld] = %g must be finite and >= 0", (long long)i, (double)m);
        if (m != 0.0f && (bt->targets[i] < 0 || bt->targets[i] >= target_vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                           "targets[%lld] = %lld is outside [0, %lld) at an unmasked position", (long long)i,
                           (long long)bt->targets[i], (long long)target_vocab);
    }
    return check_kl(ctx, bt, o);
}

fh_status fh_kto_check_apart(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *bt, const float *grad_output,
                             const fh_kto_outputs *out, const fh_linear_grads *grads)
{
    const size_t n = (size_t)lin->n, B = (size_t)bt->batch;
    const fh_buffer inputs[] = {{"targets", bt->targets, n * sizeof(int64_t)},
                                {"mask", bt->mask, n * sizeof(float)},
                                {"labels", bt->labels, B},
                                {"ref_logps", bt->ref_logps, B * sizeof(float)},
                                {"ref_per_token_logps", bt->ref_per_token_logps, n * sizeof(float)},
                                {"kl", bt->kl, sizeof(float)},
                                {"kl_logratios", bt->kl_logratios, B * sizeof(float)},
                                {"cu_seqlens", bt->cu_seqlens, (B + 1) * sizeof(int64_t)},
                                {"grad_output", grad_output, sizeof(float)}};
    const fh_buffer outputs[] = {{"loss", out->loss, sizeof(double)},
                                 {"metrics", out->metrics, sizeof(fh_kto_metrics)},
                                 {"sequence_logps", out->sequence_logps, B * sizeof(float)},
                                 {"rewards", out->rewards, B * sizeof(float)},
                                 {"per_token_logp", out->per_token_logp, n * sizeof(float)}};
    return fh_check_apart(ctx, lin, grads, outputs, 5, inputs, 9);
}

fh_status fh_kto_check_call(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *bt, const fh_kto_options *o,
                            const fh_kto_outputs *out, int64_t target_vocab)
{
    fh_status st = fh_check_call(ctx, lin);
    if (st == FH_OK)
        st = check_options(ctx, o);
    if (st == FH_OK)
        st = check_batch(ctx, lin, bt, o, target_vocab > 0 ? target_vocab : lin->vocab);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = fh_kto_check_apart(ctx, lin, bt, NULL, out, NULL);
    return st;
}

/* ---- the head: [B, T] vectors -> loss, metrics, coefficients ------------------------------------- */

fh_kto_head fh_kto_head_in(const fh_workspace *ws, const fh_kto_batch *bt, const fh_kto_options *o, int64_t vocab)
{
    fh_kto_head h = {bt, o, ws, vocab, 0.0, 0.0};
    double sums[2];
    fh_kto_head_sums(&h, sums);
    fh_kto_head_set_totals(&h, sums);
    return h;
}

void fh_kto_head_sums(const fh_kto_head *h, double sums[2])
{
    sums[0] = 0.0;
    for (int64_t s = 0; h->bt->kl_logratios && s < h->bt->batch; s++)
        sums[0] += h->bt->kl_logratios[s];
    sums[1] = (double)h->bt->batch;
}

/* TRL's kl: the given value, or mean(kl_logratios).clamp(min=0) over the whole batch; 0 for apo_zero_unpaired. */
void fh_kto_head_set_totals(fh_kto_head *h, const double sums[2])
{
    h->batch_total = sums[1];
    h->kl = h->bt->kl ? (double)h->bt->kl[0] : h->bt->kl_logratios ? fmax(sums[0] / sums[1], 0.0) : 0.0;
}

/* Sequence s's first row (s = B: n). */
static int64_t row_of(const fh_kto_batch *bt, int64_t s)
{
    return fh_sequence_first(bt->cu_seqlens, bt->seq, s);
}

/* r_s = l_s - ref_s of sequence s from its tokens' logp (in the LOGP slot); l_s into the SEQ_LOGP slot. */
static double log_ratio(const fh_kto_head *h, int64_t s)
{
    const fh_kto_batch *bt = h->bt;
    const double *logp = h->ws->slot[FH_LOGPROB_SLOT_LOGP];
    double l = 0.0, ref = 0.0;
    for (int64_t i = row_of(bt, s); i < row_of(bt, s + 1); i++) {
        l += bt->mask[i] * logp[i];
        if (bt->ref_per_token_logps)
            ref += bt->mask[i] * (double)bt->ref_per_token_logps[i];
    }
    h->ws->slot[FH_KTO_SLOT_SEQ_LOGP][s] = l;
    return l - (bt->ref_logps ? (double)bt->ref_logps[s] : ref);
}

/* Sequence s's weighted loss w_s L_s, and d (w_s L_s) / d r_s in *slope. */
static double sequence_loss(const fh_kto_head *h, int64_t s, double r, double *slope)
{
    const fh_kto_options *o = h->o;
    const int desirable = h->bt->labels[s] != 0;
    const double w = desirable ? o->desirable_weight : o->undesirable_weight, beta = o->beta;
    /* d sig(x) / dx = sig(x) sig(-x). kto: L = 1 - sig(+-beta (r - kl)); apo: 1 - sig(beta r) or sig(beta r). */
    const double x = beta * (o->loss_type == FH_KTO_LOSS_KTO ? r - h->kl : r);
    if (desirable) {
        *slope = -w * beta * fh_sigmoid(x) * fh_sigmoid(-x);
        return w * fh_sigmoid(-x);
    }
    *slope = w * beta * fh_sigmoid(x) * fh_sigmoid(-x);
    return w * fh_sigmoid(x); /* kto: 1 - sig(beta (kl - r)) = sig(beta (r - kl)) */
}

void fh_kto_sequence_coefficients(const fh_kto_head *h, int64_t s0, int64_t s1, double grad)
{
    const fh_kto_batch *bt = h->bt;
    double *g_logp = h->ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B];
    fh_logprob_token_values(h->ws, bt->targets, row_of(bt, s0), row_of(bt, s1), h->vocab, 0);
    for (int64_t s = s0; s < s1; s++) {
        double slope;
        (void)sequence_loss(h, s, log_ratio(h, s), &slope);
        const double d = grad * slope / h->batch_total;
        for (int64_t i = row_of(bt, s); i < row_of(bt, s + 1); i++)
            g_logp[i] = d * bt->mask[i];
    }
}

void fh_kto_row_coefficients(const fh_workspace *ws, int64_t i, fh_coef *k)
{
    const double g_logp = ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B][i];
    k->a = -g_logp;
    k->b = g_logp;
    k->c = 0.0;
    k->e = 0.0;
}

fh_coef_arrays fh_kto_coefs_in(const fh_workspace *ws, int64_t n)
{
    double *const *slot = ws->slot;
    /* z_target and sum_exp are read by now: they take a and c. */
    for (int64_t i = 0; i < n; i++) {
        slot[FH_LOGPROB_SLOT_Z_TARGET_THEN_A][i] = -slot[FH_LOGPROB_SLOT_G_LOGP_AS_B][i];
        slot[FH_LOGPROB_SLOT_SUM_EXP_THEN_C][i] = 0.0;
    }
    const fh_coef_arrays coefs = {slot[FH_LOGPROB_SLOT_LSE], slot[FH_LOGPROB_SLOT_Z_TARGET_THEN_A],
                                  slot[FH_LOGPROB_SLOT_G_LOGP_AS_B], slot[FH_LOGPROB_SLOT_SUM_EXP_THEN_C], NULL, NULL};
    return coefs;
}

void fh_kto_head_partials(const fh_kto_head *h, int metrics, fh_kto_partials *p, fh_kto_outputs *out)
{
    const fh_kto_batch *bt = h->bt;
    const int64_t B = bt->batch, n = row_of(bt, B);
    double *const *slot = h->ws->slot;
    memset(p, 0, sizeof *p);
    for (int64_t s = 0; s < B; s++) {
        const double r = log_ratio(h, s), reward = h->o->beta * r;
        double slope;
        const int half = bt->labels[s] ? 0 : 1; /* 0: chosen (desirable), 1: rejected */
        p->loss += sequence_loss(h, s, r, &slope);
        p->count[half] += 1.0;
        p->rewards[half] += reward;
        p->logps[half] += slot[FH_KTO_SLOT_SEQ_LOGP][s];
        if (out->rewards)
            out->rewards[s] = (float)reward;
        if (out->sequence_logps)
            out->sequence_logps[s] = (float)slot[FH_KTO_SLOT_SEQ_LOGP][s];
    }
    /* KTOTrainer._compute_loss: logits/<half> = (sum over the half's tokens with m != 0 of mean_j z) / sum of the
     * half's m; entropy = sum m H / sum m. */
    for (int64_t s = 0; metrics && s < B; s++)
        for (int64_t i = row_of(bt, s); i < row_of(bt, s + 1); i++) {
            const double m = bt->mask[i];
            const int half = bt->labels[s] ? 0 : 1;
            p->mask_sum[half] += m;
            p->entropy_sum += m * slot[FH_LOGPROB_SLOT_ENTROPY][i];
            if (m != 0.0)
                p->z_sum[half] += slot[FH_KTO_SLOT_SUM_Z][i] / (double)h->vocab;
        }
    for (int64_t i = 0; i < n && out->per_token_logp; i++)
        out->per_token_logp[i] = (float)slot[FH_LOGPROB_SLOT_LOGP][i];
}

void fh_kto_head_finish(const fh_kto_head *h, const fh_kto_partials *p, fh_kto_outputs *out)
{
    if (out->loss)
        *out->loss = p->loss / h->batch_total;
    if (!out->metrics)
        return;
    /* NaN where TRL logs nothing: no sequence (or no token) of a kind; the entropy is 0 without tokens. */
    const double tokens = p->mask_sum[0] + p->mask_sum[1];
    fh_kto_metrics m = {h->kl,
                        p->count[0] > 0.0 ? p->rewards[0] / p->count[0] : NAN,
                        p->count[1] > 0.0 ? p->rewards[1] / p->count[1] : NAN,
                        NAN,
                        p->count[0] > 0.0 ? p->logps[0] / p->count[0] : NAN,
                        p->count[1] > 0.0 ? p->logps[1] / p->count[1] : NAN,
                        p->mask_sum[0] > 0.0 ? p->z_sum[0] / p->mask_sum[0] : NAN,
                        p->mask_sum[1] > 0.0 ? p->z_sum[1] / p->mask_sum[1] : NAN,
                        tokens > 0.0 ? p->entropy_sum / tokens : 0.0};
    if (p->count[0] > 0.0 && p->count[1] > 0.0)
        m.rewards_margins = m.rewards_chosen - m.rewards_rejected;
    *out->metrics = m;
}

/* ---- calls ------------------------------------------------------------------------------------------ */

FH_API fh_status fh_kto_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_every_bytes(ctx, lin, bytes);
}

fh_token_stats fh_kto_stats_in(const fh_workspace *ws, int metrics)
{
    fh_token_stats stats = fh_logprob_stats_in(ws, metrics);
    stats.sum_weighted_z = metrics ? ws->slot[FH_KTO_SLOT_SUM_Z] : NULL;
    return stats;
}

fh_engine_pass fh_kto_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids)
{
    const fh_transform identity = FH_IDENTITY_TRANSFORM;
    return fh_logprob_pass(plan, ws, lin, ids, identity);
}

/* One call's head over whole sequences (sequences.h): the arguments, and the head over the workspace from begin. */
typedef struct kto_call {
    const fh_linear *lin;
    const fh_kto_batch *batch;
    const fh_kto_options *options;
    fh_kto_outputs *out;
    fh_kto_head h;
} kto_call;

static void begin(void *state, const fh_workspace *ws, double grad)
{
    kto_call *c = state;
    (void)grad;
    c->h = fh_kto_head_in(ws, c->batch, c->options, c->lin->vocab);
}

static fh_engine_pass pass_of(const void *state, const fh_plan *plan, const fh_workspace *ws)
{
    const kto_call *c = state;
    return fh_kto_pass(plan, ws, c->lin, c->batch->targets);
}

static fh_token_stats stats_of(const void *state)
{
    const kto_call *c = state;
    return fh_kto_stats_in(c->h.ws, c->out->metrics != NULL);
}

/* The tokens' logp (and the entropies for the metrics). */
static void after_forward(void *state)
{
    const kto_call *c = state;
    fh_logprob_token_values(c->h.ws, c->batch->targets, 0, c->lin->n, c->h.vocab, c->out->metrics != NULL);
}

static void sequences(void *state, int64_t s0, int64_t s1, double grad)
{
    fh_kto_sequence_coefficients(&((const kto_call *)state)->h, s0, s1, grad);
}

static void row_coefficients(const void *state, int64_t i, fh_coef *k)
{
    fh_kto_row_coefficients(((const kto_call *)state)->h.ws, i, k);
}

/* The entropies for the metrics (sequences() made logp). */
static void after_blocks(void *state)
{
    const kto_call *c = state;
    if (c->out->metrics)
        fh_logprob_token_values(c->h.ws, c->batch->targets, 0, c->lin->n, c->h.vocab, 1);
}

static fh_coef_arrays streaming_coefs(void *state, const fh_workspace *ws, double grad)
{
    const kto_call *c = state;
    fh_kto_sequence_coefficients(&c->h, 0, c->batch->batch, grad);
    return fh_kto_coefs_in(ws, c->lin->n);
}

/* The loss, metrics and outputs of a single-process call. */
static void finish(const void *state)
{
    const kto_call *c = state;
    fh_kto_partials p;
    fh_kto_head_partials(&c->h, c->out->metrics != NULL, &p, c->out);
    fh_kto_head_finish(&c->h, &p, c->out);
}

static fh_sequence_head sequence_head(kto_call *c)
{
    const fh_sequence_head hd = {.groups = fh_sequence_groups(c->batch->batch, c->batch->seq, c->batch->cu_seqlens, 0),
                                 .state = c,
                                 .begin = begin,
                                 .pass = pass_of,
                                 .stats = stats_of,
                                 .after_forward = after_forward,
                                 .sequences = sequences,
                                 .row = row_coefficients,
                                 .after_blocks = after_blocks,
                                 .streaming_coefs = streaming_coefs,
                                 .finish = finish};
    return hd;
}

FH_API fh_status fh_kto_forward(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *batch,
                                const fh_kto_options *options, fh_kto_outputs *out)
{
    const fh_status st = fh_kto_check_call(ctx, lin, batch, options, out, 0);
    if (st != FH_OK)
        return st;
    kto_call c = {lin, batch, options, out, {0}};
    const fh_sequence_head hd = sequence_head(&c);
    return fh_sequence_forward(ctx, lin, &hd);
}

FH_API fh_status fh_kto_forward_backward(fh_context *ctx, const fh_linear *lin, const fh_kto_batch *batch,
                                         const fh_kto_options *options, const float *grad_output,
                                         fh_kto_outputs *out, fh_linear_grads *grads)
{
    fh_status st = fh_kto_check_call(ctx, lin, batch, options, out, 0);
    if (st == FH_OK)
        st = fh_grpo_check_grad_output(ctx, grad_output);
    if (st == FH_OK)
        st = fh_check_grads(ctx, lin, grads);
    if (st == FH_OK)
        st = fh_kto_check_apart(ctx, lin, batch, grad_output, out, grads);
    if (st != FH_OK)
        return st;
    kto_call c = {lin, batch, options, out, {0}};
    const fh_sequence_head hd = sequence_head(&c);
    return fh_sequence_train_step(ctx, lin, grads, &hd, grad_output[0]);
}
