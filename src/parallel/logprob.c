/* Log-probs across the layout: the engine on this rank's shard, lse / target logit / sum p z combined over the
 * vocab group, then the per-token values (logprob_head.h) and the gradient reductions. Every value is per
 * token, so the data group only reduces the gradients. The single call runs in row blocks, one statistics
 * all-reduce per block, when every rank of the grid can; else it streams. */
#include "parallel_internal.h"

#include "core/context.h"
#include "heads/logprob_head.h"

#include <string.h>

typedef struct logprob_call {
    fhp_call call;
    const int64_t *targets;
    fh_logprob_rows rows;
    fh_transform tf;
    int entropy;           /* the passes fold sum p z */
    int gradients;         /* the call writes gradients (backward, single call) */
    fh_logprob_grads g;    /* the upstream gradients */
} logprob_call;

/* An engine pass over the shard with the engine's ids. */
static fh_engine_pass shard_pass(const void *head, const fh_plan *plan, const fh_workspace *ws)
{
    const logprob_call *c = head;
    return fh_logprob_pass(plan, ws, c->call.lin, c->call.engine_ids, c->tf);
}

void fhp_call_config_logprob(fhp_call *c, const fh_logprob_options *o)
{
    fhp_call_config(c, "ignore_index", o->ignore_index);
    fhp_call_config_real(c, "temperature", o->temperature);
    fhp_call_config_real(c, "softcap", o->softcap);
    fhp_call_config_real(c, "logit_scale", o->logit_scale);
}

static fh_status begin(logprob_call *c, int entry, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                       const int64_t *targets, const fh_logprob_options *o)
{
    memset(c, 0, sizeof *c);
    c->targets = targets;
    fh_status st = fhp_call_start(&c->call, L, ctx, lin, entry, shard_pass, c);
    if (st == FH_OK && o)
        fhp_call_config_logprob(&c->call, o);
    if (st == FH_OK)
        st = fh_logprob_check_call(ctx, lin, targets, o, L->total_vocab, &c->tf);
    if (st == FH_OK) {
        const fh_logprob_rows rows = {targets, o->ignore_index};
        c->rows = rows;
        st = fhp_call_scratch(&c->call, targets, 0);
    }
    return st;
}

/* Streaming forward on the shard; leaves the whole vocabulary's lse, sum_pz, logp and entropy in ws. */
static fh_status forward_pass(logprob_call *c, const fh_plan *plan, const fh_workspace *ws)
{
    const fhp_call *call = &c->call;
    const fh_token_stats stats = fh_logprob_stats_in(ws, c->entropy);
    fh_engine_pass pass = shard_pass(c, plan, ws);
    pass.stats = &stats;
    (void)fh_engine_forward(&pass); /* prepared (fhp_call_prepare): cannot fail */
    const fh_status st = fhp_combine_stats(call->L, call->ctx, call->lin->n, &stats, NULL, call->records);
    if (st == FH_OK)
        fh_logprob_token_values(ws, c->targets, 0, call->lin->n, call->L->total_vocab, c->entropy);
    return st;
}

/* The coefficients from the upstream gradients, the engine's backward on the shard. */
static void backward_pass(logprob_call *c, const fh_plan *plan, const fh_workspace *ws)
{
    const fh_coef_arrays coefs = fh_logprob_coefs_in(ws, c->call.lin->n, &c->g, c->rows);
    fh_engine_pass pass = shard_pass(c, plan, ws);
    pass.coefs = &coefs;
    pass.grads = &c->call.g.engine;
    (void)fh_engine_backward(&pass); /* prepared (fhp_call_prepare): cannot fail */
}

FH_API fh_status fh_parallel_logprob_forward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                             const int64_t *targets, const fh_logprob_options *options,
                                             fh_logprob_outputs *out)
{
    logprob_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_LOGPROB_FORWARD, layout, ctx, lin, targets, options);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, targets, NULL, NULL, &c.g, out, 0, NULL, NULL, NULL);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    if (c.call.L)
        fhp_call_config(&c.call, "entropy output", out && out->entropy);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, c.gradients ? &c.call.g.engine : NULL));
    if (st != FH_OK)
        return st;
    c.entropy = out->entropy != NULL;
    fhp_call_shard_ids(&c.call, targets, &options->ignore_index);
    st = forward_pass(&c, &plan, &ws);
    if (st == FH_OK)
        fh_logprob_write_outputs(&ws, lin->n, c.rows, out->logp, out->entropy, out->lse);
    return st;
}

/* The upstream gradients' and the gradient outputs' checks (saved: lse and entropy, NULL in the single call); out
 * joins the overlap check, which leaves dx out: with reduce-scatter this rank's dx holds only its block of rows. */
static fh_status check_grads(logprob_call *c, const float *lse, const float *entropy, const fh_logprob_outputs *out,
                             const fh_linear_grads *grads)
{
    fhp_call *call = &c->call;
    c->gradients = 1;
    fhp_call_config_grads(call, grads);
    fhp_call_config(call, "g_logp given", c->g.logp != NULL);
    fhp_call_config(call, "g_entropy given", c->g.entropy != NULL);
    fhp_call_config(call, "g_lse given", c->g.lse != NULL);
    fh_linear_grads without_dx = grads ? *grads : (fh_linear_grads){0};
    without_dx.dx = NULL;
    fh_status st = fh_logprob_check_backward(call->ctx, call->lin, c->targets, lse, entropy, &c->g, out, 1,
                                             grads ? &without_dx : NULL, NULL, NULL);
    if (st == FH_OK)
        st = fhp_grads_begin(call->L, call->ctx, call->lin, grads, &call->g);
    return st;
}

FH_API fh_status fh_parallel_logprob_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                              const int64_t *targets, const fh_logprob_options *options,
                                              const float *lse, const float *entropy, const float *g_logp,
                                              const float *g_entropy, const float *g_lse, fh_linear_grads *grads)
{
    logprob_call c;
    fh_plan plan;
    fh_workspace ws;
    fh_status st = begin(&c, FHP_LOGPROB_BACKWARD, layout, ctx, lin, targets, options);
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    c.g = g;
    if (st == FH_OK && (!lse || (g_entropy && !entropy)))
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lse ? "lse" : "entropy (g_entropy is given)");
    if (st == FH_OK)
        st = check_grads(&c, lse, entropy, NULL, grads);
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_BACKWARD, &plan, &ws);
    st = fhp_call_agree(&c.call, fhp_call_prepare(&c.call, st, &plan, &ws, 1, c.gradients ? &c.call.g.engine : NULL));
    if (st != FH_OK)
        return st;
    fhp_call_shard_ids(&c.call, targets, &options->ignore_index);
    fh_logprob_load_saved(&ws, lin->n, NULL, lse, entropy);
    backward_pass(&c, &plan, &ws);
    return fhp_call_finish(&c.call, FH_OK);
}

/* The row-block pass's rows and hook (self: const logprob_call *). */
static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    const logprob_call *c = self;
    fh_logprob_coefficients(&c->g, c->rows, i, k);
}

static fh_status combine_block(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const logprob_call *c = self;
    return fhp_call_combine_block(&c->call, block->rows, stats);
}

FH_API fh_status fh_parallel_logprob_forward_backward(fh_context *ctx, fh_parallel_layout *layout, const fh_linear *lin,
                                                      const int64_t *targets, const fh_logprob_options *options,
                                                      const float *g_logp, const float *g_entropy,
                                                      const float *g_lse, fh_logprob_outputs *out,
                                                      fh_linear_grads *grads)
{
    logprob_call c;
    fh_plan plans[2];
    fh_workspace ws[2];
    fh_status st = begin(&c, FHP_LOGPROB_TRAIN_STEP, layout, ctx, lin, targets, options);
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    c.g = g;
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = check_grads(&c, NULL, NULL, out, grads);
    if (c.call.L)
        fhp_call_config(&c.call, "entropy output", out && out->entropy);
    int row_blocks = 0;
    /* Planned with the gradients the engine writes (see fh_parallel_ce_forward_backward). */
    if (st == FH_OK)
        st = fh_plan_train_step(ctx, lin, &c.call.g.engine, &plans[0], &row_blocks, ctx);
    int64_t rows;
    st = fhp_call_schedule(&c.call, st, row_blocks, plans, ws, &rows);
    if (st != FH_OK)
        return st;
    c.entropy = out->entropy || g_entropy;
    fhp_call_shard_ids(&c.call, targets, &options->ignore_index);
    if (rows > 0) {
        const fh_coef_source source = {row_coefficients, layout->vocab_ranks > 1 ? combine_block : NULL, &c};
        const fh_token_stats stats = fh_logprob_stats_in(&ws[0], c.entropy);
        fh_engine_pass pass = shard_pass(&c, &plans[0], &ws[0]);
        pass.stats = &stats;
        pass.source = &source;
        pass.grads = &c.call.g.engine;
        st = fh_engine_row_blocks(&pass);
        if (st == FH_OK)
            fh_logprob_token_values(&ws[0], targets, 0, lin->n, layout->total_vocab, c.entropy);
    } else {
        st = forward_pass(&c, &plans[0], &ws[0]);
        if (st == FH_OK)
            backward_pass(&c, &plans[1], &ws[1]);
    }
    if (st == FH_OK)
        fh_logprob_write_outputs(&ws[0], lin->n, c.rows, out->logp, out->entropy, out->lse);
    return fhp_call_finish(&c.call, st);
}
