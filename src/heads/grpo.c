/* GRPO calls (TRL GRPOTrainer semantics, formulas in fusedhead.h): option and batch checks, then the engine's
 * passes around the head's math (grpo_head.c): streaming forward, backward from saved values, and the single-call
 * step in row blocks of whole sequences. */
#include "grpo_head.h"
#include "sequences.h"

#include "core/linear.h"

#include <math.h>
#include <string.h>

FH_API fh_status fh_grpo_options_init(fh_grpo_options *options)
{
    if (!options)
        return FH_ERR_NULL_POINTER;
    const fh_grpo_options defaults = {FH_GRPO_LOSS_DAPO,
                                      FH_GRPO_IS_TOKEN,
                                      1.0,
                                      0.2,
                                      NAN,
                                      NAN,
                                      0.0,
                                      1.0,
                                      1.05,
                                      0.0,
                                      0,
                                      0.0,
                                      1.0,
                                      NAN,
                                      0,
                                      1,
                                      FH_GRPO_VLLM_IS_SEQUENCE_MASK,
                                      NAN,
                                      3.0,
                                      2.0,
                                      3.0,
                                      3.0,
                                      2.0};
    *options = defaults;
    return FH_OK;
}

/* TRL's GRPOConfig checks of the vLLM importance-sampling options, made whenever the correction is on. */
static fh_status check_importance_sampling(fh_context *ctx, const fh_grpo_options *o)
{
    if (!o->vllm_importance_sampling_correction)
        return FH_OK;
    const double lo = o->vllm_importance_sampling_clip_min, hi = o->vllm_importance_sampling_clip_max;
    if ((unsigned)o->vllm_importance_sampling_mode > FH_GRPO_VLLM_IS_SEQUENCE_MASK)
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "vllm_importance_sampling_mode = %d is not one of token_truncate (0) .. sequence_mask (3)",
                       (int)o->vllm_importance_sampling_mode);
    if (isinf(lo) || isinf(hi) || (!isnan(lo) && !isnan(hi) && !(lo < hi)))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "vllm_importance_sampling_clip_min = %g, clip_max = %g: each NaN (none) or finite, min < max", lo,
                       hi);
    const int truncate = o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_TOKEN_TRUNCATE ||
                         o->vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE;
    if (truncate && isnan(lo) && isnan(hi))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "a *_truncate vllm_importance_sampling_mode needs clip_min or clip_max");
    return FH_OK;
}

static fh_status check_options(fh_context *ctx, const fh_grpo_options *o)
{
    if (!o)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "options are NULL");
    if ((unsigned)o->loss_type > FH_GRPO_LOSS_VESPO)
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "loss_type = %d is not one of grpo (0) .. vespo (7)",
                       (int)o->loss_type);
    if ((unsigned)o->importance_sampling_level > FH_GRPO_IS_SEQUENCE)
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "importance_sampling_level = %d is neither token (0) nor sequence (1)",
                       (int)o->importance_sampling_level);
    /* 1 / temperature is applied in fp32 (the engine's transform): it must be a normal float. */
    fh_transform tf;
    const fh_status st = fh_engine_transform(ctx, o->temperature, 0.0, 1.0, &tf);
    if (st != FH_OK)
        return st;
    const double eh = fh_grpo_epsilon_high(o);
    if (!(o->epsilon_low >= 0.0 && isfinite(o->epsilon_low)) || !(eh >= 0.0 && isfinite(eh)))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "epsilon_low = %g, epsilon_high = %g must be finite and >= 0",
                       o->epsilon_low, eh);
    if (!isnan(o->delta) && !(o->delta >= 0.0 && isfinite(o->delta)))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "delta = %g must be NaN/0 (off) or finite and > 0", o->delta);
    if (!(o->beta >= 0.0 && isfinite(o->beta)))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "beta = %g must be finite and >= 0", o->beta);
    if (!(o->sapo_temperature_pos > 0.0 && isfinite(o->sapo_temperature_pos)) ||
        !(o->sapo_temperature_neg > 0.0 && isfinite(o->sapo_temperature_neg)))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "SAPO temperatures (%g, %g) must be finite and > 0",
                       o->sapo_temperature_pos, o->sapo_temperature_neg);
    if (!isfinite(o->entropy_coef) || isnan(o->num_items_in_batch) || isinf(o->num_items_in_batch))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "entropy_coef = %g and num_items_in_batch = %g must be finite",
                       o->entropy_coef, o->num_items_in_batch);
    if (!(o->top_entropy_quantile >= 0.0 && o->top_entropy_quantile <= 1.0))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "top_entropy_quantile = %g is outside [0, 1]",
                       o->top_entropy_quantile);
    if (isinf(o->off_policy_mask_threshold))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "off_policy_mask_threshold = %g must be NaN (off) or finite",
                       o->off_policy_mask_threshold);
    if (!isfinite(o->vespo_k_pos) || !isfinite(o->vespo_lambda_pos) || !isfinite(o->vespo_k_neg) ||
        !isfinite(o->vespo_lambda_neg))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION, "VESPO k and lambda (%g, %g, %g, %g) must be finite",
                       o->vespo_k_pos, o->vespo_lambda_pos, o->vespo_k_neg, o->vespo_lambda_neg);
    return check_importance_sampling(ctx, o);
}

static fh_status check_batch(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt, const fh_grpo_options *o,
                             int64_t target_vocab)
{
    if (!bt)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_grpo_batch is NULL");
    if (!bt->completion_ids || !bt->completion_mask || !bt->advantages)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL",
                       !bt->completion_ids ? "completion_ids" : !bt->completion_mask ? "completion_mask" : "advantages");
    if (o->beta != 0.0 && !bt->ref_per_token_logps)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "beta = %g needs ref_per_token_logps", o->beta);
    if (o->loss_type == FH_GRPO_LOSS_VESPO && fh_grpo_is_correction(bt, o) &&
        fh_grpo_is_sequence_mode(o->vllm_importance_sampling_mode))
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "vespo takes the importance-sampling ratio per token: vllm_importance_sampling_mode must be "
                       "token_truncate or token_mask (TRL)");
    const fh_status st = fh_check_sequence_rows(ctx, lin, "batch", bt->batch, 1, bt->seq, bt->cu_seqlens);
    if (st != FH_OK)
        return st;
    if (bt->cu_seqlens && o->loss_type == FH_GRPO_LOSS_DR_GRPO && o->max_completion_length <= 0)
        return fh_fail(ctx, FH_ERR_INVALID_GRPO_OPTION,
                       "dr_grpo over packed sequences needs max_completion_length > 0 (its default, the padded "
                       "length T, does not exist in a packed batch)");
    for (int64_t i = 0; i < lin->n; i++) {
        const float m = bt->completion_mask[i];
        if (!(m >= 0.0f && isfinite(m)))
            return fh_fail(ctx, FH_ERR_INVALID_MASK, "completion_mask[%lld] = %g must be finite and >= 0",
                           (long long)i, (double)m);
        if (m != 0.0f && (bt->completion_ids[i] < 0 || bt->completion_ids[i] >= target_vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                           "completion_ids[%lld] = %lld is outside [0, %lld) at an unmasked position", (long long)i,
                           (long long)bt->completion_ids[i], (long long)target_vocab);
    }
    return FH_OK;
}

fh_status fh_grpo_check_call(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt, const fh_grpo_options *o,
                             int64_t target_vocab)
{
    fh_status st = fh_check_call(ctx, lin);
    if (st == FH_OK)
        st = check_options(ctx, o);
    if (st == FH_OK)
        st = check_batch(ctx, lin, bt, o, target_vocab > 0 ? target_vocab : lin->vocab);
    return st;
}

/* ---- calls ---------------------------------------------------------------------------------- */

FH_API fh_status fh_grpo_workspace_size(const fh_context *ctx, const fh_linear *lin, size_t *bytes)
{
    if (!ctx || !bytes)
        return FH_ERR_NULL_POINTER;
    return fh_plan_query_every_bytes(ctx, lin, bytes);
}

fh_engine_pass fh_grpo_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const int64_t *ids,
                            const fh_grpo_options *o)
{
    return fh_logprob_pass(plan, ws, lin, ids, fh_engine_transform_of(o->temperature, 0.0, 1.0));
}

fh_grpo_head fh_grpo_head_in(const fh_workspace *ws, const fh_grpo_batch *bt, const fh_grpo_options *o,
                             int64_t vocab)
{
    const fh_grpo_head h = {bt,  o,   vocab, ws->slot[FH_GRPO_SLOT_SEQ_COUNT], ws->slot[FH_GRPO_SLOT_SEQ_LOG_RATIO],
                            0.0, 1.0, (double)bt->batch, NAN, 1.0};
    return h;
}

/* The head over the whole batch on one process, from logp and entropy in the workspace: evaluate, then finish. */
static void evaluate_all(const fh_grpo_head *h, const fh_workspace *ws, double grad, const fh_grpo_head_outputs *out)
{
    fh_grpo_partials p;
    fh_grpo_head_evaluate(h, 0, h->bt->batch, ws->slot[FH_LOGPROB_SLOT_LOGP], ws->slot[FH_LOGPROB_SLOT_ENTROPY], grad,
                          out, &p);
    fh_grpo_head_finish(h, &p, out);
}

/* Counts, log-ratios and the entropy threshold, then evaluate_all. */
static void run_head(const fh_workspace *ws, const fh_grpo_batch *bt, const fh_grpo_options *o, int64_t vocab,
                     double grad, const fh_grpo_head_outputs *out)
{
    fh_grpo_head h = fh_grpo_head_in(ws, bt, o, vocab);
    fh_grpo_head_prepare(&h, ws->slot[FH_LOGPROB_SLOT_LOGP]);
    (void)fh_grpo_head_entropy_threshold(&h, ws->slot[FH_LOGPROB_SLOT_ENTROPY], NULL); /* cannot fail alone */
    evaluate_all(&h, ws, grad, out);
}

/* Streams the forward; leaves lse, sum_pz, logp and entropy (double) in the workspace. */
static fh_status forward_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin, const fh_grpo_batch *bt,
                         const fh_grpo_options *o)
{
    const fh_token_stats stats = fh_logprob_stats_in(ws, 1);
    fh_engine_pass pass = fh_grpo_pass(plan, ws, lin, bt->completion_ids, o);
    pass.stats = &stats;
    const fh_status st = fh_engine_forward(&pass);
    if (st == FH_OK)
        fh_logprob_token_values(ws, bt->completion_ids, 0, lin->n, lin->vocab, 1);
    return st;
}

void fh_grpo_write_outputs(const fh_workspace *ws, int64_t n, fh_grpo_outputs *out)
{
    const fh_logprob_rows every_row = {NULL, 0};
    fh_logprob_write_outputs(ws, n, every_row, out->per_token_logp, out->entropy, out->lse);
}

fh_grpo_head_outputs fh_grpo_backward_outputs(const fh_workspace *ws, fh_grpo_outputs *forward_out)
{
    const fh_grpo_head_outputs hout = {forward_out ? forward_out->loss : NULL,
                                       forward_out ? forward_out->metrics : NULL,
                                       forward_out ? forward_out->per_token_loss : NULL,
                                       ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B], ws->slot[FH_LOGPROB_SLOT_G_ENTROPY_THEN_E]};
    return hout;
}

fh_coef_arrays fh_grpo_coefs_in(const fh_workspace *ws, int64_t n)
{
    double *a = ws->slot[FH_LOGPROB_SLOT_Z_TARGET_THEN_A], *b = ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B],
           *c = ws->slot[FH_LOGPROB_SLOT_SUM_EXP_THEN_C], *e = ws->slot[FH_LOGPROB_SLOT_G_ENTROPY_THEN_E];
    /* dZ_j = g_logp (onehot_j - p_j) - g_H p_j (z_j - sum_pz): a = -g_logp, b = g_logp, e = -g_H. */
    for (int64_t i = 0; i < n; i++) {
        a[i] = -b[i];
        c[i] = 0.0;
        e[i] = -e[i];
    }
    const fh_coef_arrays coefs = {ws->slot[FH_LOGPROB_SLOT_LSE], a, b, c, e, ws->slot[FH_LOGPROB_SLOT_SUM_PZ]};
    return coefs;
}

/* The backward's GEMMs made ready, before any output is written (fh_engine_prepare). */
static fh_status prepare_backward(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin,
                                  const fh_grpo_batch *bt, const fh_grpo_options *o, const fh_linear_grads *grads)
{
    fh_engine_pass pass = fh_grpo_pass(plan, ws, lin, bt->completion_ids, o);
    pass.grads = grads;
    return fh_engine_prepare(&pass);
}

/* Coefficients from logp/entropy/lse in the workspace, then the engine's backward (prepared). */
static fh_status backward_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin,
                               const fh_grpo_batch *bt, const fh_grpo_options *o, double grad,
                               const fh_linear_grads *grads, fh_grpo_outputs *forward_out)
{
    const fh_grpo_head_outputs hout = fh_grpo_backward_outputs(ws, forward_out);
    run_head(ws, bt, o, lin->vocab, grad, &hout);
    const fh_coef_arrays coefs = fh_grpo_coefs_in(ws, lin->n);
    fh_engine_pass pass = fh_grpo_pass(plan, ws, lin, bt->completion_ids, o);
    pass.coefs = &coefs;
    pass.grads = grads;
    return fh_engine_backward(&pass);
}

/* The call's outputs (out may be NULL), for the overlap checks. */
enum { GRPO_OUTPUTS = 6 };
static void output_buffers(const fh_linear *lin, const fh_grpo_outputs *out, fh_buffer outputs[GRPO_OUTPUTS])
{
    const size_t floats = (size_t)lin->n * sizeof(float);
    const fh_buffer list[GRPO_OUTPUTS] = {{"loss", out ? out->loss : NULL, sizeof(double)},
                                          {"metrics", out ? out->metrics : NULL, sizeof(fh_grpo_metrics)},
                                          {"per_token_logp", out ? out->per_token_logp : NULL, floats},
                                          {"per_token_loss", out ? out->per_token_loss : NULL, floats},
                                          {"entropy", out ? out->entropy : NULL, floats},
                                          {"lse", out ? out->lse : NULL, floats}};
    memcpy(outputs, list, sizeof list);
}

/* ---- over a support (fh_grpo_batch.support): the policy's log-probs and entropies over each token's support, TRL's
 * policy math unchanged --------------------------------------------------------------------------- */

/* One call over the support after the call's checks: a forward (grads NULL, out given), a backward from the saved
 * values (saved_logp given) or the single call. */
static fh_status support_call(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt, const fh_grpo_options *o,
                              const float *saved_logp, const float *saved_lse, const float *saved_entropy, double grad,
                              fh_grpo_outputs *out, const fh_linear_grads *grads)
{
    fh_buffer outputs[GRPO_OUTPUTS];
    output_buffers(lin, out, outputs);
    const fh_support_rows rows = {bt->completion_ids, 0, bt->completion_mask};
    fh_support_pass p;
    const fh_transform tf = fh_engine_transform_of(o->temperature, 0.0, 1.0);
    const fh_status st = fh_support_pass_begin(ctx, lin, rows, bt->support, tf, grads, outputs, GRPO_OUTPUTS, &p);
    if (st != FH_OK)
        return st;
    if (saved_logp)
        fh_logprob_load_saved(&p.ws, lin->n, saved_logp, saved_lse, saved_entropy);
    else
        fh_support_pass_values(&p, 1);
    const fh_grpo_head_outputs forward_only = {out ? out->loss : NULL, out ? out->metrics : NULL,
                                               out ? out->per_token_loss : NULL, NULL, NULL};
    const fh_grpo_head_outputs hout = grads ? fh_grpo_backward_outputs(&p.ws, out) : forward_only;
    run_head(&p.ws, bt, o, lin->vocab, grad, &hout);
    if (grads) {
        const fh_coef_arrays coefs = fh_grpo_coefs_in(&p.ws, lin->n);
        fh_support_pass_gradients(&p, &coefs, grads);
    }
    /* Written after the head has read old_per_token_logps, which per_token_logp may replace. */
    if (out)
        fh_grpo_write_outputs(&p.ws, lin->n, out);
    return FH_OK;
}

fh_status fh_grpo_check_apart(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *bt,
                              const float *saved_logp, const float *saved_lse, const float *saved_entropy,
                              const float *grad_output, const fh_grpo_outputs *out, const fh_linear_grads *grads)
{
    const size_t n = (size_t)lin->n, floats = n * sizeof(float);
    const int in_place = out && out->per_token_logp && out->per_token_logp == bt->old_per_token_logps;
    const fh_buffer inputs[] = {{"completion_ids", bt->completion_ids, n * sizeof(int64_t)},
                                {"completion_mask", bt->completion_mask, floats},
                                {"advantages", bt->advantages, (size_t)bt->batch * sizeof(float)},
                                {"cu_seqlens", bt->cu_seqlens, ((size_t)bt->batch + 1) * sizeof(int64_t)},
                                {"old_per_token_logps", in_place ? NULL : bt->old_per_token_logps, floats},
                                {"ref_per_token_logps", bt->ref_per_token_logps, floats},
                                {"sampling_per_token_logps", bt->sampling_per_token_logps, floats},
                                {"the saved per_token_logp", saved_logp, floats},
                                {"the saved lse", saved_lse, floats},
                                {"the saved entropy", saved_entropy, floats},
                                {"grad_output", grad_output, sizeof(float)}};
    fh_buffer outputs[GRPO_OUTPUTS];
    output_buffers(lin, out, outputs);
    return fh_check_apart(ctx, lin, grads, outputs, GRPO_OUTPUTS, inputs, 11);
}

fh_status fh_grpo_check_saved(fh_context *ctx, const fh_grpo_options *o, const float *per_token_logp,
                              const float *lse, const float *entropy)
{
    const int needs_entropy = o->entropy_coef != 0.0 || o->top_entropy_quantile < 1.0;
    if (!per_token_logp || !lse || (needs_entropy && !entropy))
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL",
                       !per_token_logp ? "per_token_logp"
                       : !lse          ? "lse"
                                       : "entropy (entropy_coef != 0 or top_entropy_quantile < 1)");
    return FH_OK;
}

fh_status fh_grpo_check_grad_output(fh_context *ctx, const float *grad_output)
{
    if (!grad_output)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "grad_output is NULL");
    if (!isfinite(grad_output[0]))
        return fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output = %g is not finite", (double)grad_output[0]);
    return FH_OK;
}

FH_API fh_status fh_grpo_forward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                 const fh_grpo_options *options, fh_grpo_outputs *out)
{
    fh_status st = fh_grpo_check_call(ctx, lin, batch, options, 0);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = fh_grpo_check_apart(ctx, lin, batch, NULL, NULL, NULL, NULL, out, NULL);
    if (st == FH_OK && batch->support)
        return support_call(ctx, lin, batch, options, NULL, NULL, NULL, 1.0, out, NULL);
    fh_plan plan;
    fh_workspace ws;
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_FORWARD, &plan, &ws);
    if (st != FH_OK)
        return st;
    st = forward_pass(&plan, &ws, lin, batch, options);
    if (st != FH_OK)
        return fh_gemm_failure(ctx, st);
    const fh_grpo_head_outputs hout = {out->loss, out->metrics, out->per_token_loss, NULL, NULL};
    run_head(&ws, batch, options, lin->vocab, 1.0, &hout);
    fh_grpo_write_outputs(&ws, lin->n, out);
    return FH_OK;
}

FH_API fh_status fh_grpo_backward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                  const fh_grpo_options *options, const float *per_token_logp, const float *lse,
                                  const float *entropy, const float *grad_output, fh_linear_grads *grads)
{
    fh_status st = fh_grpo_check_call(ctx, lin, batch, options, 0);
    if (st == FH_OK)
        st = fh_grpo_check_saved(ctx, options, per_token_logp, lse, entropy);
    if (st == FH_OK)
        st = fh_grpo_check_grad_output(ctx, grad_output);
    if (st == FH_OK)
        st = fh_check_grads(ctx, lin, grads);
    if (st == FH_OK)
        st = fh_grpo_check_apart(ctx, lin, batch, per_token_logp, lse, entropy, grad_output, NULL, grads);
    if (st == FH_OK && batch->support)
        return support_call(ctx, lin, batch, options, per_token_logp, lse, entropy, grad_output[0], NULL, grads);
    fh_plan plan;
    fh_workspace ws;
    if (st == FH_OK)
        st = fh_prepare_pass(ctx, lin, FH_CALL_BACKWARD, &plan, &ws);
    if (st != FH_OK)
        return st;
    st = prepare_backward(&plan, &ws, lin, batch, options, grads);
    if (st != FH_OK)
        return fh_gemm_failure(ctx, st);
    fh_logprob_load_saved(&ws, lin->n, per_token_logp, lse, entropy);
    return fh_gemm_failure(ctx, backward_pass(&plan, &ws, lin, batch, options, grad_output[0], grads, NULL));
}

/* ---- the single-call step in row blocks of whole sequences -------------------------------------- */

void fh_grpo_block_coefficients(fh_grpo_head *h, const fh_workspace *ws, int64_t vocab, double grad,
                                const fh_row_block *block)
{
    const fh_grpo_batch *bt = h->bt;
    double *const *slot = ws->slot;
    const int64_t b0 = block->first_group, b1 = block->end_group;
    fh_logprob_token_values(ws, bt->completion_ids, block->first_row, block->first_row + block->rows, vocab, 1);
    fh_grpo_head_log_ratios(h, slot[FH_LOGPROB_SLOT_LOGP], b0, b1);
    const fh_grpo_head_outputs coefs = {NULL, NULL, NULL, slot[FH_LOGPROB_SLOT_G_LOGP_AS_B],
                                        slot[FH_LOGPROB_SLOT_G_ENTROPY_THEN_E]};
    fh_grpo_partials unused;
    fh_grpo_head_evaluate(h, b0, b1, slot[FH_LOGPROB_SLOT_LOGP], slot[FH_LOGPROB_SLOT_ENTROPY], grad, &coefs, &unused);
}

void fh_grpo_row_coefficients(const fh_workspace *ws, int64_t i, fh_coef *k)
{
    const double g_logp = ws->slot[FH_LOGPROB_SLOT_G_LOGP_AS_B][i];
    k->a = -g_logp;
    k->b = g_logp;
    k->c = 0.0;
    k->e = -ws->slot[FH_LOGPROB_SLOT_G_ENTROPY_THEN_E][i];
}

/* The single-process pass's hook and rows (self: the sequence_blocks below). */
typedef struct sequence_blocks {
    fh_grpo_head *h;
    const fh_workspace *ws;
    int64_t vocab;
    double grad;
} sequence_blocks;

static fh_status block_coefficients(const void *self, const fh_row_block *block, const fh_token_stats *stats)
{
    const sequence_blocks *s = self;
    (void)stats; /* the same arrays as the workspace's slots */
    fh_grpo_block_coefficients(s->h, s->ws, s->vocab, s->grad, block);
    return FH_OK;
}

static void row_coefficients(const void *self, int64_t i, const fh_final_stats *stats, fh_coef *k)
{
    (void)stats;
    fh_grpo_row_coefficients(((const sequence_blocks *)self)->ws, i, k);
}

/* One pass over row blocks of whole sequences (6 N H V flops), then the loss, metrics and per-token outputs
 * from the statistics it left in the workspace. */
static fh_status sequence_block_step(const fh_plan *plan, const fh_workspace *ws, const fh_linear *lin,
                                     const fh_grpo_batch *bt, const fh_grpo_options *o, double grad,
                                     const fh_linear_grads *grads, fh_grpo_outputs *out)
{
    fh_grpo_head h = fh_grpo_head_in(ws, bt, o, lin->vocab);
    fh_grpo_head_count(&h);
    const sequence_blocks self = {&h, ws, lin->vocab, grad};
    const fh_coef_source source = {row_coefficients, block_coefficients, &self};
    const fh_token_stats stats = fh_logprob_stats_in(ws, 1);
    const fh_row_groups groups = fh_sequence_groups(bt->batch, bt->seq, bt->cu_seqlens, 0);
    fh_engine_pass pass = fh_grpo_pass(plan, ws, lin, bt->completion_ids, o);
    pass.stats = &stats;
    pass.source = &source;
    pass.grads = grads;
    pass.groups = &groups;
    const fh_status st = fh_engine_row_blocks(&pass);
    if (st != FH_OK)
        return st;
    const fh_grpo_head_outputs hout = {out->loss, out->metrics, out->per_token_loss, NULL, NULL};
    evaluate_all(&h, ws, grad, &hout);
    fh_grpo_write_outputs(ws, lin->n, out);
    return FH_OK;
}

/* The call's arguments, for its train step (fh_engine_train_step). */
typedef struct grpo_step {
    const fh_linear *lin;
    const fh_grpo_batch *batch;
    const fh_grpo_options *options;
    double grad;
    fh_grpo_outputs *out;
} grpo_step;

static fh_status grpo_step_run(const void *self, int row_blocks, const fh_plan plans[2], const fh_workspace ws[2],
                               const fh_linear_grads *grads)
{
    const grpo_step *c = self;
    if (row_blocks)
        return sequence_block_step(&plans[0], &ws[0], c->lin, c->batch, c->options, c->grad, grads, c->out);
    fh_status st = prepare_backward(&plans[1], &ws[1], c->lin, c->batch, c->options, grads);
    if (st == FH_OK)
        st = forward_pass(&plans[0], &ws[0], c->lin, c->batch, c->options);
    if (st == FH_OK)
        st = backward_pass(&plans[1], &ws[1], c->lin, c->batch, c->options, c->grad, grads, c->out);
    /* Written after the backward has read old_per_token_logps, which per_token_logp may replace (the slots hold). */
    if (st == FH_OK)
        fh_grpo_write_outputs(&ws[0], c->lin->n, c->out);
    return st;
}

FH_API fh_status fh_grpo_forward_backward(fh_context *ctx, const fh_linear *lin, const fh_grpo_batch *batch,
                                          const fh_grpo_options *options, const float *grad_output,
                                          fh_grpo_outputs *out, fh_linear_grads *grads)
{
    fh_status st = fh_grpo_check_call(ctx, lin, batch, options, 0);
    if (st == FH_OK && !out)
        st = fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (st == FH_OK)
        st = fh_grpo_check_grad_output(ctx, grad_output);
    if (st == FH_OK)
        st = fh_check_grads(ctx, lin, grads);
    if (st == FH_OK)
        st = fh_grpo_check_apart(ctx, lin, batch, NULL, NULL, NULL, grad_output, out, grads);
    if (st != FH_OK)
        return st;
    if (batch->support)
        return support_call(ctx, lin, batch, options, NULL, NULL, NULL, grad_output[0], out, grads);
    const grpo_step step = {lin, batch, options, grad_output[0], out};
    /* The entropy threshold needs every token's entropy before any coefficient: the streaming passes. */
    const fh_row_groups groups = fh_sequence_groups(batch->batch, batch->seq, batch->cu_seqlens, 0);
    const fh_train_step_head head = {.group_rows = batch->seq,
                                     .groups = batch->cu_seqlens ? &groups : NULL,
                                     .forward_plan = 1,
                                     .streaming_only = options->top_entropy_quantile < 1.0,
                                     .run = grpo_step_run,
                                     .self = &step};
    return fh_engine_train_step(ctx, lin, grads, &head);
}
