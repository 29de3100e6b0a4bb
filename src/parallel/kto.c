/* KTO across the layout: the engine on this rank's shard, lse / target logit / sum z / sum p z combined over the
 * vocab group, the head (kto_head.h) with the whole batch's divisor and KL term summed over the data
 * group (TRL gathers the KL log-ratios before their mean), its partial sums for the loss and metrics summed
 * likewise, then the gradient reductions. The single-call step runs in row blocks of whole sequences, one
 * statistics all-reduce per block, when every rank of the grid can; else it streams. */
#include "parallel_internal.h"

#include "core/context.h"
#include "heads/grpo_head.h"
#include "heads/sequences.h"
#include "heads/kto_head.h"

typedef struct kto_call {
    fhp_call call;
    const fh_kto_batch *bt;
    const fh_kto_options *o;
    int metrics; /* the metrics are asked for: their statistics are combined and summed */
} kto_call;

/* An engine pass over the shard with the engine's ids. */
static fh_engine_pass shard_pass(const void *head, const fh_plan *plan, const fh_workspace *ws)
{
    const kto_call *c = head;
    return fh_kto_pass(plan, ws, c->call.lin, c->call.engine_ids);
}

static fh_status begin(kto_call *c, int entry, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                       const fh_kto_batch *bt, const fh_kto_options *o, const fh_kto_outputs *out)
{
    c->bt = bt;
    c->o = o;
    c->metrics = out && out->metrics;
    fh_status st = fhp_call_start(&c->call, L, ctx, lin, entry, shard_pass, c);
    fhp_call *call = &c->call;
    if (st == FH_OK && o) {
        fhp_call_config(call, "loss_type", o->loss_type);
        fhp_call_config_real(call, "beta", o->beta);
        fhp_call_config_real(call, "desirable_weight", o->desirable_weight);
        fhp_call_config_real(call, "undesirable_weight", o->undesirable_weight);
    }
    if (st == FH_OK && bt) {
        /* KTO does not depend on T: data ranks may pad their sequences to different lengths. */
        fhp_call_config_vocab(call, "the sequence length", bt->seq);
        fhp_call_config(call, "per-token reference log-probs given", bt->ref_per_token_logps != NULL);
        fhp_call_config(call, "KL log-ratios given", bt->kl_logratios != NULL);
        fhp_call_config(call, "a KL value given", bt->kl != NULL);
        fhp_call_config_float(call, "the KL value", bt->kl ? bt->kl[0] : 0.0f);
    }
    if (st == FH_OK)
        fhp_call_config(call, "metrics asked for", c->metrics);
    if (st == FH_OK)
        st = fh_kto_check_call(ctx, lin, bt, o, out, L->total_vocab);
    if (st == FH_OK && bt->cu_seqlens)
        st = fh_fail(ctx, FH_ERR_INVALID_SIZE, "fh_kto_batch.cu_seqlens: packed sequences have no vocabulary- or "
                                               "data-parallel form (pass [B, T] rows, or call fh_kto_* on one process)");
    if (st == FH_OK)
        st = fhp_call_scratch(&c->call, bt->targets, 0);
    return st;
}

/* Streaming forward on the shard; leaves the whole vocabulary's statistics, logp (and the entropies) in ws. */
static fh_status forward_pass(kto_call *c, const fh_plan *plan, const fh_workspace *ws)
{
    const fhp_call *call = &c->call;
    const fh_token_stats stats = fh_kto_stats_in(ws, c->metrics);
    fh_engine_pass pass = shard_pass(c, plan, ws);
    pass.stats = &stats;
    (void)fh_engine_forward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    const fh_status st = fhp_combine_stats(call->L, call->ctx, call->lin->n, &stats, NULL, call->records);
    if (st == FH_OK)
        fh_logprob_token_values(ws, c->bt->targets, 0, call->lin->n, call->L->total_vocab, c->metrics);
    return st;
}

/* The head with the whole batch's B and KL term (every data rank's). */
static fh_status head_in(kto_call *c, const fh_workspace *ws, fh_kto_head *h)
{
    *h = fh_kto_head_in(ws, c->bt, c->o, c->call.L->total_vocab);
    double sums[2];
    fh_kto_head_sums(h, sums);
    const fh_status st = fhp_sum(c->call.ctx, &c->call.L->data, sums, 2);
    fh_kto_head_set_totals(h, sums);
    return st;
}

/* This rank's outputs, then the loss and metrics from partial sums over the data ranks. */
static fh_status finish_head(kto_call *c, const fh_kto_head *h, fh_kto_outputs *out)
{
    fh_kto_partials p;
    fh_kto_head_partials(h, c->metrics, &p, out);
    const fh_status st =
        fhp_sum(c->call.ctx, &c->call.L->data, (double *)&p, (int)(sizeof p / sizeof(double)));
    if (st == FH_OK)
        fh_kto_head_finish(h, &p, out);
    return st;
}

FH_API fh_status fh_parallel_kto_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                         const fh_kto_batch *batch, const fh_kto_options *options, fh_kto_outputs *out)
{
    kto_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_KTO_FORWARD, layout, ctx, lin, batch, options, out);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, NULL));
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, batch->targets, NULL);
    st = forward_pass(&c, &plan, &ws);
    fh_kto_head h;
    if (st == FH_OK)
        st = head_in(&c, &ws, &h);
    if (st == FH_OK)
        st = finish_head(&c, &h, out);
    return st;
}

/* The row-block pass's hook and rows (self: const sequence_blocks *). */
typedef struct sequence_blocks {
    kto_call *c;
    const fh_kto_head *h;
    double grad;
} sequence_blocks;

/* A block's shard statistics become the whole vocabulary's (one all-reduce over the vocab group), then its
 * sequences' coefficients. */
static fh_status block_coefficients(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const sequence_blocks *s = self;
    const fhp_call *call = &s->c->call;
    const fh_status st = fhp_call_combine_block(call, block->rows, stats);
    if (st == FH_OK)
        fh_kto_sequence_coefficients(s->h, block->first_group, block->end_group, s->grad);
    return st;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    fh_kto_row_coefficients(((const sequence_blocks *)self)->h->ws, i, k);
}

/* The single-call step over the agreed row blocks, then the loss, metrics and outputs. */
static fh_status row_block_step(kto_call *c, const fh_plan *plan, const fh_workspace *ws, double grad,
                                fh_kto_outputs *out)
{
    fhp_call *call = &c->call;
    fh_kto_head h;
    fh_status st = head_in(c, ws, &h);
    if (st == FH_OK) {
        const sequence_blocks self = {c, &h, grad};
        const fh_coef_source source = {row_coefficients, block_coefficients, &self};
        const fh_token_stats stats = fh_kto_stats_in(ws, c->metrics);
        const fh_row_groups groups = fh_sequence_groups(c->bt->batch, c->bt->seq, NULL, 0);
        fh_engine_pass pass = shard_pass(c, plan, ws);
        pass.stats = &stats;
        pass.source = &source;
        pass.grads = &call->g.engine;
        pass.groups = &groups;
        st = fh_engine_row_blocks(&pass);
    }
    if (st == FH_OK && c->metrics) /* the entropies (the block hook made logp) */
        fh_logprob_token_values(ws, c->bt->targets, 0, call->lin->n, call->L->total_vocab, 1);
    if (st == FH_OK)
        st = finish_head(c, &h, out);
    return fhp_call_finish(call, st);
}

/* Streaming: the forward, the head's coefficients, the loss and metrics, the engine's backward on the shard, the
 * reductions. */
static fh_status streaming_step(kto_call *c, const fh_plan plans[2], const fh_workspace ws[2], double grad,
                                fh_kto_outputs *out)
{
    fhp_call *call = &c->call;
    fh_status st = forward_pass(c, &plans[0], &ws[0]);
    fh_kto_head h;
    if (st == FH_OK)
        st = head_in(c, &ws[0], &h);
    if (st == FH_OK) {
        fh_kto_sequence_coefficients(&h, 0, c->bt->batch, grad);
        st = finish_head(c, &h, out);
    }
    if (st == FH_OK) {
        const fh_coef_arrays coefs = fh_kto_coefs_in(&ws[1], call->lin->n);
        fh_engine_pass pass = shard_pass(c, &plans[1], &ws[1]);
        pass.coefs = &coefs;
        pass.grads = &call->g.engine;
        (void)fh_engine_backward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    }
    return fhp_call_finish(call, st);
}

FH_API fh_status fh_parallel_kto_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                  const fh_kto_batch *batch, const fh_kto_options *options,
                                                  const float *grad_output, fh_kto_outputs *out,
                                                  fh_linear_grads *grads)
{
    kto_call c;
    fh_plan plans[2];
    fh_workspace ws[2];
    fh_status st = begin(&c, FHP_KTO_TRAIN_STEP, layout, ctx, lin, batch, options, out);
    if (st == FH_OK) {
        fhp_call_config_grads(&c.call, grads);
        st = fh_grpo_check_grad_output(ctx, grad_output);
    }
    /* dx stays out of the overlap check: with reduce-scatter this rank's dx holds only its block of rows. */
    if (st == FH_OK && grads) {
        fh_linear_grads without_dx = *grads;
        without_dx.dx = NULL;
        st = fh_kto_check_apart(ctx, lin, batch, grad_output, out, &without_dx);
    }
    if (st == FH_OK)
        st = fhp_grads_begin(c.call.L, ctx, lin, grads, &c.call.g);
    int row_blocks = 0;
    /* Planned with the gradients the engine writes (see fh_parallel_ce_forward_backward). */
    if (st == FH_OK)
        st = fh_plan_train_step_groups(ctx, lin, &c.call.g.engine, batch->seq, 1, &plans[0], &row_blocks);
    int64_t rows;
    st = fhp_call_schedule(&c.call, st, row_blocks, plans, ws, &rows);
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, batch->targets, NULL);
    return rows > 0 ? row_block_step(&c, &plans[0], &ws[0], grad_output[0], out)
                    : streaming_step(&c, plans, ws, grad_output[0], out);
}
