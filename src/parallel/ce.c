/* Cross-entropy across the layout: the engine on this rank's shard, the statistics combined over the
 * vocab group, the head (ce_head.h) with whole-vocabulary and whole-batch normalisers, then the
 * gradient reductions. */
#include "parallel_internal.h"

#include "heads/ce_head.h"
#include "core/context.h"

/* One call's state. */
typedef struct ce_call {
    fhp_call call;
    const int64_t *targets;
    const fh_ce_options *o;
    double *weights; /* [n + 1]: targets' class weights, then the class-weight total */
    fh_ce_head h;
} ce_call;

static int sharded_weights(const ce_call *c)
{
    return c->o->class_weights && c->call.L->vocab_ranks > 1;
}

/* An engine pass over the shard with the engine's ids. */
static fh_engine_pass shard_pass(const void *head, const fh_plan *plan, const fh_workspace *ws)
{
    const ce_call *c = head;
    return fh_ce_pass(plan, ws, c->call.lin, c->call.engine_ids, c->o);
}

/* Local checks common to every call, then the per-call scratch. */
static fh_status begin(ce_call *c, int entry, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                       const int64_t *targets, const fh_ce_options *o, const float *grad_output)
{
    c->targets = targets;
    c->o = o;
    fh_status st = fhp_call_start(&c->call, L, ctx, lin, entry, shard_pass, c);
    if (st == FH_OK && o) {
        fhp_call_config(&c->call, "the reduction", o->reduction);
        fhp_call_config(&c->call, "ignore_index", o->ignore_index);
        fhp_call_config_real(&c->call, "label_smoothing", o->label_smoothing);
        fhp_call_config(&c->call, "class weights given", o->class_weights != NULL);
        fhp_call_config_real(&c->call, "softcap", o->softcap);
        fhp_call_config_real(&c->call, "z_loss", o->z_loss);
        fhp_call_config_real(&c->call, "logit_scale", o->logit_scale);
        fhp_call_config(&c->call, "token_scaling", o->token_scaling != 0);
    }
    if (st == FH_OK)
        st = fh_ce_check_call(ctx, lin, targets, o, L->total_vocab);
    if (st == FH_OK)
        st = fhp_call_scratch(&c->call, targets, (size_t)(lin->n + 1) * sizeof(double));
    if (st != FH_OK)
        return st;
    c->weights = c->call.head_scratch;
    const fh_ce_head h = {lin, targets, o, {0.0, 0.0, 0.0}, grad_output,
                          o->reduction == FH_REDUCTION_NONE ? lin->n : 1, (double)L->total_vocab,
                          sharded_weights(c) ? c->weights : NULL};
    c->h = h;
    return FH_OK;
}

/* After agreement: shard-local targets and this shard's part of the targets' class weights (and of the
 * class-weight total, in weights[n]). */
static void shard_inputs(ce_call *c)
{
    const int64_t n = c->call.lin->n;
    fhp_call_shard_ids(&c->call, c->targets, &c->o->ignore_index);
    if (!sharded_weights(c))
        return;
    double total = 0.0;
    for (int64_t j = 0; j < c->call.lin->vocab; j++)
        total += c->o->class_weights[j];
    for (int64_t i = 0; i < n; i++)
        c->weights[i] = c->call.local[i] >= 0 ? c->o->class_weights[c->call.local[i]] : 0.0;
    c->weights[n] = total;
}

/* Norms of the whole layout once c->weights holds whole-vocabulary sums: the class-weight total over
 * the vocabulary; count and target-weight sum over the data group when `data` is set (else left
 * for the caller to sum with the loss totals). */
static fh_status norms(ce_call *c, int data)
{
    const fh_parallel_layout *L = c->call.L;
    c->h.nm = fh_ce_local_norms(&c->h);
    if (sharded_weights(c))
        c->h.nm.class_weight_total = c->weights[c->call.lin->n];
    else if (!c->o->class_weights)
        c->h.nm.class_weight_total = (double)L->total_vocab;
    if (!data)
        return FH_OK;
    double sums[2] = {c->h.nm.count, c->h.nm.weight_sum};
    const fh_status st = fhp_sum(c->call.ctx, &L->data, sums, 2);
    c->h.nm.count = sums[0];
    c->h.nm.weight_sum = sums[1];
    return st;
}

/* The targets' class weights and the class-weight total summed over the vocabulary, then the norms
 * (see norms): everything a row's coefficients need besides its own statistics. */
static fh_status global_norms(ce_call *c, int data)
{
    fh_status st = FH_OK;
    if (sharded_weights(c))
        st = fhp_sum(c->call.ctx, &c->call.L->vocab, c->weights, (int)(c->call.lin->n + 1));
    return st == FH_OK ? norms(c, data) : st;
}

/* The outputs' checks. Every rank asks for the argmax statistic alike (the argmax or correct output): the two-step
 * statistics collective reduces it only when asked for. */
static fh_status check_outputs(ce_call *c, const fh_ce_outputs *out)
{
    fhp_call_config(&c->call, "argmax or correct asked for", out && (out->argmax || out->correct));
    return fh_ce_check_outputs(c->call.ctx, c->o, out);
}

/* The streaming forward on the shard, combined: stats end up whole-vocabulary, the loss written, and the token
 * outputs when write_tokens (the train step writes them with its coefficients, fh_ce_outputs_and_coefs). */
static fh_status forward(ce_call *c, const fh_plan *plan, const fh_workspace *ws, const fh_token_stats *stats,
                         fh_ce_outputs *out, int write_tokens)
{
    const fhp_call *call = &c->call;
    fh_engine_pass pass = shard_pass(c, plan, ws);
    pass.stats = stats;
    (void)fh_engine_forward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    fh_status st = fhp_combine_stats(call->L, call->ctx, call->lin->n, stats, sharded_weights(c) ? c->weights : NULL,
                                     call->records);
    if (st == FH_OK)
        st = norms(c, 0);
    if (st != FH_OK)
        return st;
    /* The norms, then the head's totals, summed over the data group in one call. */
    double totals[2 + FH_CE_TOTALS];
    fh_ce_outputs reduced_only = {out->loss, out->z_loss, NULL, NULL, NULL, NULL, NULL, out->correct};
    fh_ce_write_token_outputs(&c->h, stats, write_tokens ? out : &reduced_only, totals + 2);
    totals[0] = c->h.nm.count;
    totals[1] = c->h.nm.weight_sum;
    st = fhp_sum(call->ctx, &call->L->data, totals, 2 + FH_CE_TOTALS);
    c->h.nm.count = totals[0];
    c->h.nm.weight_sum = totals[1];
    if (st == FH_OK)
        fh_ce_write_loss(&c->h, totals + 2, out);
    return st;
}

FH_API fh_status fh_parallel_ce_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                        const int64_t *targets, const fh_ce_options *options, fh_ce_outputs *out)
{
    ce_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_CE_FORWARD, layout, ctx, lin, targets, options, NULL);
    if (st == FH_OK)
        st = check_outputs(&c, out);
    if (st == FH_OK)
        st = fh_ce_check_apart(ctx, lin, targets, options, NULL, NULL, out, NULL);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, NULL));
    if (st != FH_OK)
        return st;
    shard_inputs(&c);
    const fh_token_stats stats = fh_ce_stats_in(&ws, options, out);
    return forward(&c, &plan, &ws, &stats, out, 1);
}

/* The backward's checks; lse and out (either may be NULL) join the overlap check, which leaves dx out: with
 * reduce-scatter this rank's dx holds only its block of rows (fhp_grads_begin checks it). */
static fh_status check_backward(ce_call *c, const float *lse, const float *grad_output, const fh_ce_outputs *out,
                                const fh_linear_grads *grads)
{
    fhp_call *call = &c->call;
    if (!grads)
        return fh_fail(call->ctx, FH_ERR_NULL_POINTER, "the fh_linear_grads description is NULL");
    fhp_call_config_grads(call, grads);
    /* dx is checked by fhp_grads_begin, for the rows it holds (a block with reduce-scatter). */
    fh_linear_grads without_dx = *grads;
    without_dx.dx = NULL;
    fh_status st = fh_ce_check_backward_inputs(call->ctx, call->lin, c->o, grad_output, &without_dx);
    if (st == FH_OK)
        st = fh_ce_check_apart(call->ctx, call->lin, c->targets, c->o, lse, grad_output, out, &without_dx);
    if (st == FH_OK)
        st = fhp_grads_begin(call->L, call->ctx, call->lin, grads, &call->g);
    return st;
}

FH_API fh_status fh_parallel_ce_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                         const int64_t *targets, const fh_ce_options *options, const float *lse,
                                         const float *grad_output, fh_linear_grads *grads)
{
    ce_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_CE_BACKWARD, layout, ctx, lin, targets, options, grad_output);
    if (st == FH_OK && !lse)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "lse is NULL");
    if (st == FH_OK)
        st = check_backward(&c, lse, grad_output, NULL, grads);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_BACKWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, &c.call.g.engine));
    if (st != FH_OK)
        return st;
    shard_inputs(&c);
    st = global_norms(&c, options->reduction == FH_REDUCTION_MEAN);
    fh_engine_pass pass = shard_pass(&c, &plan, &ws);
    pass.grads = &c.call.g.engine;
    /* DFT's target logits: each from the shard that holds the target (the others' are 0), summed. */
    double *z_target = st == FH_OK ? fh_ce_target_logits_in(&ws, options, &pass) : NULL;
    if (z_target)
        st = fhp_sum(ctx, &layout->vocab, z_target, (int)lin->n);
    if (st == FH_OK) {
        const fh_coef_arrays coefs = fh_ce_coefs_in(&ws, &c.h, lse, z_target);
        pass.coefs = &coefs;
        (void)fh_engine_backward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    }
    return fhp_call_finish(&c.call, st);
}

/* fh_coef_source of the row-block train step (self: const ce_call *). */
static void row_coefs(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    const ce_call *c = self;
    fh_ce_row_coefs(&c->h, i, stats, k);
}

/* The block's shard statistics become the whole vocabulary's. The targets' class weights were summed
 * before the pass (the norms need them), so no extra values ride along. */
static fh_status combine_block(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const ce_call *c = self;
    return fhp_call_combine_block(&c->call, block->rows, stats);
}

/* Per row block: the shard's logits and statistics, combined across the vocab group (one
 * all-reduce of the block's rows), then dU and both gradient GEMMs on the shard. */
static fh_status row_block_step(ce_call *c, const fh_plan *plan, const fh_workspace *ws,
                                const fh_token_stats *stats, fh_ce_outputs *out)
{
    const fhp_call *call = &c->call;
    fh_status st = global_norms(c, 1);
    if (st == FH_OK) {
        const fh_coef_source source = {row_coefs, call->L->vocab_ranks > 1 ? combine_block : NULL, c};
        fh_engine_pass pass = shard_pass(c, plan, ws);
        pass.stats = stats;
        pass.source = &source;
        pass.grads = &call->g.engine;
        st = fh_engine_row_blocks(&pass);
    }
    if (st == FH_OK) {
        double totals[FH_CE_TOTALS];
        fh_ce_write_token_outputs(&c->h, stats, out, totals);
        st = fhp_sum(call->ctx, &call->L->data, totals, FH_CE_TOTALS);
        if (st == FH_OK)
            fh_ce_write_loss(&c->h, totals, out);
    }
    return st;
}

FH_API fh_status fh_parallel_ce_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                 const int64_t *targets, const fh_ce_options *options,
                                                 const float *grad_output, fh_ce_outputs *out,
                                                 fh_linear_grads *grads)
{
    ce_call c;
    fh_plan plans[2];
    fh_workspace ws[2];
    int row_blocks = 0;
    fh_status st = begin(&c, FHP_CE_TRAIN_STEP, layout, ctx, lin, targets, options, grad_output);
    if (st == FH_OK)
        st = check_outputs(&c, out);
    if (st == FH_OK)
        st = check_backward(&c, NULL, grad_output, out, grads);
    /* Planned with the gradients the engine writes (fhp_grads_begin: staging buffers, beta 0 before a reduction),
     * whose memory the plan may use. */
    if (st == FH_OK)
        st = fh_plan_train_step(ctx, lin, &c.call.g.engine, &plans[0], &row_blocks, ctx);
    /* Row blocks only where every rank can, at one height per vocab group (uneven shards plan
     * different ones); else every rank streams. */
    int64_t rows;
    st = fhp_call_schedule(&c.call, st, row_blocks, plans, ws, &rows);
    if (st != FH_OK)
        return st;
    shard_inputs(&c);
    const fh_token_stats stats = fh_ce_stats_in(&ws[0], options, out);
    if (rows > 0) {
        st = row_block_step(&c, &plans[0], &ws[0], &stats, out);
    } else {
        /* Streaming: forward, the statistics' all-reduce, then backward from the double lse. */
        st = forward(&c, &plans[0], &ws[0], &stats, out, 0);
        if (st == FH_OK) {
            double local[FH_CE_TOTALS];
            const fh_coef_arrays coefs = fh_ce_outputs_and_coefs(&ws[1], &c.h, &stats, out, local);
            fh_engine_pass pass = shard_pass(&c, &plans[1], &ws[1]);
            pass.coefs = &coefs;
            pass.grads = &c.call.g.engine;
            (void)fh_engine_backward(&pass); /* prepared (fhp_call_prepare): cannot fail */
        }
    }
    return fhp_call_finish(&c.call, st);
}
