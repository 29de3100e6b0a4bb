/* GRPO across the layout: the engine on this rank's shard, lse / target logit / sum p z combined over
 * the vocab group, the head (grpo_head.h) with whole-batch totals summed over the data
 * group, then the gradient reductions. The single-call step runs in row blocks of whole sequences, one
 * statistics all-reduce per block, when every rank of the grid can; else it streams. */
#include "parallel_internal.h"

#include "core/context.h"
#include "heads/grpo_head.h"
#include "heads/sequences.h"

#include <math.h>

typedef struct grpo_call {
    fhp_call call;
    const fh_grpo_batch *bt;
    const fh_grpo_options *o;
} grpo_call;

/* An engine pass over the shard with the engine's ids. */
static fh_engine_pass shard_pass(const void *head, const fh_plan *plan, const fh_workspace *ws)
{
    const grpo_call *c = head;
    return fh_grpo_pass(plan, ws, c->call.lin, c->call.engine_ids, c->o);
}

static fh_status begin(grpo_call *c, int entry, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                       const fh_grpo_batch *bt, const fh_grpo_options *o)
{
    c->bt = bt;
    c->o = o;
    fh_status st = fhp_call_start(&c->call, L, ctx, lin, entry, shard_pass, c);
    fhp_call *call = &c->call;
    if (st == FH_OK && o) {
        fhp_call_config(call, "loss_type", o->loss_type);
        fhp_call_config(call, "importance_sampling_level", o->importance_sampling_level);
        fhp_call_config_real(call, "temperature", o->temperature);
        fhp_call_config_real(call, "epsilon_low", o->epsilon_low);
        fhp_call_config_real(call, "epsilon_high", o->epsilon_high);
        fhp_call_config_real(call, "delta", o->delta);
        fhp_call_config_real(call, "beta", o->beta);
        fhp_call_config_real(call, "sapo_temperature_pos", o->sapo_temperature_pos);
        fhp_call_config_real(call, "sapo_temperature_neg", o->sapo_temperature_neg);
        fhp_call_config_real(call, "num_items_in_batch", o->num_items_in_batch);
        fhp_call_config(call, "max_completion_length", o->max_completion_length);
        fhp_call_config_real(call, "entropy_coef", o->entropy_coef);
        fhp_call_config_real(call, "top_entropy_quantile", o->top_entropy_quantile);
        fhp_call_config_real(call, "off_policy_mask_threshold", o->off_policy_mask_threshold);
        fhp_call_config(call, "use_bias_correction_kl", o->use_bias_correction_kl != 0);
        fhp_call_config(call, "vllm_importance_sampling_correction", o->vllm_importance_sampling_correction != 0);
        fhp_call_config(call, "vllm_importance_sampling_mode", o->vllm_importance_sampling_mode);
        fhp_call_config_real(call, "vllm_importance_sampling_clip_min", o->vllm_importance_sampling_clip_min);
        fhp_call_config_real(call, "vllm_importance_sampling_clip_max", o->vllm_importance_sampling_clip_max);
        fhp_call_config_real(call, "vespo_k_pos", o->vespo_k_pos);
        fhp_call_config_real(call, "vespo_lambda_pos", o->vespo_lambda_pos);
        fhp_call_config_real(call, "vespo_k_neg", o->vespo_k_neg);
        fhp_call_config_real(call, "vespo_lambda_neg", o->vespo_lambda_neg);
    }
    if (st == FH_OK && bt) {
        fhp_call_config(call, "the sequence length", bt->seq);
        fhp_call_config(call, "old log-probs given", bt->old_per_token_logps != NULL);
        fhp_call_config(call, "sampling log-probs given", bt->sampling_per_token_logps != NULL);
    }
    if (st == FH_OK)
        st = fh_grpo_check_call(ctx, lin, bt, o, L->total_vocab);
    if (st == FH_OK && bt->support)
        st = fh_fail(ctx, FH_ERR_INVALID_SUPPORT, "fh_grpo_batch.support: the log-probs over a support have no "
                                                  "vocabulary- or data-parallel form (give it to fh_grpo_* on one "
                                                  "process)");
    if (st == FH_OK && bt->cu_seqlens)
        st = fh_fail(ctx, FH_ERR_INVALID_SIZE, "fh_grpo_batch.cu_seqlens: packed sequences have no vocabulary- or "
                                               "data-parallel form (pass [B, T] rows, or call fh_grpo_* on one process)");
    if (st == FH_OK)
        st = fhp_call_scratch(&c->call, bt->completion_ids, 0);
    return st;
}

/* Streaming forward on the shard; leaves whole-vocabulary lse, sum_pz, logp and entropy in ws. */
static fh_status forward_pass(grpo_call *c, const fh_plan *plan, const fh_workspace *ws)
{
    const fhp_call *call = &c->call;
    const fh_token_stats stats = fh_logprob_stats_in(ws, 1);
    fh_engine_pass pass = shard_pass(c, plan, ws);
    pass.stats = &stats;
    (void)fh_engine_forward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    const fh_status st = fhp_combine_stats(call->L, call->ctx, call->lin->n, &stats, NULL, call->records);
    if (st == FH_OK)
        fh_logprob_token_values(ws, c->bt->completion_ids, 0, call->lin->n, call->L->total_vocab, 1);
    return st;
}

/* The mask count and B of the whole batch (every data rank's), from the head's own. */
static fh_status sum_totals(grpo_call *c, fh_grpo_head *h)
{
    double totals[2] = {h->mask_sum, h->batch_total};
    const fh_status st = fhp_sum(c->call.ctx, &c->call.L->data, totals, 2);
    h->mask_sum = totals[0];
    h->mask_total = fmax(totals[0], 1.0);
    h->batch_total = totals[1];
    return st;
}

/* Sums over the data group, for the entropy threshold (self: grpo_call). */
static fh_status sum_over_data(void *self, double *values, int n)
{
    const grpo_call *c = self;
    return fhp_sum(c->call.ctx, &c->call.L->data, values, n);
}

/* Per-sequence values, the whole batch's totals and its entropy threshold. */
static fh_status prepare_head(grpo_call *c, fh_grpo_head *h, const fh_workspace *ws)
{
    *h = fh_grpo_head_in(ws, c->bt, c->o, c->call.L->total_vocab);
    fh_grpo_head_prepare(h, ws->slot[FH_LOGPROB_SLOT_LOGP]);
    fh_status st = sum_totals(c, h);
    const fh_grpo_reducer data = {sum_over_data, c};
    if (st == FH_OK)
        st = fh_grpo_head_entropy_threshold(h, ws->slot[FH_LOGPROB_SLOT_ENTROPY], &data);
    return st;
}

/* The head's per-token work; with finish, the loss and metrics from partial sums over the data ranks. */
static fh_status run_head(grpo_call *c, const fh_grpo_head *h, const fh_workspace *ws, double grad,
                          const fh_grpo_head_outputs *hout, int finish)
{
    fh_grpo_partials p;
    fh_grpo_head_evaluate(h, 0, c->bt->batch, ws->slot[FH_LOGPROB_SLOT_LOGP], ws->slot[FH_LOGPROB_SLOT_ENTROPY], grad,
                          hout, &p);
    if (!finish)
        return FH_OK;
    fh_status st = fhp_sum(c->call.ctx, &c->call.L->data, (double *)&p.sum,
                           (int)(sizeof p.sum / sizeof(double)));
    if (st == FH_OK)
        st = fhp_max(c->call.ctx, &c->call.L->data, (double *)&p.max,
                     (int)(sizeof p.max / sizeof(double)));
    if (st == FH_OK)
        fh_grpo_head_finish(h, &p, hout);
    return st;
}

/* The head's coefficients, the engine's backward on the shard, the reductions. */
static fh_status backward_pass(grpo_call *c, const fh_plan *plan, const fh_workspace *ws, double grad,
                               fh_grpo_outputs *forward_out)
{
    fhp_call *call = &c->call;
    fh_grpo_head h;
    fh_status st = prepare_head(c, &h, ws);
    const fh_grpo_head_outputs hout = fh_grpo_backward_outputs(ws, forward_out);
    if (st == FH_OK)
        st = run_head(c, &h, ws, grad, &hout, forward_out != NULL);
    if (st == FH_OK) {
        const fh_coef_arrays coefs = fh_grpo_coefs_in(ws, call->lin->n);
        fh_engine_pass pass = shard_pass(c, plan, ws);
        pass.coefs = &coefs;
        pass.grads = &call->g.engine;
        (void)fh_engine_backward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    }
    return fhp_call_finish(call, st);
}

/* The row-block pass's hook and rows (self: const sequence_blocks *). */
typedef struct sequence_blocks {
    grpo_call *c;
    fh_grpo_head *h;
    const fh_workspace *ws;
    double grad;
} sequence_blocks;

/* A block's shard statistics become the whole vocabulary's (one all-reduce over the vocab group), then
 * its coefficients. */
static fh_status block_coefficients(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const sequence_blocks *s = self;
    const fhp_call *call = &s->c->call;
    const fh_status st = fhp_call_combine_block(call, block->rows, stats);
    if (st == FH_OK)
        fh_grpo_block_coefficients(s->h, s->ws, call->L->total_vocab, s->grad, block);
    return st;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    fh_grpo_row_coefficients(((const sequence_blocks *)self)->ws, i, k);
}

/* The single-call step over the agreed row blocks, then the loss, metrics and per-token outputs. */
static fh_status row_block_step(grpo_call *c, const fh_plan *plan, const fh_workspace *ws, double grad,
                                fh_grpo_outputs *out)
{
    fhp_call *call = &c->call;
    fh_grpo_head h = fh_grpo_head_in(ws, c->bt, c->o, call->L->total_vocab);
    fh_grpo_head_count(&h);
    fh_status st = sum_totals(c, &h);
    if (st == FH_OK) {
        const sequence_blocks self = {c, &h, ws, grad};
        const fh_coef_source source = {row_coefficients, block_coefficients, &self};
        const fh_token_stats stats = fh_logprob_stats_in(ws, 1);
        const fh_row_groups groups = fh_sequence_groups(c->bt->batch, c->bt->seq, NULL, 0);
        fh_engine_pass pass = shard_pass(c, plan, ws);
        pass.stats = &stats;
        pass.source = &source;
        pass.grads = &call->g.engine;
        pass.groups = &groups;
        st = fh_engine_row_blocks(&pass);
    }
    const fh_grpo_head_outputs hout = {out->loss, out->metrics, out->per_token_loss, NULL, NULL};
    if (st == FH_OK)
        st = run_head(c, &h, ws, grad, &hout, 1);
    if (st == FH_OK)
        fh_grpo_write_outputs(ws, call->lin->n, out);
    return fhp_call_finish(call, st);
}

FH_API fh_status fh_parallel_grpo_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                          const fh_grpo_batch *batch, const fh_grpo_options *options,
                                          fh_grpo_outputs *out)
{
    grpo_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_GRPO_FORWARD, layout, ctx, lin, batch, options);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = fh_grpo_check_apart(ctx, lin, batch, NULL, NULL, NULL, NULL, out, NULL);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, NULL));
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, batch->completion_ids, NULL);
    st = forward_pass(&c, &plan, &ws);
    fh_grpo_head h;
    if (st == FH_OK)
        st = prepare_head(&c, &h, &ws);
    const fh_grpo_head_outputs hout = {out->loss, out->metrics, out->per_token_loss, NULL, NULL};
    if (st == FH_OK)
        st = run_head(&c, &h, &ws, 1.0, &hout, 1);
    if (st == FH_OK)
        fh_grpo_write_outputs(&ws, lin->n, out);
    return st;
}

/* The gradients' checks; saved (per_token_logp, lse, entropy; NULL in the train step) and out join the overlap
 * check, which leaves dx out: with reduce-scatter this rank's dx holds only its block of rows. */
static fh_status check_grads(grpo_call *c, const float *const saved[3], const float *grad_output,
                             const fh_grpo_outputs *out, const fh_linear_grads *grads)
{
    fhp_call *call = &c->call;
    fhp_call_config_grads(call, grads);
    fh_status st = fh_grpo_check_grad_output(call->ctx, grad_output);
    if (st == FH_OK && grads) {
        fh_linear_grads without_dx = *grads;
        without_dx.dx = NULL;
        st = fh_grpo_check_apart(call->ctx, call->lin, c->bt, saved[0], saved[1], saved[2], grad_output, out,
                                 &without_dx);
    }
    if (st == FH_OK)
        st = fhp_grads_begin(call->L, call->ctx, call->lin, grads, &call->g);
    return st;
}

FH_API fh_status fh_parallel_grpo_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                           const fh_grpo_batch *batch, const fh_grpo_options *options,
                                           const float *per_token_logp, const float *lse, const float *entropy,
                                           const float *grad_output, fh_linear_grads *grads)
{
    grpo_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_GRPO_BACKWARD, layout, ctx, lin, batch, options);
    if (st == FH_OK)
        st = fh_grpo_check_saved(ctx, options, per_token_logp, lse, entropy);
    const float *const saved[3] = {per_token_logp, lse, entropy};
    if (st == FH_OK)
        st = check_grads(&c, saved, grad_output, NULL, grads);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_BACKWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, &c.call.g.engine));
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, batch->completion_ids, NULL);
    fh_logprob_load_saved(&ws, lin->n, per_token_logp, lse, entropy);
    return backward_pass(&c, &plan, &ws, grad_output[0], NULL);
}

FH_API fh_status fh_parallel_grpo_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                   const fh_grpo_batch *batch, const fh_grpo_options *options,
                                                   const float *grad_output, fh_grpo_outputs *out,
                                                   fh_linear_grads *grads)
{
    grpo_call c;
    fh_plan plans[2];
    fh_workspace ws[2];
    fh_status st = begin(&c, FHP_GRPO_TRAIN_STEP, layout, ctx, lin, batch, options);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    const float *const none[3] = {NULL, NULL, NULL};
    if (st == FH_OK)
        st = check_grads(&c, none, grad_output, out, grads);
    int row_blocks = 0;
    /* Planned with the gradients the engine writes (see fh_parallel_ce_forward_backward). */
    if (st == FH_OK)
        st = fh_plan_train_step_groups(ctx, lin, &c.call.g.engine, batch->seq, 1, &plans[0], &row_blocks);
    /* Row blocks only where every rank can, at one height per vocab group (a multiple of seq on every
     * rank, so their minimum is one too); else every rank streams. */
    int64_t rows;
    /* The entropy threshold needs every token's entropy before any coefficient: every rank streams. */
    const int streaming_only = options && options->top_entropy_quantile < 1.0;
    st = fhp_call_schedule(&c.call, st, row_blocks && !streaming_only, plans, ws, &rows);
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, batch->completion_ids, NULL);
    if (rows > 0)
        return row_block_step(&c, &plans[0], &ws[0], grad_output[0], out);
    st = forward_pass(&c, &plans[0], &ws[0]);
    if (st != FH_OK)
        return fhp_call_finish(&c.call, st);
    st = backward_pass(&c, &plans[1], &ws[1], grad_output[0], out);
    /* Written after the backward has read old_per_token_logps, which per_token_logp may replace (the slots hold). */
    if (st == FH_OK)
        fh_grpo_write_outputs(&ws[0], lin->n, out);
    return st;
}
