/* Contracts of the GRPO entry points, asserted exactly (the style of test_contracts.c):
 *   - each invalid argument returns its own documented status from fh_grpo_forward, fh_grpo_backward and
 *     fh_grpo_forward_backward (where the call takes it), leaves every output buffer bit-identical (pre-filled
 *     with a canary) and every input untouched, and the context message is non-empty and names the problem;
 *   - out-of-range ids under the mask are accepted; so are the option combinations TRL's checks let through (the
 *     vLLM importance-sampling options when the correction is off, vespo with a sequence mode on a batch without
 *     sampler log-probs, a negative VESPO lambda, which TRL clamps); documented equivalent option spellings
 *     (delta NaN / 0, epsilon_high NaN / epsilon_low, num_items_in_batch 0 / negative and 0.25 / 1,
 *     max_completion_length 0 / negative / T, the correction off / no sampler log-probs, VESPO lambda below 1e-4 /
 *     1e-4) give bitwise identical results;
 *   - fh_grpo_workspace_size: a caller workspace of exactly that size works for all three calls (nothing written
 *     outside it), one byte less fails with FH_ERR_WORKSPACE_TOO_SMALL and untouched outputs; the query's own
 *     argument checks and purity;
 *   - fh_grpo_options_init's documented defaults; optional outputs. */
#include "ce_case.h"
#include "contract_driver.h"
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, T = 3, N = B * T, H = 4, V = 7 };

/* Everything a call writes, in one block so that one memcmp covers it. */
typedef struct outputs {
    double loss;
    fh_grpo_metrics metrics;
    float logp[N], per_token_loss[N], entropy[N], lse[N];
    float dx[N * H], dweight[H * V], dbias[V];
} outputs;

/* Everything a call reads. saved_*: what a successful forward wrote, for the backward. */
typedef struct inputs {
    float x[N * H], weight[H * V], bias[V];
    int64_t ids[N];
    float mask[N], adv[B], old[N], ref[N], samp[N], grad_output[1];
    float saved_logp[N], saved_lse[N], saved_entropy[N];
} inputs;

typedef struct fixture {
    fh_context *ctx;
    inputs in;
    outputs out;
    fh_linear lin;
    fh_grpo_batch batch;
    fh_grpo_options options;
    fh_grpo_outputs fwd_out;
    fh_linear_grads grads;
    /* what gets passed */
    fh_context *call_ctx;
    const fh_linear *call_lin;
    const fh_grpo_batch *call_batch;
    const fh_grpo_options *call_options;
    fh_grpo_outputs *call_out;
    const float *call_logp, *call_lse, *call_entropy, *call_grad_output;
    fh_linear_grads *call_grads;
} fixture;

/* A valid call using every input: bias, old, ref and sampler log-probs (beta 0.04; the vLLM importance-sampling
 * correction at its defaults, sequence_mask below 3), entropy_coef 0.01 (the backward needs the entropy), delta,
 * GSPO off, dapo (the default); row 1 padded at its end with an out-of-range id under the mask. */
static void fixture_init(void *fixture_)
{
    fixture *f = fixture_;
    memset(f, 0, sizeof *f);
    TU_CHECK(fh_context_create(&f->ctx) == FH_OK, "fh_context_create");
    uint64_t rng = 4242;
    tu_fill_uniform(f->in.x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.weight, H * V, &rng, -1.0, 1.0);
    for (int j = 0; j < V; j++)
        f->in.bias[j] = (float)(ref_uniform(&rng) - 0.5);
    for (int i = 0; i < N; i++) {
        f->in.ids[i] = (int64_t)(ref_uniform(&rng) * V);
        f->in.mask[i] = 1.0f;
        f->in.old[i] = (float)(-2.0 + ref_uniform(&rng));
        f->in.samp[i] = f->in.old[i] + (float)(0.2 * (ref_uniform(&rng) - 0.5));
        f->in.ref[i] = (float)(-2.0 + ref_uniform(&rng));
    }
    f->in.mask[N - 1] = 0.0f;
    f->in.ids[N - 1] = -100;
    f->in.adv[0] = 0.5f;
    f->in.adv[1] = -0.75f;
    f->in.grad_output[0] = 1.0f;
    fh_linear_init(&f->lin, N, H, V, f->in.x, f->in.weight, FH_LAYOUT_HV, f->in.bias);
    const fh_grpo_batch batch = {B, T, f->in.ids, f->in.mask, f->in.adv, f->in.old, f->in.ref, f->in.samp, NULL, NULL};
    f->batch = batch;
    fh_grpo_options_init(&f->options);
    f->options.beta = 0.04;
    f->options.entropy_coef = 0.01;
    f->options.delta = 1.5;
    const fh_grpo_outputs fo = {&f->out.loss, &f->out.metrics, f->out.logp, f->out.per_token_loss, f->out.entropy,
                                f->out.lse};
    f->fwd_out = fo;
    const fh_linear_grads g = {.dx = f->out.dx, .dx_row_stride = H, .dx_beta = 0.0f, .dweight = f->out.dweight, .dweight_beta = 0.0f, .dbias = f->out.dbias, .dbias_beta = 0.0f};
    f->grads = g;
    const fh_status st = fh_grpo_forward(f->ctx, &f->lin, &f->batch, &f->options, &f->fwd_out);
    TU_CHECK(st == FH_OK, "fixture forward: %d", (int)st);
    memcpy(f->in.saved_logp, f->out.logp, sizeof f->in.saved_logp);
    memcpy(f->in.saved_lse, f->out.lse, sizeof f->in.saved_lse);
    memcpy(f->in.saved_entropy, f->out.entropy, sizeof f->in.saved_entropy);
    tu_fill_canary(&f->out, sizeof f->out);
    f->call_ctx = f->ctx;
    f->call_lin = &f->lin;
    f->call_batch = &f->batch;
    f->call_options = &f->options;
    f->call_out = &f->fwd_out;
    f->call_logp = f->in.saved_logp;
    f->call_lse = f->in.saved_lse;
    f->call_entropy = f->in.saved_entropy;
    f->call_grad_output = f->in.grad_output;
    f->call_grads = &f->grads;
}

enum { FWD = 1, BWD = 2, STEP = 4, ALL = 7 };

static fh_status call(void *fixture_, int which)
{
    const fixture *f = fixture_;
    switch (which) {
    case FWD: return fh_grpo_forward(f->call_ctx, f->call_lin, f->call_batch, f->call_options, f->call_out);
    case BWD:
        return fh_grpo_backward(f->call_ctx, f->call_lin, f->call_batch, f->call_options, f->call_logp, f->call_lse,
                                f->call_entropy, f->call_grad_output, f->call_grads);
    default:
        return fh_grpo_forward_backward(f->call_ctx, f->call_lin, f->call_batch, f->call_options,
                                        f->call_grad_output, f->call_out, f->call_grads);
    }
}

static const char *call_name(int which)
{
    return which == FWD ? "fh_grpo_forward" : which == BWD ? "fh_grpo_backward" : "fh_grpo_forward_backward";
}

#define OUT(name, member, calls, kind) CD_OUTPUT(fixture, name, member, calls, kind)
static const cd_output parts[] = {
    OUT("loss", loss, FWD | STEP, CD_F64),
    OUT("metrics", metrics, FWD | STEP, CD_BYTES),
    OUT("per_token_logp", logp, FWD | STEP, CD_F32),
    OUT("per_token_loss", per_token_loss, FWD | STEP, CD_F32),
    OUT("entropy", entropy, FWD | STEP, CD_F32),
    OUT("lse", lse, FWD | STEP, CD_F32),
    OUT("dx", dx, BWD | STEP, CD_F32),
    OUT("dweight", dweight, BWD | STEP, CD_F32),
    OUT("dbias", dbias, BWD | STEP, CD_F32),
};
#undef OUT
static const cd_api api = {CD_FIXTURE(fixture), .init = fixture_init, .call = call, .call_name = call_name,
                           .all = ALL, .parts = parts, .part_count = TU_COUNT(parts)};

/* ---- the invalid arguments ---- */
#define MUTATION(fn, body) \
    static void fn(void *fixture_) { fixture *f = fixture_; body; }
MUTATION(null_ctx, f->call_ctx = NULL)
MUTATION(null_lin, f->call_lin = NULL)
MUTATION(null_x, f->lin.x = NULL)
MUTATION(null_batch, f->call_batch = NULL)
MUTATION(null_ids, f->batch.completion_ids = NULL)
MUTATION(null_mask, f->batch.completion_mask = NULL)
MUTATION(null_advantages, f->batch.advantages = NULL)
MUTATION(null_ref_with_beta, f->batch.ref_per_token_logps = NULL)
MUTATION(null_options, f->call_options = NULL)
MUTATION(null_outputs, f->call_out = NULL)
MUTATION(null_logp, f->call_logp = NULL)
MUTATION(null_lse, f->call_lse = NULL)
MUTATION(null_entropy_with_coef, f->call_entropy = NULL)
MUTATION(null_grad_output, f->call_grad_output = NULL)
MUTATION(null_grads, f->call_grads = NULL)
MUTATION(batch_too_large, f->batch.batch = B + 1)
MUTATION(seq_too_small, f->batch.seq = T - 1)
MUTATION(batch_seq_swapped_wrong, (f->batch.batch = 1, f->batch.seq = N + 1))
MUTATION(batch_zero, f->batch.batch = 0)
MUTATION(seq_negative, f->batch.seq = -T)
MUTATION(batch_seq_overflow, (f->batch.batch = INT64_MAX / 2, f->batch.seq = 4))
MUTATION(n_zero, f->lin.n = 0)
MUTATION(x_stride_short, f->lin.x_row_stride = H - 1)
MUTATION(mask_negative, f->in.mask[2] = -1.0f)
MUTATION(mask_nan, f->in.mask[0] = NAN)
MUTATION(mask_inf, f->in.mask[N - 1] = INFINITY) /* at the padded position: the value itself is checked */
MUTATION(mask_tiny_negative, f->in.mask[3] = -FLT_TRUE_MIN)
MUTATION(id_equals_vocab, f->in.ids[1] = V)
MUTATION(id_minus_one, f->in.ids[0] = -1)
MUTATION(id_minus_100_unmasked, f->in.ids[4] = -100)
MUTATION(masked_id_unmasked, f->in.mask[N - 1] = 1.0f) /* the -100 id at the padded position becomes live */
MUTATION(temperature_zero, f->options.temperature = 0.0)
MUTATION(temperature_negative, f->options.temperature = -1.0)
MUTATION(temperature_nan, f->options.temperature = NAN)
MUTATION(temperature_tiny, f->options.temperature = 1e-45) /* 1 / temperature overflows fp32 */
MUTATION(temperature_inf, f->options.temperature = INFINITY)
MUTATION(temperature_huge, f->options.temperature = 1e39) /* 1 / temperature below FLT_MIN */
MUTATION(loss_type_nine, f->options.loss_type = (fh_grpo_loss_type)9)
MUTATION(loss_type_negative, f->options.loss_type = (fh_grpo_loss_type)-1)
MUTATION(is_level_five, f->options.importance_sampling_level = (fh_grpo_is_level)5)
MUTATION(is_level_negative, f->options.importance_sampling_level = (fh_grpo_is_level)-1)
MUTATION(epsilon_low_negative, f->options.epsilon_low = -0.1)
MUTATION(epsilon_low_nan, f->options.epsilon_low = NAN)
MUTATION(epsilon_low_inf, f->options.epsilon_low = INFINITY)
MUTATION(epsilon_high_negative, f->options.epsilon_high = -0.1)
MUTATION(epsilon_high_inf, f->options.epsilon_high = INFINITY)
MUTATION(beta_negative, f->options.beta = -1.0)
MUTATION(beta_nan, f->options.beta = NAN)
MUTATION(beta_inf, f->options.beta = INFINITY)
MUTATION(sapo_pos_zero, (f->options.loss_type = FH_GRPO_LOSS_SAPO, f->options.sapo_temperature_pos = 0.0))
MUTATION(sapo_neg_zero, (f->options.loss_type = FH_GRPO_LOSS_SAPO, f->options.sapo_temperature_neg = 0.0))
MUTATION(sapo_neg_negative, (f->options.loss_type = FH_GRPO_LOSS_SAPO, f->options.sapo_temperature_neg = -1.05))
MUTATION(sapo_pos_nan, (f->options.loss_type = FH_GRPO_LOSS_SAPO, f->options.sapo_temperature_pos = NAN))
MUTATION(sapo_pos_inf, (f->options.loss_type = FH_GRPO_LOSS_SAPO, f->options.sapo_temperature_pos = INFINITY))
MUTATION(delta_negative, f->options.delta = -1.0)
MUTATION(delta_inf, f->options.delta = INFINITY)
MUTATION(entropy_coef_nan, f->options.entropy_coef = NAN)
MUTATION(entropy_coef_inf, f->options.entropy_coef = -INFINITY)
MUTATION(num_items_nan, f->options.num_items_in_batch = NAN)
MUTATION(num_items_inf, f->options.num_items_in_batch = INFINITY)
MUTATION(grad_output_nan, f->in.grad_output[0] = NAN)
MUTATION(grad_output_inf, f->in.grad_output[0] = INFINITY)
MUTATION(dx_beta_half, f->grads.dx_beta = 0.5f)
MUTATION(dbias_beta_nan, f->grads.dbias_beta = NAN)
MUTATION(dx_stride_short, f->grads.dx_row_stride = H - 1)
MUTATION(dbias_without_bias, f->lin.bias = NULL)
MUTATION(budget_one, fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, 1))
MUTATION(nonfinite_x_checked, (fh_context_set(f->ctx, FH_PARAM_CHECK_FINITE, 1), f->in.x[5] = NAN))
/* Outputs over inputs (README, Conventions: FH_ERR_OVERLAPPING_BUFFERS); per_token_logp exactly over old is the
 * allowed in-place form (test_in_place.c), one float off is not. */
MUTATION(ptl_over_mask, f->fwd_out.per_token_loss = f->in.mask)
MUTATION(lse_output_over_ref, f->fwd_out.lse = f->in.ref)
MUTATION(logp_one_off_old, f->fwd_out.per_token_logp = f->in.old + 1)
MUTATION(dx_over_saved_lse, f->grads.dx = f->in.saved_lse)
/* The options TRL added up to f2cd5771 (fusedhead.h: FH_ERR_INVALID_GRPO_OPTION). */
MUTATION(quantile_above_one, f->options.top_entropy_quantile = 1.5)
MUTATION(quantile_negative, f->options.top_entropy_quantile = -0.1)
MUTATION(quantile_nan, f->options.top_entropy_quantile = NAN)
MUTATION(off_policy_inf, f->options.off_policy_mask_threshold = INFINITY)
MUTATION(vespo_k_nan, (f->options.loss_type = FH_GRPO_LOSS_VESPO, f->options.vespo_k_pos = NAN))
MUTATION(vespo_lambda_inf, f->options.vespo_lambda_neg = INFINITY)
MUTATION(is_mode_four, f->options.vllm_importance_sampling_mode = (fh_grpo_vllm_is_mode)4)
MUTATION(is_mode_negative, f->options.vllm_importance_sampling_mode = (fh_grpo_vllm_is_mode)-1)
MUTATION(truncate_without_bounds, (f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_TOKEN_TRUNCATE,
                                   f->options.vllm_importance_sampling_clip_max = NAN))
MUTATION(sequence_truncate_without_bounds,
         (f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE,
          f->options.vllm_importance_sampling_clip_max = NAN))
/* ... made whenever the correction is on, as TRL's GRPOConfig does, with or without sampler log-probs */
MUTATION(truncate_without_bounds_no_samp, (f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_TOKEN_TRUNCATE,
                                           f->options.vllm_importance_sampling_clip_max = NAN,
                                           f->batch.sampling_per_token_logps = NULL))
MUTATION(clip_min_equals_max, f->options.vllm_importance_sampling_clip_min = 3.0)
MUTATION(clip_min_above_max, (f->options.vllm_importance_sampling_clip_min = 2.0,
                              f->options.vllm_importance_sampling_clip_max = 1.0))
MUTATION(clip_min_inf, (f->options.vllm_importance_sampling_clip_min = -INFINITY))
MUTATION(clip_max_inf, (f->options.vllm_importance_sampling_clip_max = INFINITY))
MUTATION(vespo_sequence_mode, f->options.loss_type = FH_GRPO_LOSS_VESPO) /* the default mode is sequence_mask */
MUTATION(vespo_sequence_truncate, (f->options.loss_type = FH_GRPO_LOSS_VESPO,
                                   f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE))
MUTATION(null_entropy_with_quantile, (f->options.entropy_coef = 0.0, f->options.top_entropy_quantile = 0.5,
                                      f->call_entropy = NULL))
MUTATION(ptl_over_samp, f->fwd_out.per_token_loss = f->in.samp)
MUTATION(logp_over_samp, f->fwd_out.per_token_logp = f->in.samp)
MUTATION(samp_over_entropy_output, f->batch.sampling_per_token_logps = f->out.entropy)
MUTATION(dx_over_samp, f->grads.dx = f->in.samp)

static const cd_case bad_cases[] = {
    {"NULL context", null_ctx, ALL, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, ALL, FH_ERR_NULL_POINTER, "lin"},
    {"NULL x", null_x, ALL, FH_ERR_NULL_POINTER, "x"},
    {"NULL batch", null_batch, ALL, FH_ERR_NULL_POINTER, "fh_grpo_batch"},
    {"NULL completion_ids", null_ids, ALL, FH_ERR_NULL_POINTER, "completion_ids"},
    {"NULL completion_mask", null_mask, ALL, FH_ERR_NULL_POINTER, "completion_mask"},
    {"NULL advantages", null_advantages, ALL, FH_ERR_NULL_POINTER, "advantages"},
    {"beta != 0 without ref_per_token_logps", null_ref_with_beta, ALL, FH_ERR_NULL_POINTER, "ref_per_token_logps"},
    {"NULL options", null_options, ALL, FH_ERR_NULL_POINTER, "options"},
    {"NULL outputs", null_outputs, FWD | STEP, FH_ERR_NULL_POINTER, "outputs"},
    {"backward without per_token_logp", null_logp, BWD, FH_ERR_NULL_POINTER, "per_token_logp"},
    {"backward without lse", null_lse, BWD, FH_ERR_NULL_POINTER, "lse"},
    {"backward without entropy, entropy_coef != 0", null_entropy_with_coef, BWD, FH_ERR_NULL_POINTER, "entropy"},
    {"NULL grad_output", null_grad_output, BWD | STEP, FH_ERR_NULL_POINTER, "grad_output"},
    {"NULL grads", null_grads, BWD | STEP, FH_ERR_NULL_POINTER, "fh_linear_grads"},
    {"batch * seq > n", batch_too_large, ALL, FH_ERR_INVALID_SIZE, "batch"},
    {"batch * seq < n", seq_too_small, ALL, FH_ERR_INVALID_SIZE, "seq"},
    {"batch 1 x seq n + 1", batch_seq_swapped_wrong, ALL, FH_ERR_INVALID_SIZE, "batch"},
    {"batch = 0", batch_zero, ALL, FH_ERR_INVALID_SIZE, "batch"},
    {"seq < 0", seq_negative, ALL, FH_ERR_INVALID_SIZE, "seq"},
    {"batch * seq overflows", batch_seq_overflow, ALL, FH_ERR_INVALID_SIZE, "batch"},
    {"n = 0", n_zero, ALL, FH_ERR_INVALID_SIZE, "n"},
    {"x_row_stride < hidden", x_stride_short, ALL, FH_ERR_INVALID_STRIDE, "stride"},
    {"mask -1", mask_negative, ALL, FH_ERR_INVALID_MASK, "completion_mask"},
    {"mask NaN", mask_nan, ALL, FH_ERR_INVALID_MASK, "completion_mask"},
    {"mask inf (padded position)", mask_inf, ALL, FH_ERR_INVALID_MASK, "completion_mask"},
    {"mask -denormal", mask_tiny_negative, ALL, FH_ERR_INVALID_MASK, "completion_mask"},
    {"id = V unmasked", id_equals_vocab, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "completion_ids"},
    {"id = -1 unmasked", id_minus_one, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "completion_ids"},
    {"id = -100 unmasked", id_minus_100_unmasked, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "completion_ids"},
    {"padded -100 id unmasked", masked_id_unmasked, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "completion_ids"},
    {"temperature 0", temperature_zero, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature -1", temperature_negative, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature NaN", temperature_nan, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature 1e-45", temperature_tiny, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature inf", temperature_inf, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"temperature 1e39", temperature_huge, ALL, FH_ERR_INVALID_TEMPERATURE, "temperature"},
    {"loss_type 9", loss_type_nine, ALL, FH_ERR_INVALID_GRPO_OPTION, "loss_type"},
    {"loss_type -1", loss_type_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "loss_type"},
    {"importance_sampling_level 5", is_level_five, ALL, FH_ERR_INVALID_GRPO_OPTION, "importance_sampling_level"},
    {"importance_sampling_level -1", is_level_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "importance_sampling_level"},
    {"epsilon_low -0.1", epsilon_low_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "epsilon_low"},
    {"epsilon_low NaN", epsilon_low_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "epsilon_low"},
    {"epsilon_low inf", epsilon_low_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "epsilon_low"},
    {"epsilon_high -0.1", epsilon_high_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "epsilon_high"},
    {"epsilon_high inf", epsilon_high_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "epsilon_high"},
    {"beta -1", beta_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "beta"},
    {"beta NaN", beta_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "beta"},
    {"beta inf", beta_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "beta"},
    {"sapo_temperature_pos 0", sapo_pos_zero, ALL, FH_ERR_INVALID_GRPO_OPTION, "SAPO"},
    {"sapo_temperature_neg 0", sapo_neg_zero, ALL, FH_ERR_INVALID_GRPO_OPTION, "SAPO"},
    {"sapo_temperature_neg -1.05", sapo_neg_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "SAPO"},
    {"sapo_temperature_pos NaN", sapo_pos_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "SAPO"},
    {"sapo_temperature_pos inf", sapo_pos_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "SAPO"},
    {"delta -1", delta_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "delta"},
    {"delta inf", delta_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "delta"},
    {"entropy_coef NaN", entropy_coef_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "entropy_coef"},
    {"entropy_coef -inf", entropy_coef_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "entropy_coef"},
    {"num_items_in_batch NaN", num_items_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "num_items_in_batch"},
    {"num_items_in_batch inf", num_items_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "num_items_in_batch"},
    {"grad_output NaN", grad_output_nan, BWD | STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output inf", grad_output_inf, BWD | STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"dx_beta 0.5", dx_beta_half, BWD | STEP, FH_ERR_INVALID_BETA, "dx_beta"},
    {"dbias_beta NaN", dbias_beta_nan, BWD | STEP, FH_ERR_INVALID_BETA, "dbias_beta"},
    {"dx_row_stride < hidden", dx_stride_short, BWD | STEP, FH_ERR_INVALID_STRIDE, "dx"},
    {"dbias requested without bias", dbias_without_bias, BWD | STEP, FH_ERR_NULL_POINTER, "bias"},
    {"memory budget 1 byte", budget_one, ALL, FH_ERR_BUDGET_TOO_SMALL, "budget"},
    {"NaN in x with FH_PARAM_CHECK_FINITE", nonfinite_x_checked, ALL, FH_ERR_NONFINITE_INPUT, NULL},
    {"per_token_loss over the mask", ptl_over_mask, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "per_token_loss"},
    {"lse output over ref_per_token_logps", lse_output_over_ref, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "lse"},
    {"per_token_logp one float off old_per_token_logps", logp_one_off_old, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS,
     "per_token_logp"},
    {"dx over the saved lse", dx_over_saved_lse, BWD, FH_ERR_OVERLAPPING_BUFFERS, "dx"},
    {"top_entropy_quantile 1.5", quantile_above_one, ALL, FH_ERR_INVALID_GRPO_OPTION, "top_entropy_quantile"},
    {"top_entropy_quantile -0.1", quantile_negative, ALL, FH_ERR_INVALID_GRPO_OPTION, "top_entropy_quantile"},
    {"top_entropy_quantile NaN", quantile_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "top_entropy_quantile"},
    {"off_policy_mask_threshold inf", off_policy_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "off_policy_mask_threshold"},
    {"vespo_k_pos NaN", vespo_k_nan, ALL, FH_ERR_INVALID_GRPO_OPTION, "VESPO"},
    {"vespo_lambda_neg inf (any loss type)", vespo_lambda_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "VESPO"},
    {"vllm_importance_sampling_mode 4", is_mode_four, ALL, FH_ERR_INVALID_GRPO_OPTION,
     "vllm_importance_sampling_mode"},
    {"vllm_importance_sampling_mode -1", is_mode_negative, ALL, FH_ERR_INVALID_GRPO_OPTION,
     "vllm_importance_sampling_mode"},
    {"token_truncate without a bound", truncate_without_bounds, ALL, FH_ERR_INVALID_GRPO_OPTION, "truncate"},
    {"sequence_truncate without a bound", sequence_truncate_without_bounds, ALL, FH_ERR_INVALID_GRPO_OPTION,
     "truncate"},
    {"token_truncate without a bound, no sampler log-probs", truncate_without_bounds_no_samp, ALL,
     FH_ERR_INVALID_GRPO_OPTION, "truncate"},
    {"clip_min == clip_max", clip_min_equals_max, ALL, FH_ERR_INVALID_GRPO_OPTION, "clip_min"},
    {"clip_min > clip_max", clip_min_above_max, ALL, FH_ERR_INVALID_GRPO_OPTION, "clip_min"},
    {"clip_min -inf", clip_min_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "clip_min"},
    {"clip_max inf", clip_max_inf, ALL, FH_ERR_INVALID_GRPO_OPTION, "clip_max"},
    {"vespo with sequence_mask where the correction applies", vespo_sequence_mode, ALL, FH_ERR_INVALID_GRPO_OPTION,
     "vespo"},
    {"vespo with sequence_truncate where the correction applies", vespo_sequence_truncate, ALL,
     FH_ERR_INVALID_GRPO_OPTION, "vespo"},
    {"backward without entropy, top_entropy_quantile < 1", null_entropy_with_quantile, BWD, FH_ERR_NULL_POINTER,
     "entropy"},
    {"per_token_loss over sampling_per_token_logps", ptl_over_samp, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS,
     "per_token_loss"},
    {"per_token_logp over sampling_per_token_logps", logp_over_samp, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS,
     "per_token_logp"},
    {"sampling_per_token_logps over the entropy output", samp_over_entropy_output, FWD | STEP,
     FH_ERR_OVERLAPPING_BUFFERS, "entropy"},
    {"dx over sampling_per_token_logps", dx_over_samp, BWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "dx"},
};

static void test_bad_arguments(void)
{
    cd_run_bad_arguments(&api, bad_cases, TU_COUNT(bad_cases));
}

/* After a success, an error sets a message and the next success clears it. */
MUTATION(loss_type_dapo, f->options.loss_type = FH_GRPO_LOSS_DAPO)
static const cd_case error_then_success[] = {
    {"loss_type 9", loss_type_nine, ALL, FH_ERR_INVALID_GRPO_OPTION, "loss_type"},
    {"loss_type dapo", loss_type_dapo, ALL, FH_OK, NULL},
};

static void test_valid_calls(void)
{
    cd_run_valid_calls(&api, error_then_success, TU_COUNT(error_then_success), NULL);
}

/* Ids outside [0, V) under the mask (-1, V, INT64_MIN, INT64_MAX) are accepted; per_token_logp is 0 there. */
static void test_masked_out_of_range_ids_accepted(void)
{
    static const int64_t ids[] = {-1, V, INT64_MIN, INT64_MAX, -100};
    for (size_t k = 0; k < TU_COUNT(ids); k++)
        for (int which = FWD; which <= STEP; which *= 2) {
            fixture f;
            fixture_init(&f);
            f.in.ids[N - 1] = ids[k]; /* mask 0 there */
            const fh_status st = call(&f, which);
            TU_CHECK(st == FH_OK, "%s with masked id %lld: status %d", call_name(which), (long long)ids[k], (int)st);
            if (which != BWD)
                TU_CHECK(f.out.logp[N - 1] == 0.0f, "masked id %lld: per_token_logp %g", (long long)ids[k],
                         (double)f.out.logp[N - 1]);
            fh_context_destroy(f.ctx);
        }
}

/* What TRL lets through is accepted by every call: the importance-sampling options are not checked with the
 * correction off; vespo takes a sequence mode where the correction does not apply (no sampler log-probs, or the
 * correction off); a VESPO lambda below 1e-4 (TRL clamps it); the entropy mask with q = 0 (the largest entropy)
 * and q = 1 (off). */
MUTATION(correction_off_bad_bounds, (f->options.vllm_importance_sampling_correction = 0,
                                     f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_TOKEN_TRUNCATE,
                                     f->options.vllm_importance_sampling_clip_min = 5.0,
                                     f->options.vllm_importance_sampling_clip_max = NAN))
MUTATION(vespo_sequence_no_samp, (f->options.loss_type = FH_GRPO_LOSS_VESPO, f->batch.sampling_per_token_logps = NULL))
MUTATION(vespo_sequence_correction_off, (f->options.loss_type = FH_GRPO_LOSS_VESPO,
                                         f->options.vllm_importance_sampling_correction = 0))
MUTATION(vespo_token_mode_negative_lambda,
         (f->options.loss_type = FH_GRPO_LOSS_VESPO,
          f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_TOKEN_MASK, f->options.vespo_lambda_pos = -2.0,
          f->options.vespo_lambda_neg = 0.0))
MUTATION(quantile_zero, f->options.top_entropy_quantile = 0.0)
MUTATION(quantile_one_luspo, (f->options.top_entropy_quantile = 1.0, f->options.loss_type = FH_GRPO_LOSS_LUSPO))
MUTATION(every_option, (f->options.top_entropy_quantile = 0.5, f->options.off_policy_mask_threshold = 0.0,
                        f->options.use_bias_correction_kl = 1,
                        f->options.vllm_importance_sampling_mode = FH_GRPO_VLLM_IS_SEQUENCE_TRUNCATE,
                        f->options.vllm_importance_sampling_clip_min = 0.5))
static const cd_case accepted[] = {
    {"the correction off: its options unchecked", correction_off_bad_bounds, ALL, FH_OK, NULL},
    {"vespo, sequence_mask, no sampler log-probs", vespo_sequence_no_samp, ALL, FH_OK, NULL},
    {"vespo, sequence_mask, correction off", vespo_sequence_correction_off, ALL, FH_OK, NULL},
    {"vespo, token_mask, lambda -2 and 0", vespo_token_mode_negative_lambda, ALL, FH_OK, NULL},
    {"top_entropy_quantile 0", quantile_zero, ALL, FH_OK, NULL},
    {"luspo, top_entropy_quantile 1", quantile_one_luspo, ALL, FH_OK, NULL},
    {"every new option at once", every_option, ALL, FH_OK, NULL},
};

static void test_accepted_options(void)
{
    cd_run_valid_calls(&api, accepted, TU_COUNT(accepted), NULL);
}

/* Documented spellings of the same option give bitwise identical outputs (forward and train step):
 * delta NaN == 0 (off); epsilon_high NaN == epsilon_low; num_items_in_batch 0 == -3 == max(sum of mask, 1) (the
 * fixture's mask sums to 5); max_completion_length 0 == -1 == T. */
#define SPELLING(fn, body) \
    static void fn(fh_grpo_options *o, inputs *in) { (void)o; (void)in; body; }
SPELLING(delta_nan, o->delta = NAN)
SPELLING(delta_zero, o->delta = 0.0)
SPELLING(eps_high_nan, (o->epsilon_low = 0.15, o->epsilon_high = NAN))
SPELLING(eps_high_same, (o->epsilon_low = 0.15, o->epsilon_high = 0.15))
SPELLING(dapo_items_zero, (o->loss_type = FH_GRPO_LOSS_DAPO, o->num_items_in_batch = 0.0))
SPELLING(dapo_items_negative, (o->loss_type = FH_GRPO_LOSS_DAPO, o->num_items_in_batch = -3.0))
SPELLING(dapo_items_mask_sum, (o->loss_type = FH_GRPO_LOSS_DAPO, o->num_items_in_batch = 5.0))
SPELLING(dr_length_zero, (o->loss_type = FH_GRPO_LOSS_DR_GRPO, o->max_completion_length = 0))
SPELLING(dr_length_negative, (o->loss_type = FH_GRPO_LOSS_DR_GRPO, o->max_completion_length = -1))
SPELLING(dr_length_t, (o->loss_type = FH_GRPO_LOSS_DR_GRPO, o->max_completion_length = T))
SPELLING(dapo_items_quarter, (o->loss_type = FH_GRPO_LOSS_DAPO, o->num_items_in_batch = 0.25))
SPELLING(dapo_items_one, (o->loss_type = FH_GRPO_LOSS_DAPO, o->num_items_in_batch = 1.0))
SPELLING(correction_off, (o->vllm_importance_sampling_correction = 0))
SPELLING(no_samp_logps, (in->samp[0] = NAN)) /* marks the fixture's batch for no sampler log-probs (below) */
SPELLING(vespo_lambda_negative, (o->loss_type = FH_GRPO_LOSS_VESPO, o->vespo_lambda_pos = -1.0,
                                 o->vespo_lambda_neg = 0.0, o->vllm_importance_sampling_correction = 0))
SPELLING(vespo_lambda_floor, (o->loss_type = FH_GRPO_LOSS_VESPO, o->vespo_lambda_pos = 1e-4,
                              o->vespo_lambda_neg = 1e-4, o->vllm_importance_sampling_correction = 0))

static void test_equivalent_spellings(void)
{
    static const struct {
        const char *name;
        void (*a)(fh_grpo_options *, inputs *), (*b)(fh_grpo_options *, inputs *);
    } pairs[] = {
        {"delta NaN vs 0", delta_nan, delta_zero},
        {"epsilon_high NaN vs epsilon_low", eps_high_nan, eps_high_same},
        {"num_items_in_batch 0 vs -3", dapo_items_zero, dapo_items_negative},
        {"num_items_in_batch 0 vs sum of mask", dapo_items_zero, dapo_items_mask_sum},
        {"max_completion_length 0 vs -1", dr_length_zero, dr_length_negative},
        {"max_completion_length 0 vs T", dr_length_zero, dr_length_t},
        {"num_items_in_batch 0.25 vs 1 (TRL clamps it to >= 1)", dapo_items_quarter, dapo_items_one},
        {"the correction off vs no sampler log-probs", correction_off, no_samp_logps},
        {"VESPO lambda -1 / 0 vs 1e-4 (clamped)", vespo_lambda_negative, vespo_lambda_floor},
    };
    for (size_t k = 0; k < TU_COUNT(pairs); k++)
        for (int which = FWD; which <= STEP; which *= 4) {
            outputs results[2];
            for (int side = 0; side < 2; side++) {
                fixture f;
                fixture_init(&f);
                (side ? pairs[k].b : pairs[k].a)(&f.options, &f.in);
                if (isnan(f.in.samp[0]))
                    f.batch.sampling_per_token_logps = NULL;
                const fh_status st = call(&f, which);
                TU_CHECK(st == FH_OK, "%s (%d), %s: status %d", pairs[k].name, side, call_name(which), (int)st);
                results[side] = f.out;
                fh_context_destroy(f.ctx);
            }
            TU_CHECK(memcmp(&results[0], &results[1], sizeof(outputs)) == 0,
                     "%s, %s: outputs differ (loss %.17g vs %.17g)", pairs[k].name, call_name(which), results[0].loss,
                     results[1].loss);
        }
}

/* A caller workspace of exactly fh_grpo_workspace_size bytes works for all three calls, wherever it starts; one
 * byte less is refused (contract_driver.h). At this shape the forward and backward plans have the same size (both
 * tile the whole 6 x 7 problem), so the query's maximum is what each call needs. Budgets: the default, and 2 KiB.
 * The query's own refusals (NULLs, a bad view, a budget too small) are pure. */
static const char *const budgets[] = {"default budget", "budget 2048"};
static void set_budget(void *fixture_, size_t k)
{
    fixture *f = fixture_;
    TU_CHECK(fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, k ? 2048 : 0) == FH_OK, "set budget");
}

static fh_status size_query(void *fixture_, int which, size_t *bytes)
{
    const fixture *f = fixture_;
    (void)which; /* one query for all three calls */
    return fh_grpo_workspace_size(f->call_ctx, f->call_lin, bytes);
}

static const cd_case query_refusals[] = {
    {"NULL context", null_ctx, ALL, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, ALL, FH_ERR_NULL_POINTER, NULL},
    {"x_row_stride < hidden", x_stride_short, ALL, FH_ERR_INVALID_STRIDE, NULL},
    {"n = 0", n_zero, ALL, FH_ERR_INVALID_SIZE, NULL},
    {"memory budget 1 byte", budget_one, ALL, FH_ERR_BUDGET_TOO_SMALL, NULL},
};

static void test_workspace(void)
{
    static const size_t offsets[] = {0, 1, 8, 60};
    static const cd_workspace w = {offsets, TU_COUNT(offsets), budgets, TU_COUNT(budgets), set_budget, size_query,
                                   NULL, query_refusals, TU_COUNT(query_refusals)};
    cd_run_workspace(&api, &w);
}

/* Optional outputs: every one NULL; then only the loss and dweight. */
MUTATION(no_outputs, (memset(&f->fwd_out, 0, sizeof f->fwd_out), memset(&f->grads, 0, sizeof f->grads)))
MUTATION(loss_and_dweight, (f->fwd_out.loss = &f->out.loss, f->grads.dweight = f->out.dweight))
static const cd_optional optional_steps[] = {
    {"every output and gradient NULL", no_outputs, ALL, {NULL}},
    {"the loss and dweight only", loss_and_dweight, ALL, {"loss", "dweight"}},
};

/* Documented defaults (fusedhead.h: TRL GRPOConfig's), NULL, and optional outputs. */
static void test_options_init_and_optional_outputs(void)
{
    fh_grpo_options o;
    memset(&o, 0x5A, sizeof o);
    TU_CHECK(fh_grpo_options_init(&o) == FH_OK, "fh_grpo_options_init");
    TU_CHECK(o.loss_type == FH_GRPO_LOSS_DAPO && o.importance_sampling_level == FH_GRPO_IS_TOKEN &&
                 o.temperature == 1.0 && o.epsilon_low == 0.2 && isnan(o.epsilon_high) &&
                 (isnan(o.delta) || o.delta == 0.0) && o.beta == 0.0 && o.sapo_temperature_pos == 1.0 &&
                 o.sapo_temperature_neg == 1.05 && o.num_items_in_batch <= 0.0 && o.max_completion_length <= 0 &&
                 o.entropy_coef == 0.0,
             "documented defaults");
    TU_CHECK(o.top_entropy_quantile == 1.0 && isnan(o.off_policy_mask_threshold) && o.use_bias_correction_kl == 0 &&
                 o.vllm_importance_sampling_correction == 1 &&
                 o.vllm_importance_sampling_mode == FH_GRPO_VLLM_IS_SEQUENCE_MASK &&
                 isnan(o.vllm_importance_sampling_clip_min) && o.vllm_importance_sampling_clip_max == 3.0 &&
                 o.vespo_k_pos == 2.0 && o.vespo_lambda_pos == 3.0 && o.vespo_k_neg == 3.0 &&
                 o.vespo_lambda_neg == 2.0,
             "documented defaults of the options TRL added up to f2cd5771");
    TU_CHECK(fh_grpo_options_init(NULL) == FH_ERR_NULL_POINTER, "fh_grpo_options_init(NULL)");

    /* "any may be NULL" (outputs); "A NULL pointer skips that gradient". */
    cd_run_optional_outputs(&api, optional_steps, TU_COUNT(optional_steps));
}

static const tu_test tests[] = {
    {"each bad argument: own status, untouched outputs, message", test_bad_arguments},
    {"valid calls write their outputs; message reset", test_valid_calls},
    {"out-of-range ids under the mask accepted", test_masked_out_of_range_ids_accepted},
    {"option combinations TRL lets through accepted", test_accepted_options},
    {"equivalent option spellings are bitwise identical", test_equivalent_spellings},
    {"caller workspace: exact size, size - 1, guards; size query", test_workspace},
    {"options init and optional outputs", test_options_init_and_optional_outputs},
};
const tu_suite suite_grpo_contracts = {tests, TU_COUNT(tests)};
