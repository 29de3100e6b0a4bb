/* Log-probs over a support across the layout: each rank takes the support's entries in its vocabulary shard (every
 * rank of the vocab group holds the same tokens and the same support, in global ids), folds them as the single
 * process folds a row's entries, and the shards' statistics are combined over the vocab group as the full head's are;
 * then the per-token values, each entry's dU from the whole support's statistics, and the gradient reductions. Every
 * value is per token, so the data group only reduces the gradients. No tile and no GEMM: the GEMM provider is not
 * prepared, and the calls need no schedule. */
#include "parallel_internal.h"

#include "heads/logprob_head.h"

#include <string.h>

typedef struct support_call {
    fhp_call call;
    fh_logprob_rows rows;
    fh_transform tf;
    fh_logprob_grads g;
    int gradients;       /* the call writes gradients (backward, single call) */
    fh_support_pass pass;
} support_call;

/* The checks every rank makes alone, the configuration its group compares, the gradients' buffers and the shard's
 * entries compacted (saved_lse / saved_entropy: the backward's inputs; out: the outputs); the caller's own checks and
 * the agreement follow. */
static fh_status start(support_call *c, int entry, fh_parallel_layout *L, fh_context *ctx, const fh_linear *lin,
                       const int64_t *targets, const fh_support *support, const fh_logprob_options *o,
                       const float *saved_lse, const float *saved_entropy, const fh_logprob_outputs *out,
                       const fh_linear_grads *grads)
{
    fh_status st = fhp_call_start(&c->call, L, ctx, lin, entry, NULL, c);
    if (st == FH_OK && o)
        fhp_call_config_logprob(&c->call, o);
    if (st == FH_OK && support) {
        fhp_call_config(&c->call, "a padded support (offsets NULL)", support->offsets == NULL);
        fhp_call_config_vocab(&c->call, "the padded support's k", support->offsets ? 0 : support->k);
    }
    if (st == FH_OK && c->gradients) {
        fhp_call_config_grads(&c->call, grads);
        fhp_call_config(&c->call, "g_logp given", c->g.logp != NULL);
        fhp_call_config(&c->call, "g_entropy given", c->g.entropy != NULL);
        fhp_call_config(&c->call, "g_lse given", c->g.lse != NULL);
    }
    if (st == FH_OK)
        fhp_call_config(&c->call, "entropy output", out && out->entropy);
    if (st == FH_OK)
        st = fh_logprob_check_call(ctx, lin, targets, o, L->total_vocab, &c->tf);
    if (st == FH_OK)
        st = fhp_call_scratch(&c->call, targets, 0);
    /* The overlap check leaves dx out: with reduce-scatter this rank's dx holds only its block of rows. */
    fh_linear_grads without_dx = grads ? *grads : (fh_linear_grads){0};
    without_dx.dx = NULL;
    if (st == FH_OK)
        st = fh_logprob_check_backward(ctx, lin, targets, saved_lse, saved_entropy, &c->g, out, c->gradients,
                                       grads ? &without_dx : NULL, NULL, NULL);
    if (st == FH_OK && c->gradients)
        st = fhp_grads_begin(L, ctx, lin, grads, &c->call.g);
    if (st == FH_OK) {
        const fh_logprob_rows rows = {targets, o->ignore_index};
        const fh_support_rows support_rows = {targets, o->ignore_index, NULL};
        const size_t floats = (size_t)lin->n * sizeof(float);
        const fh_buffer outputs[] = {{"logp", out ? out->logp : NULL, floats},
                                     {"entropy", out ? out->entropy : NULL, floats},
                                     {"lse", out ? out->lse : NULL, floats}};
        c->rows = rows;
        st = fh_support_pass_begin_shard(ctx, lin, support_rows, support, L->vocab_offset, L->total_vocab, c->tf,
                                         c->gradients ? &c->call.g.engine : NULL, outputs, 3, &c->pass);
    }
    return st;
}

/* The whole support's lse, z_target and sum_pz from the shards' (one exchange over the vocab group), then the
 * per-token values. */
static fh_status values(support_call *c, int entropy)
{
    const fh_token_stats stats = fh_support_pass_fold(&c->pass, entropy);
    const fh_status st = fhp_combine_stats(c->call.L, c->call.ctx, c->call.lin->n, &stats, NULL, c->call.records);
    if (st == FH_OK)
        fh_support_pass_finish_values(&c->pass, entropy);
    return st;
}

/* Each entry's dU from the upstream gradients and the whole support's statistics, the shard's dx and dweight, and the
 * reductions. */
static fh_status gradients(support_call *c)
{
    const fh_coef_arrays coefs = fh_logprob_coefs_in(&c->pass.ws, c->call.lin->n, &c->g, c->rows);
    fh_support_pass_gradients(&c->pass, &coefs, &c->call.g.engine);
    return fhp_call_finish(&c->call, FH_OK);
}

FH_API fh_status fh_parallel_logprob_support_forward(fh_context *ctx, fh_parallel_layout *layout,
                                                     const fh_linear *lin, const int64_t *targets,
                                                     const fh_support *support, const fh_logprob_options *options,
                                                     fh_logprob_outputs *out)
{
    support_call c;
    memset(&c, 0, sizeof c);
    fh_status st = start(&c, FHP_LOGPROB_SUPPORT_FORWARD, layout, ctx, lin, targets, support, options, NULL, NULL, out,
                         NULL);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    st = fhp_call_agree(&c.call, st);
    if (st == FH_OK)
        st = values(&c, out->entropy != NULL);
    if (st == FH_OK)
        fh_logprob_write_outputs(&c.pass.ws, lin->n, c.rows, out->logp, out->entropy, out->lse);
    return st;
}

FH_API fh_status fh_parallel_logprob_support_backward(fh_context *ctx, fh_parallel_layout *layout,
                                                      const fh_linear *lin, const int64_t *targets,
                                                      const fh_support *support, const fh_logprob_options *options,
                                                      const float *lse, const float *entropy, const float *g_logp,
                                                      const float *g_entropy, const float *g_lse,
                                                      fh_linear_grads *grads)
{
    support_call c;
    memset(&c, 0, sizeof c);
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    c.g = g;
    c.gradients = 1;
    fh_status st = start(&c, FHP_LOGPROB_SUPPORT_BACKWARD, layout, ctx, lin, targets, support, options, lse,
                         g_entropy ? entropy : NULL, NULL, grads);
    if (st == FH_OK && (!lse || (g_entropy && !entropy)))
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lse ? "lse" : "entropy (g_entropy is given)");
    st = fhp_call_agree(&c.call, st);
    if (st != FH_OK)
        return st;
    fh_logprob_load_saved(&c.pass.ws, lin->n, NULL, lse, g_entropy ? entropy : NULL);
    return gradients(&c);
}

FH_API fh_status fh_parallel_logprob_support_forward_backward(fh_context *ctx, fh_parallel_layout *layout,
                                                              const fh_linear *lin, const int64_t *targets,
                                                              const fh_support *support,
                                                              const fh_logprob_options *options, const float *g_logp,
                                                              const float *g_entropy, const float *g_lse,
                                                              fh_logprob_outputs *out, fh_linear_grads *grads)
{
    support_call c;
    memset(&c, 0, sizeof c);
    const fh_logprob_grads g = {g_logp, g_entropy, g_lse};
    c.g = g;
    c.gradients = 1;
    fh_status st = start(&c, FHP_LOGPROB_SUPPORT_TRAIN_STEP, layout, ctx, lin, targets, support, options, NULL, NULL,
                         out, grads);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    st = fhp_call_agree(&c.call, st);
    if (st != FH_OK)
        return st;
    st = values(&c, out->entropy != NULL || g_entropy != NULL);
    if (st != FH_OK)
        return fhp_call_finish(&c.call, st);
    fh_logprob_write_outputs(&c.pass.ws, lin->n, c.rows, out->logp, out->entropy, out->lse);
    return gradients(&c);
}
