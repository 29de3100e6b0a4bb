/* Contracts of the public API, asserted exactly:
 *   - each invalid argument returns its own documented status, leaves every output buffer bit-identical
 *     (pre-filled with a canary pattern) and never writes an input, and the context message names the
 *     problem;
 *   - the workspace size query: an exact-size caller workspace works (and nothing past it is written),
 *     one byte less fails with FH_ERR_WORKSPACE_TOO_SMALL, untouched outputs;
 *   - parameters, bounds, status strings, messages, BLIS query, initialisers. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "ce_case.h"
#include "contract_driver.h"
#include "test_util.h"

#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 5, H = 4, V = 7 };

/* Everything a call writes, in one block so that one memcmp covers it. */
typedef struct outputs {
    double loss, z_loss;
    float per_token_loss[N], logp[N], lse[N], entropy[N];
    int64_t argmax[N], correct;
    float dx[N * H], dweight[H * V], dbias[V];
} outputs;

typedef struct inputs {
    float x[N * H], weight[H * V], bias[V], class_weights[V], grad_output[N], lse[N];
    int64_t targets[N];
} inputs;

/* A valid call, which each case breaks in one way. The call_* pointers are what gets passed. */
typedef struct fixture {
    fh_context *ctx;
    inputs in;
    outputs out;
    fh_linear lin;
    fh_ce_options options;
    fh_ce_outputs fwd_out;
    fh_linear_grads grads;
    fh_context *call_ctx;
    const fh_linear *call_lin;
    const int64_t *call_targets;
    const fh_ce_options *call_options;
    fh_ce_outputs *call_out;
    const float *call_lse, *call_grad_output;
    fh_linear_grads *call_grads;
} fixture;

/* Valid inputs (bias, lse from a successful forward); outputs filled with the canary. */
static void fixture_init(void *fixture_)
{
    fixture *f = fixture_;
    memset(f, 0, sizeof *f);
    TU_CHECK(fh_context_create(&f->ctx) == FH_OK, "fh_context_create");
    uint64_t rng = 12345;
    tu_fill_uniform(f->in.x, N * H, &rng, -1.0, 1.0);
    tu_fill_uniform(f->in.weight, H * V, &rng, -1.0, 1.0);
    for (int j = 0; j < V; j++) {
        f->in.bias[j] = (float)(ref_uniform(&rng) - 0.5);
        f->in.class_weights[j] = (float)(0.5 + ref_uniform(&rng));
    }
    for (int i = 0; i < N; i++) {
        f->in.targets[i] = (int64_t)(ref_uniform(&rng) * V);
        f->in.grad_output[i] = 1.0f;
    }
    f->in.targets[1] = -100;
    fh_linear_init(&f->lin, N, H, V, f->in.x, f->in.weight, FH_LAYOUT_HV, f->in.bias);
    fh_ce_options_init(&f->options);
    const fh_ce_outputs fo = {&f->out.loss, &f->out.z_loss, f->out.per_token_loss, f->out.logp, f->out.lse,
                              f->out.argmax, f->out.entropy, &f->out.correct};
    f->fwd_out = fo;
    const fh_linear_grads g = {.dx = f->out.dx, .dx_row_stride = H, .dx_beta = 0.0f, .dweight = f->out.dweight, .dweight_beta = 0.0f, .dbias = f->out.dbias, .dbias_beta = 0.0f};
    f->grads = g;
    const fh_status st = fh_ce_forward(f->ctx, &f->lin, f->in.targets, &f->options, &f->fwd_out);
    TU_CHECK(st == FH_OK, "fixture forward: %d", (int)st);
    memcpy(f->in.lse, f->out.lse, sizeof f->in.lse);
    tu_fill_canary(&f->out, sizeof f->out);
    f->call_ctx = f->ctx;
    f->call_lin = &f->lin;
    f->call_targets = f->in.targets;
    f->call_options = &f->options;
    f->call_out = &f->fwd_out;
    f->call_lse = f->in.lse;
    f->call_grad_output = f->in.grad_output;
    f->call_grads = &f->grads;
}

enum { FWD = 1, BWD = 2, STEP = 4, ALL = 7 };

static fh_status call(void *fixture_, int which)
{
    const fixture *f = fixture_;
    if (which == FWD)
        return fh_ce_forward(f->call_ctx, f->call_lin, f->call_targets, f->call_options, f->call_out);
    if (which == BWD)
        return fh_ce_backward(f->call_ctx, f->call_lin, f->call_targets, f->call_options, f->call_lse,
                              f->call_grad_output, f->call_grads);
    return fh_ce_forward_backward(f->call_ctx, f->call_lin, f->call_targets, f->call_options, f->call_grad_output,
                                  f->call_out, f->call_grads);
}

static const char *call_name(int which)
{
    return which == FWD ? "fh_ce_forward" : which == BWD ? "fh_ce_backward" : "fh_ce_forward_backward";
}

#define OUT(name, member, calls, kind) CD_OUTPUT(fixture, name, member, calls, kind)
static const cd_output parts[] = {
    OUT("loss", loss, FWD | STEP, CD_F64),
    OUT("z_loss", z_loss, FWD | STEP, CD_F64),
    OUT("per_token_loss", per_token_loss, FWD | STEP, CD_F32),
    OUT("logp", logp, FWD | STEP, CD_F32),
    OUT("lse", lse, FWD | STEP, CD_F32),
    OUT("argmax", argmax, FWD | STEP, CD_BYTES),
    OUT("entropy", entropy, FWD | STEP, CD_F32),
    OUT("correct", correct, FWD | STEP, CD_BYTES),
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
MUTATION(null_weight, f->lin.weight = NULL)
MUTATION(null_targets, f->call_targets = NULL)
MUTATION(null_options, f->call_options = NULL)
MUTATION(null_outputs, f->call_out = NULL)
MUTATION(null_lse, f->call_lse = NULL)
MUTATION(null_grad_output, f->call_grad_output = NULL)
MUTATION(null_grads, f->call_grads = NULL)
MUTATION(n_zero, f->lin.n = 0)
MUTATION(n_negative, f->lin.n = -3)
MUTATION(hidden_zero, f->lin.hidden = 0)
MUTATION(hidden_negative, f->lin.hidden = -1)
MUTATION(vocab_zero, f->lin.vocab = 0)
MUTATION(vocab_negative, f->lin.vocab = -7)
MUTATION(x_stride_short, f->lin.x_row_stride = H - 1)
MUTATION(x_stride_zero, f->lin.x_row_stride = 0)
MUTATION(x_stride_negative, f->lin.x_row_stride = -H)
MUTATION(w_strides_overlap, f->lin.w_stride_hidden = V - 1)
MUTATION(w_strides_both_one, f->lin.w_stride_hidden = 1)
MUTATION(w_stride_vocab_zero, f->lin.w_stride_vocab = 0)
MUTATION(dx_stride_short, f->grads.dx_row_stride = H - 1)
MUTATION(x_stride_huge, f->lin.x_row_stride = INT64_MAX / 2)
MUTATION(w_stride_huge, f->lin.w_stride_hidden = INT64_MAX / 2)
MUTATION(dx_stride_huge, f->grads.dx_row_stride = INT64_MAX / 2)
MUTATION(n_times_vocab_overflows, f->lin.n = INT64_MAX / 4)
MUTATION(target_equals_vocab, f->in.targets[3] = V)
MUTATION(target_minus_one, f->in.targets[0] = -1)
MUTATION(target_default_ignore_not_ignored, f->options.ignore_index = -1) /* targets[1] = -100 */
MUTATION(reduction_seven, f->options.reduction = (fh_reduction)7)
MUTATION(reduction_negative, f->options.reduction = (fh_reduction)-1)
MUTATION(smoothing_negative, f->options.label_smoothing = -0.1)
MUTATION(smoothing_above_one, f->options.label_smoothing = 1.1)
MUTATION(smoothing_nan, f->options.label_smoothing = NAN)
MUTATION(softcap_negative, f->options.softcap = -1.0)
MUTATION(softcap_inf, f->options.softcap = INFINITY)
MUTATION(softcap_nan, f->options.softcap = NAN)
/* The cap is applied in fp32: finite doubles outside its normal range would become inf (NaN logits) or 0
 * (no cap at all), so they are rejected rather than silently changed. */
MUTATION(softcap_above_fp32, f->options.softcap = 1e39)
MUTATION(softcap_below_fp32, f->options.softcap = 1e-50)
MUTATION(z_loss_negative, f->options.z_loss = -1.0)
MUTATION(z_loss_inf, f->options.z_loss = INFINITY)
MUTATION(z_loss_nan, f->options.z_loss = NAN)
MUTATION(logit_scale_zero, f->options.logit_scale = 0.0)
MUTATION(logit_scale_negative, f->options.logit_scale = -1.0)
MUTATION(logit_scale_nan, f->options.logit_scale = NAN)
MUTATION(logit_scale_inf, f->options.logit_scale = INFINITY)
/* Applied in fp32 too, as the engine's scale, and softcap / logit_scale as its cap. */
MUTATION(logit_scale_above_fp32, f->options.logit_scale = 1e39)
MUTATION(logit_scale_below_fp32, f->options.logit_scale = 1e-50)
MUTATION(softcap_over_scale_above_fp32, (f->options.softcap = 1e38, f->options.logit_scale = 1e-3))
MUTATION(softcap_over_scale_below_fp32, (f->options.softcap = 1e-37, f->options.logit_scale = 1e3))
MUTATION(class_weight_negative, (f->options.class_weights = f->in.class_weights, f->in.class_weights[V - 1] = -0.5f))
MUTATION(class_weight_nan, (f->options.class_weights = f->in.class_weights, f->in.class_weights[0] = NAN))
MUTATION(class_weight_inf, (f->options.class_weights = f->in.class_weights, f->in.class_weights[3] = INFINITY))
MUTATION(dx_beta_half, f->grads.dx_beta = 0.5f)
MUTATION(dweight_beta_half, f->grads.dweight_beta = 0.5f)
MUTATION(dbias_beta_half, f->grads.dbias_beta = 0.5f)
MUTATION(dx_beta_minus_one, f->grads.dx_beta = -1.0f)
MUTATION(dweight_beta_nan, f->grads.dweight_beta = NAN)
MUTATION(grad_output_nan, f->in.grad_output[0] = NAN)
/* Outputs over inputs (README, Conventions: FH_ERR_OVERLAPPING_BUFFERS). */
MUTATION(ptl_over_targets, f->fwd_out.per_token_loss = (float *)f->in.targets)
MUTATION(lse_output_over_x, f->fwd_out.lse = f->in.x + 3)
MUTATION(dx_over_lse_input, f->grads.dx = f->in.lse)
MUTATION(argmax_over_grad_output, f->fwd_out.argmax = (int64_t *)f->in.grad_output)
MUTATION(entropy_over_targets, f->fwd_out.entropy = (float *)f->in.targets)
MUTATION(correct_over_argmax, f->fwd_out.correct = f->out.argmax + 2)
MUTATION(grad_output_inf, f->in.grad_output[0] = -INFINITY)
MUTATION(grad_output_none_nan, (f->options.reduction = FH_REDUCTION_NONE, f->in.grad_output[N - 1] = NAN))
MUTATION(none_without_per_token_loss, (f->options.reduction = FH_REDUCTION_NONE, f->fwd_out.per_token_loss = NULL))
MUTATION(dbias_without_bias, f->lin.bias = NULL)
MUTATION(budget_one, fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, 1))

static const cd_case bad_cases[] = {
    {"NULL context", null_ctx, ALL, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, ALL, FH_ERR_NULL_POINTER, "lin"},
    {"NULL x", null_x, ALL, FH_ERR_NULL_POINTER, "x"},
    {"NULL weight", null_weight, ALL, FH_ERR_NULL_POINTER, "weight"},
    {"NULL targets", null_targets, ALL, FH_ERR_NULL_POINTER, "targets"},
    {"NULL options", null_options, ALL, FH_ERR_NULL_POINTER, "options"},
    {"NULL outputs", null_outputs, FWD | STEP, FH_ERR_NULL_POINTER, "outputs"},
    {"NULL lse", null_lse, BWD, FH_ERR_NULL_POINTER, "lse"},
    {"NULL grad_output", null_grad_output, BWD | STEP, FH_ERR_NULL_POINTER, "grad_output"},
    {"NULL grads", null_grads, BWD | STEP, FH_ERR_NULL_POINTER, "grads"},
    {"n = 0", n_zero, ALL, FH_ERR_INVALID_SIZE, "n"},
    {"n < 0", n_negative, ALL, FH_ERR_INVALID_SIZE, "n"},
    {"hidden = 0", hidden_zero, ALL, FH_ERR_INVALID_SIZE, "hidden"},
    {"hidden < 0", hidden_negative, ALL, FH_ERR_INVALID_SIZE, "hidden"},
    {"vocab = 0", vocab_zero, ALL, FH_ERR_INVALID_SIZE, "vocab"},
    {"vocab < 0", vocab_negative, ALL, FH_ERR_INVALID_SIZE, "vocab"},
    {"x_row_stride < hidden", x_stride_short, ALL, FH_ERR_INVALID_STRIDE, "stride"},
    {"x_row_stride = 0", x_stride_zero, ALL, FH_ERR_INVALID_STRIDE, "stride"},
    {"x_row_stride < 0", x_stride_negative, ALL, FH_ERR_INVALID_STRIDE, "stride"},
    {"weight strides overlap", w_strides_overlap, ALL, FH_ERR_INVALID_STRIDE, "weight"},
    {"weight strides both 1", w_strides_both_one, ALL, FH_ERR_INVALID_STRIDE, "weight"},
    {"w_stride_vocab = 0", w_stride_vocab_zero, ALL, FH_ERR_INVALID_STRIDE, "weight"},
    {"dx_row_stride < hidden", dx_stride_short, BWD | STEP, FH_ERR_INVALID_STRIDE, "dx"},
    {"x_row_stride overflows", x_stride_huge, ALL, FH_ERR_SIZE_OVERFLOW, "overflow"},
    {"w_stride_hidden overflows", w_stride_huge, ALL, FH_ERR_SIZE_OVERFLOW, "overflow"},
    {"dx_row_stride overflows", dx_stride_huge, BWD | STEP, FH_ERR_SIZE_OVERFLOW, "overflow"},
    {"n * vocab overflows", n_times_vocab_overflows, ALL, FH_ERR_SIZE_OVERFLOW, "overflow"},
    {"target = V", target_equals_vocab, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"target = -1", target_minus_one, ALL, FH_ERR_TARGET_OUT_OF_RANGE, "targets"},
    {"target -100 with ignore_index -1", target_default_ignore_not_ignored, ALL, FH_ERR_TARGET_OUT_OF_RANGE,
     "targets"},
    {"reduction 7", reduction_seven, ALL, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"reduction -1", reduction_negative, ALL, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"label_smoothing -0.1", smoothing_negative, ALL, FH_ERR_INVALID_LABEL_SMOOTHING, "label_smoothing"},
    {"label_smoothing 1.1", smoothing_above_one, ALL, FH_ERR_INVALID_LABEL_SMOOTHING, "label_smoothing"},
    {"label_smoothing NaN", smoothing_nan, ALL, FH_ERR_INVALID_LABEL_SMOOTHING, "label_smoothing"},
    {"softcap -1", softcap_negative, ALL, FH_ERR_INVALID_SOFTCAP, "softcap"},
    {"softcap inf", softcap_inf, ALL, FH_ERR_INVALID_SOFTCAP, "softcap"},
    {"softcap NaN", softcap_nan, ALL, FH_ERR_INVALID_SOFTCAP, "softcap"},
    {"softcap 1e39 (above FLT_MAX)", softcap_above_fp32, ALL, FH_ERR_INVALID_SOFTCAP, "softcap"},
    {"softcap 1e-50 (below FLT_MIN)", softcap_below_fp32, ALL, FH_ERR_INVALID_SOFTCAP, "softcap"},
    {"z_loss -1", z_loss_negative, ALL, FH_ERR_INVALID_Z_LOSS, "z_loss"},
    {"z_loss inf", z_loss_inf, ALL, FH_ERR_INVALID_Z_LOSS, "z_loss"},
    {"z_loss NaN", z_loss_nan, ALL, FH_ERR_INVALID_Z_LOSS, "z_loss"},
    {"logit_scale 0", logit_scale_zero, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"logit_scale -1", logit_scale_negative, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"logit_scale NaN", logit_scale_nan, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"logit_scale inf", logit_scale_inf, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"logit_scale 1e39 (above FLT_MAX)", logit_scale_above_fp32, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"logit_scale 1e-50 (below FLT_MIN)", logit_scale_below_fp32, ALL, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale"},
    {"softcap / logit_scale 1e41", softcap_over_scale_above_fp32, ALL, FH_ERR_INVALID_LOGIT_SCALE,
     "softcap / logit_scale"},
    {"softcap / logit_scale 1e-40", softcap_over_scale_below_fp32, ALL, FH_ERR_INVALID_LOGIT_SCALE,
     "softcap / logit_scale"},
    {"class weight -0.5", class_weight_negative, ALL, FH_ERR_INVALID_CLASS_WEIGHT, "class_weight"},
    {"class weight NaN", class_weight_nan, ALL, FH_ERR_INVALID_CLASS_WEIGHT, "class_weight"},
    {"class weight inf", class_weight_inf, ALL, FH_ERR_INVALID_CLASS_WEIGHT, "class_weight"},
    {"dx_beta 0.5", dx_beta_half, BWD | STEP, FH_ERR_INVALID_BETA, "beta"},
    {"dweight_beta 0.5", dweight_beta_half, BWD | STEP, FH_ERR_INVALID_BETA, "beta"},
    {"dbias_beta 0.5", dbias_beta_half, BWD | STEP, FH_ERR_INVALID_BETA, "beta"},
    {"dx_beta -1", dx_beta_minus_one, BWD | STEP, FH_ERR_INVALID_BETA, "beta"},
    {"dweight_beta NaN", dweight_beta_nan, BWD | STEP, FH_ERR_INVALID_BETA, "beta"},
    {"grad_output NaN", grad_output_nan, BWD | STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output -inf", grad_output_inf, BWD | STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"grad_output[N-1] NaN, reduction none", grad_output_none_nan, BWD | STEP, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output"},
    {"reduction none without per_token_loss", none_without_per_token_loss, FWD | STEP, FH_ERR_MISSING_OUTPUT,
     "per_token_loss"},
    /* The header does not name a status for this one; the required pointer that is NULL is the bias. */
    {"dbias requested without bias", dbias_without_bias, BWD | STEP, FH_ERR_NULL_POINTER, "bias"},
    {"memory budget 1 byte", budget_one, ALL, FH_ERR_BUDGET_TOO_SMALL, "budget"},
    {"per_token_loss over targets", ptl_over_targets, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "per_token_loss"},
    {"lse output inside x", lse_output_over_x, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "lse"},
    {"dx over the lse input", dx_over_lse_input, BWD, FH_ERR_OVERLAPPING_BUFFERS, "dx"},
    {"argmax over grad_output", argmax_over_grad_output, STEP, FH_ERR_OVERLAPPING_BUFFERS, "argmax"},
    {"entropy over targets", entropy_over_targets, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "entropy"},
    {"correct inside argmax", correct_over_argmax, FWD | STEP, FH_ERR_OVERLAPPING_BUFFERS, "correct"},
};

static void test_bad_arguments(void)
{
    cd_run_bad_arguments(&api, bad_cases, TU_COUNT(bad_cases));
}

/* After a success, an error sets a message and the next success clears it. */
MUTATION(reduction_nine, f->options.reduction = (fh_reduction)9)
MUTATION(reduction_sum, f->options.reduction = FH_REDUCTION_SUM)
static const cd_case error_then_success[] = {
    {"reduction 9", reduction_nine, ALL, FH_ERR_INVALID_REDUCTION, "reduction"},
    {"reduction sum", reduction_sum, ALL, FH_OK, NULL},
};

static void test_valid_call_and_message_reset(void)
{
    cd_run_valid_calls(&api, error_then_success, TU_COUNT(error_then_success), NULL);
    fh_context *ctx = NULL;
    TU_CHECK(fh_context_create(&ctx) == FH_OK, "fh_context_create");
    TU_CHECK(fh_context_message(ctx, NULL) == FH_ERR_NULL_POINTER, "fh_context_message accepts a NULL message");
    fh_context_destroy(ctx);
    /* No context: the last fh_context_create's message, "" since it succeeded. */
    const char *msg = NULL;
    TU_CHECK(fh_context_message(NULL, &msg) == FH_OK && msg && msg[0] == '\0', "creation message \"%s\"",
             msg ? msg : "(null)");
}

/* The size queries and a caller workspace (contract_driver.h): fh_ce_workspace_size for the forward and the
 * backward, fh_ce_forward_backward_workspace_size for the train step, at offsets 0, 1, 3, 8 and 60 (no alignment is
 * documented), under the default budget (the train step's row blocks fit) and 4 KiB (it streams), with label
 * smoothing, class weights and DFT (the busiest path: every statistic, and the backward's target logits). The
 * queries' own refusals are pure. */
static const char *const settings[] = {"default budget", "budget 4096"};
static void busiest_path(void *fixture_, size_t k)
{
    fixture *f = fixture_;
    f->options.label_smoothing = 0.1;
    f->options.class_weights = f->in.class_weights;
    f->options.token_scaling = 1;
    TU_CHECK(fh_context_set(f->ctx, FH_PARAM_MEMORY_BUDGET, k ? 4096 : 0) == FH_OK, "set budget");
}

static fh_status size_query(void *fixture_, int which, size_t *bytes)
{
    const fixture *f = fixture_;
    return which == STEP ? fh_ce_forward_backward_workspace_size(f->call_ctx, f->call_lin, f->call_options, bytes)
                         : fh_ce_workspace_size(f->call_ctx, f->call_lin, f->call_options, bytes);
}

/* n = 2^61 tokens: the per-token workspace (n times a few doubles) cannot be sized in 64 bits. The query reads no
 * data, so the small arrays behind the view do not matter. */
MUTATION(n_huge, (f->lin.n = (int64_t)1 << 61, f->lin.hidden = f->lin.vocab = f->lin.x_row_stride = 1,
                  f->lin.w_stride_hidden = 1))
static const cd_case query_refusals[] = {
    {"NULL context", null_ctx, ALL, FH_ERR_NULL_POINTER, NULL},
    {"NULL fh_linear", null_lin, ALL, FH_ERR_NULL_POINTER, NULL},
    {"NULL options", null_options, ALL, FH_ERR_NULL_POINTER, NULL},
    {"x_row_stride < hidden", x_stride_short, ALL, FH_ERR_INVALID_STRIDE, NULL},
    {"n = 0", n_zero, ALL, FH_ERR_INVALID_SIZE, NULL},
    {"n = 2^61", n_huge, ALL, FH_ERR_SIZE_OVERFLOW, NULL},
    {"memory budget 1 byte", budget_one, ALL, FH_ERR_BUDGET_TOO_SMALL, NULL},
};

static void test_workspace(void)
{
    static const size_t offsets[] = {0, 1, 3, 8, 60};
    static const cd_workspace w = {offsets, TU_COUNT(offsets), settings, TU_COUNT(settings), busiest_path, size_query,
                                   NULL, query_refusals, TU_COUNT(query_refusals)};
    cd_run_workspace(&api, &w);
}

/* The train step's query for given gradients checks them as the call does; with fp32 inputs nothing moves into
 * dweight, so it answers what the other query does. */
static void test_workspace_size_with_grads(void)
{
    fixture f;
    fixture_init(&f);
    size_t bytes = 777, any = 0;
    TU_CHECK(fh_ce_forward_backward_workspace_size_with_grads(f.ctx, &f.lin, &f.options, NULL, &bytes) ==
                     FH_ERR_NULL_POINTER && bytes == 777, "with grads: NULL grads");
    fh_linear_grads g = f.grads;
    g.dweight_beta = 0.5f;
    TU_CHECK(fh_ce_forward_backward_workspace_size_with_grads(f.ctx, &f.lin, &f.options, &g, &bytes) ==
                     FH_ERR_INVALID_BETA && bytes == 777, "with grads: dweight_beta 0.5");
    g = f.grads;
    g.dx_row_stride = H - 1;
    TU_CHECK(fh_ce_forward_backward_workspace_size_with_grads(f.ctx, &f.lin, &f.options, &g, &bytes) ==
                     FH_ERR_INVALID_STRIDE && bytes == 777, "with grads: dx stride");
    TU_CHECK(fh_ce_forward_backward_workspace_size(f.ctx, &f.lin, &f.options, &any) == FH_OK &&
                 fh_ce_forward_backward_workspace_size_with_grads(f.ctx, &f.lin, &f.options, &f.grads, &bytes) ==
                     FH_OK && bytes == any,
             "with grads, fp32: %zu bytes against %zu", bytes, any);
    fh_context_destroy(f.ctx);
}

/* fh_context_set/get and fh_param_bounds. */
static void test_params(void)
{
    const fh_param params[] = {FH_PARAM_THREADS, FH_PARAM_TILE_ROWS, FH_PARAM_TILE_VOCAB, FH_PARAM_MEMORY_BUDGET,
                               FH_PARAM_CHECK_FINITE, FH_PARAM_FP32_DU, FH_PARAM_OVERSUBSCRIBE, FH_PARAM_GRAD_FILTER_TAIL,
                               FH_PARAM_BATCH_INVARIANT};
    fh_context *ctx = NULL;
    TU_CHECK(fh_context_create(&ctx) == FH_OK, "create");
    for (size_t k = 0; k < TU_COUNT(params); k++) {
        int64_t lo = -42, hi = -42, value = -42;
        TU_CHECK(fh_param_bounds(params[k], &lo, &hi) == FH_OK, "bounds of %d", (int)params[k]);
        /* 0 means "default" for every parameter, so it must be inside the bounds. */
        TU_CHECK(lo <= 0 && 0 <= hi && lo < hi, "param %d: bounds [%lld, %lld]", (int)params[k], (long long)lo,
                 (long long)hi);
        TU_CHECK(fh_context_get(ctx, params[k], &value) == FH_OK && value == 0, "param %d: default %lld",
                 (int)params[k], (long long)value);
        TU_CHECK(fh_context_set(ctx, params[k], hi) == FH_OK, "param %d: set max", (int)params[k]);
        TU_CHECK(fh_context_get(ctx, params[k], &value) == FH_OK && value == hi, "param %d: get max", (int)params[k]);
        const int64_t outside[] = {hi == INT64_MAX ? hi : hi + 1, lo == INT64_MIN ? lo : lo - 1, INT64_MIN};
        for (size_t o = 0; o < TU_COUNT(outside); o++) {
            if (outside[o] >= lo && outside[o] <= hi)
                continue;
            const fh_status st = fh_context_set(ctx, params[k], outside[o]);
            TU_CHECK(st == FH_ERR_INVALID_PARAM_VALUE, "param %d = %lld: status %d", (int)params[k],
                     (long long)outside[o], (int)st);
            const char *msg = NULL;
            fh_context_message(ctx, &msg);
            TU_CHECK(msg && msg[0], "param %d = %lld: empty message", (int)params[k], (long long)outside[o]);
            TU_CHECK(fh_context_get(ctx, params[k], &value) == FH_OK && value == hi,
                     "param %d: a rejected value changed it to %lld", (int)params[k], (long long)value);
        }
        TU_CHECK(fh_context_set(ctx, params[k], lo) == FH_OK, "param %d: set min", (int)params[k]);
        TU_CHECK(fh_context_set(ctx, params[k], 0) == FH_OK, "param %d: set 0", (int)params[k]);
    }
    const fh_param unknown[] = {(fh_param)(FH_PARAM_BATCH_INVARIANT + 1), (fh_param)-1, (fh_param)1000}; /* past the last */
    for (size_t k = 0; k < TU_COUNT(unknown); k++) {
        int64_t lo = 5, hi = 6, value = 7;
        TU_CHECK(fh_context_set(ctx, unknown[k], 0) == FH_ERR_INVALID_PARAM, "set unknown %d", (int)unknown[k]);
        const char *msg = NULL;
        fh_context_message(ctx, &msg);
        TU_CHECK(msg && msg[0], "set unknown %d: empty message", (int)unknown[k]);
        TU_CHECK(fh_context_get(ctx, unknown[k], &value) == FH_ERR_INVALID_PARAM && value == 7, "get unknown %d",
                 (int)unknown[k]);
        TU_CHECK(fh_param_bounds(unknown[k], &lo, &hi) == FH_ERR_INVALID_PARAM && lo == 5 && hi == 6,
                 "bounds unknown %d", (int)unknown[k]);
    }
    int64_t lo, hi, value;
    TU_CHECK(fh_param_bounds(FH_PARAM_THREADS, NULL, &hi) == FH_ERR_NULL_POINTER &&
                 fh_param_bounds(FH_PARAM_THREADS, &lo, NULL) == FH_ERR_NULL_POINTER,
             "bounds with NULL");
    TU_CHECK(fh_context_set(NULL, FH_PARAM_THREADS, 1) == FH_ERR_NULL_POINTER, "set on NULL");
    TU_CHECK(fh_context_get(NULL, FH_PARAM_THREADS, &value) == FH_ERR_NULL_POINTER &&
                 fh_context_get(ctx, FH_PARAM_THREADS, NULL) == FH_ERR_NULL_POINTER,
             "get with NULL");
    fh_context_destroy(ctx);
}

/* The threads a call runs: never more than the CPUs this process may use (its affinity mask here; a cgroup quota
 * may lower it further) unless oversubscription is asked for; OpenMP's default when FH_PARAM_THREADS is 0. */
static void test_threads_fit_the_machine(void)
{
    cpu_set_t set;
    TU_CHECK(sched_getaffinity(0, sizeof set, &set) == 0, "sched_getaffinity");
    const int affinity = CPU_COUNT(&set);
    fh_context *ctx = NULL;
    TU_CHECK(fh_context_create(&ctx) == FH_OK, "create");
    int threads = -1, cpus = -1;
    TU_CHECK(fh_context_set(ctx, FH_PARAM_THREADS, 1024) == FH_OK && fh_context_threads(ctx, &cpus) == FH_OK &&
                 cpus >= 1 && cpus <= affinity,
             "1024 threads requested on %d CPUs: %d", affinity, cpus);
    TU_CHECK(fh_context_set(ctx, FH_PARAM_THREADS, 1) == FH_OK && fh_context_threads(ctx, &threads) == FH_OK &&
                 threads == 1,
             "1 thread requested: %d", threads);
    TU_CHECK(fh_context_set(ctx, FH_PARAM_THREADS, 0) == FH_OK && fh_context_threads(ctx, &threads) == FH_OK &&
                 threads == (omp_get_max_threads() < cpus ? omp_get_max_threads() : cpus),
             "default: %d threads (OpenMP %d, %d CPUs)", threads, omp_get_max_threads(), cpus);
    TU_CHECK(fh_context_set(ctx, FH_PARAM_OVERSUBSCRIBE, 1) == FH_OK &&
                 fh_context_set(ctx, FH_PARAM_THREADS, 64) == FH_OK && fh_context_threads(ctx, &threads) == FH_OK &&
                 threads == 64,
             "64 threads with oversubscription allowed: %d", threads);
    TU_CHECK(fh_context_threads(NULL, &threads) == FH_ERR_NULL_POINTER &&
                 fh_context_threads(ctx, NULL) == FH_ERR_NULL_POINTER,
             "NULL arguments");
    fh_context_destroy(ctx);
}

/* Every status of fusedhead.h and fusedhead_mpi.h (one enum: the MPI module's codes are in it) has its own value in
 * its decade and its own non-empty text; unknown values still get one. */
static void test_status_strings(void)
{
    const fh_status all[] = {FH_OK,
                             FH_ERR_NULL_POINTER,
                             FH_ERR_INVALID_SIZE,
                             FH_ERR_INVALID_STRIDE,
                             FH_ERR_SIZE_OVERFLOW,
                             FH_ERR_TARGET_OUT_OF_RANGE,
                             FH_ERR_MISSING_OUTPUT,
                             FH_ERR_NONFINITE_INPUT,
                             FH_ERR_INVALID_LAYOUT,
                             FH_ERR_INVALID_DTYPE,
                             FH_ERR_INVALID_REDUCTION,
                             FH_ERR_INVALID_LABEL_SMOOTHING,
                             FH_ERR_INVALID_SOFTCAP,
                             FH_ERR_INVALID_Z_LOSS,
                             FH_ERR_INVALID_CLASS_WEIGHT,
                             FH_ERR_INVALID_BETA,
                             FH_ERR_INVALID_GRAD_OUTPUT,
                             FH_ERR_INVALID_MASK,
                             FH_ERR_INVALID_TEMPERATURE,
                             FH_ERR_INVALID_GRPO_OPTION,
                             FH_ERR_WORKSPACE_TOO_SMALL,
                             FH_ERR_OUT_OF_MEMORY,
                             FH_ERR_BUDGET_TOO_SMALL,
                             FH_ERR_WISDOM_IO,
                             FH_ERR_INVALID_WISDOM,
                             FH_ERR_OVERLAPPING_BUFFERS,
                             FH_ERR_INVALID_PARAM,
                             FH_ERR_INVALID_PARAM_VALUE,
                             FH_ERR_KERNELS_UNAVAILABLE,
                             FH_ERR_GEMM_FAILED,
                             FH_ERR_INVALID_PREFERENCE_OPTION,
                             FH_ERR_INVALID_DISTILL_OPTION,
                             FH_ERR_TEACHER_MISMATCH,
                             FH_ERR_INVALID_LOGIT_SCALE,
                             FH_ERR_MPI,
                             FH_ERR_MPI_LAYOUT,
                             FH_ERR_MPI_MISMATCH};
    /* The decade of each kind of failure (fusedhead.h), in the order above. */
    const struct {
        fh_status first, last;
        int decade;
    } decades[] = {{FH_ERR_NULL_POINTER, FH_ERR_INVALID_DTYPE, 0},
                   {FH_ERR_INVALID_REDUCTION, FH_ERR_INVALID_GRPO_OPTION, 1},
                   {FH_ERR_WORKSPACE_TOO_SMALL, FH_ERR_OVERLAPPING_BUFFERS, 2},
                   {FH_ERR_INVALID_PARAM, FH_ERR_KERNELS_UNAVAILABLE, 3},
                   {FH_ERR_GEMM_FAILED, FH_ERR_GEMM_FAILED, 4},
                   {FH_ERR_INVALID_PREFERENCE_OPTION, FH_ERR_INVALID_LOGIT_SCALE, 5},
                   {FH_ERR_MPI, FH_ERR_MPI_MISMATCH, 6}};
    for (size_t d = 0; d < TU_COUNT(decades); d++)
        for (int v = (int)decades[d].first; v <= (int)decades[d].last; v++)
            TU_CHECK(v / 10 == decades[d].decade, "status %d is outside its decade %d0..%d9", v, decades[d].decade,
                     decades[d].decade);
    for (size_t a = 0; a < TU_COUNT(all); a++) {
        const char *s = fh_status_string(all[a]);
        TU_CHECK(s && s[0], "status %d: empty text", (int)all[a]);
        TU_CHECK(strcmp(s, fh_status_string((fh_status)999)) != 0, "status %d has the unknown status's text",
                 (int)all[a]);
        for (size_t b = 0; b < a; b++) {
            TU_CHECK(all[a] != all[b], "statuses #%zu and #%zu share the value %d", a, b, (int)all[a]);
            const char *t = fh_status_string(all[b]);
            TU_CHECK(!s || !t || strcmp(s, t) != 0, "statuses %d and %d share the text \"%s\"", (int)all[a],
                     (int)all[b], s);
        }
    }
    const fh_status unknown[] = {(fh_status)25, (fh_status)33, (fh_status)41, (fh_status)-1, (fh_status)999};
    for (size_t k = 0; k < TU_COUNT(unknown); k++) {
        const char *s = fh_status_string(unknown[k]);
        TU_CHECK(s && s[0], "unknown status %d: no text", (int)unknown[k]);
    }
}

/* Context lifetime, initialisers, linear views, BLIS query. */
static void test_small_entry_points(void)
{
    TU_CHECK(fh_context_create(NULL) == FH_ERR_NULL_POINTER, "create(NULL)");
    TU_CHECK(fh_context_destroy(NULL) == FH_OK, "destroy(NULL) is documented as accepted");
    TU_CHECK(fh_context_set_workspace(NULL, NULL, 0) == FH_ERR_NULL_POINTER, "set_workspace on NULL");

    fh_ce_options o;
    memset(&o, 0x5A, sizeof o);
    TU_CHECK(fh_ce_options_init(&o) == FH_OK, "options init");
    TU_CHECK(o.ignore_index == -100 && o.reduction == FH_REDUCTION_MEAN && o.label_smoothing == 0.0 &&
                 o.class_weights == NULL && o.softcap == 0.0 && o.z_loss == 0.0 && o.logit_scale == 1.0 &&
                 o.token_scaling == 0,
             "documented option defaults");
    TU_CHECK(fh_ce_options_init(NULL) == FH_ERR_NULL_POINTER, "options init NULL");

    float x[6], w[12], b[4];
    fh_linear lin;
    TU_CHECK(fh_linear_init(&lin, 2, 3, 4, x, w, FH_LAYOUT_HV, b) == FH_OK, "linear init hv");
    TU_CHECK(lin.n == 2 && lin.hidden == 3 && lin.vocab == 4 && lin.x == x && lin.x_row_stride == 3 &&
                 lin.weight == w && lin.w_stride_hidden == 4 && lin.w_stride_vocab == 1 && lin.bias == b,
             "contiguous [H, V] view");
    TU_CHECK(fh_linear_init(&lin, 2, 3, 4, x, w, FH_LAYOUT_VH, NULL) == FH_OK, "linear init vh");
    TU_CHECK(lin.x_row_stride == 3 && lin.w_stride_hidden == 1 && lin.w_stride_vocab == 3 && lin.bias == NULL,
             "contiguous [V, H] view");
    TU_CHECK(fh_linear_init(NULL, 2, 3, 4, x, w, FH_LAYOUT_HV, b) == FH_ERR_NULL_POINTER, "linear init NULL");

    fh_kernel_info info;
    memset(&info, 0, sizeof info);
    TU_CHECK(fh_kernel_query(&info) == FH_OK, "fh_kernel_query");
    TU_CHECK(info.kernel_set != NULL && info.kernel_set[0] != '\0', "kernel_set is NULL or empty");
    TU_CHECK((info.selected_by_library == 0 || info.selected_by_library == 1) &&
                 (info.user_override == 0 || info.user_override == 1) &&
                 !(info.selected_by_library && info.user_override),
             "flags selected_by_library %d, user_override %d", info.selected_by_library, info.user_override);
    /* The row kernels and bf16 path by name (test_kernel_choice.c checks which ones the CPU and environment give). */
    const char *ew = info.elementwise;
    TU_CHECK(ew && (strcmp(ew, "avx512") == 0 || strcmp(ew, "avx2") == 0 || strcmp(ew, "portable") == 0),
             "elementwise = %s", ew ? ew : "NULL");
    TU_CHECK(info.bf16_path && info.bf16_gemm && strncmp(info.bf16_gemm, info.bf16_path, strlen(info.bf16_path)) == 0,
             "bf16 path %s, bf16_gemm %s", info.bf16_path ? info.bf16_path : "NULL",
             info.bf16_gemm ? info.bf16_gemm : "NULL");
    TU_CHECK(fh_kernel_query(NULL) == FH_ERR_NULL_POINTER, "fh_kernel_query(NULL)");
}

/* Overlapping buffers (README, Conventions): each kind returns FH_ERR_OVERLAPPING_BUFFERS naming both buffers, and
 * writes nothing (outputs and inputs compared with copies taken before the call). Each of these gave FH_OK with
 * wrong results or NaN before the check: dx == x, dweight == weight (rows over more than one tile), a caller's
 * workspace over x or dx, dx over dweight. */
enum { OV_N = 40, OV_H = 8, OV_V = 300 };
static void test_overlapping_buffers(void)
{
    /* One arena: x [N, H], weight [V, H], dx, dweight, a spare region, then room for a workspace. */
    const size_t x_floats = OV_N * OV_H, w_floats = OV_V * OV_H;
    const size_t arena_floats = 2 * x_floats + 2 * w_floats + (1u << 20);
    float *arena = tu_alloc(arena_floats, sizeof(float)), *copy = tu_alloc(arena_floats, sizeof(float));
    float *x = arena, *w = x + x_floats, *dx = w + w_floats, *dw = dx + x_floats;
    uint64_t rng = 5;
    tu_fill_uniform(arena, arena_floats, &rng, -1.0, 1.0);
    int64_t targets[OV_N];
    for (int i = 0; i < OV_N; i++)
        targets[i] = (i * 7) % OV_V;
    fh_ce_options o;
    fh_ce_options_init(&o);
    const float grad_output = 1.0f;
    enum { DX_IS_X, DW_IS_WEIGHT, WORKSPACE_OVER_X, WORKSPACE_OVER_DX, DX_OVER_DWEIGHT, KINDS };
    static const char *const names[KINDS][2] = {{"dx", "x"}, {"dweight", "the weight"}, {"workspace", "x"},
                                                 {"dx", "workspace"}, {"dx", "dweight"}};
    for (int kind = 0; kind < KINDS; kind++) {
        fh_context *ctx = tu_context(2, 8, 64, 0); /* 8-row tiles: the rows span several */
        fh_linear lin;
        fh_linear_init(&lin, OV_N, OV_H, OV_V, x, w, FH_LAYOUT_VH, NULL);
        fh_linear_grads g = {.dx = dx, .dx_row_stride = OV_H, .dweight = dw};
        if (kind == DX_IS_X)
            g.dx = x;
        if (kind == DW_IS_WEIGHT)
            g.dweight = w;
        if (kind == DX_OVER_DWEIGHT)
            g.dx = dw + w_floats - 3; /* dx's first row over dweight's last three floats */
        if (kind == WORKSPACE_OVER_X || kind == WORKSPACE_OVER_DX) {
            size_t bytes = 0;
            TU_CHECK(fh_ce_forward_backward_workspace_size(ctx, &lin, &o, &bytes) == FH_OK, "workspace size");
            /* A workspace starting in the spare region and ending over x, or starting inside dx. */
            float *at = kind == WORKSPACE_OVER_X ? x + x_floats / 2 : dx + 5;
            TU_CHECK(bytes <= (arena_floats - (size_t)(at - arena)) * sizeof(float), "arena too small");
            TU_CHECK(fh_context_set_workspace(ctx, at, bytes) == FH_OK, "set workspace");
        }
        memcpy(copy, arena, arena_floats * sizeof(float));
        double loss = -1.0;
        fh_ce_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
        const fh_status st = fh_ce_forward_backward(ctx, &lin, targets, &o, &grad_output, &out, &g);
        const char *msg = "";
        fh_context_message(ctx, &msg);
        TU_CHECK(st == FH_ERR_OVERLAPPING_BUFFERS && strstr(msg, names[kind][0]) && strstr(msg, names[kind][1]),
                 "%s over %s: status %d, message '%s'", names[kind][0], names[kind][1], (int)st, msg);
        TU_CHECK(loss == -1.0 && memcmp(copy, arena, arena_floats * sizeof(float)) == 0,
                 "%s over %s: something was written", names[kind][0], names[kind][1]);
        if (kind == WORKSPACE_OVER_X) { /* the forward too: it writes the workspace */
            const fh_status forward = fh_ce_forward(ctx, &lin, targets, &o, &out);
            TU_CHECK(forward == FH_ERR_OVERLAPPING_BUFFERS && loss == -1.0, "forward with the workspace over x: %d",
                     (int)forward);
        }
        fh_context_destroy(ctx);
    }
    /* Buffers that touch but do not overlap are accepted: dweight right after the weight, dx after dweight. */
    fh_context *ctx = tu_context(2, 0, 0, 0);
    fh_linear lin;
    fh_linear_init(&lin, OV_N, OV_H, OV_V, x, w, FH_LAYOUT_VH, NULL);
    fh_linear_grads g = {.dx = dw + w_floats, .dx_row_stride = OV_H, .dweight = dx};
    double loss = -1.0;
    fh_ce_outputs out = {&loss, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    TU_CHECK(fh_ce_forward_backward(ctx, &lin, targets, &o, &grad_output, &out, &g) == FH_OK, "adjacent buffers");
    fh_context_destroy(ctx);
    free(arena);
    free(copy);
}

/* Every output but the ones a call needs may be NULL ("Any output pointer may be NULL except as noted";
 * "A NULL pointer skips that gradient"). */
MUTATION(no_outputs, (memset(&f->fwd_out, 0, sizeof f->fwd_out), memset(&f->grads, 0, sizeof f->grads)))
MUTATION(none_per_token_loss_only, (f->options.reduction = FH_REDUCTION_NONE,
                                    f->fwd_out.per_token_loss = f->out.per_token_loss))
MUTATION(dweight_only, f->grads.dweight = f->out.dweight)
MUTATION(correct_only, (memset(&f->fwd_out, 0, sizeof f->fwd_out), f->fwd_out.correct = &f->out.correct))
MUTATION(entropy_only, (memset(&f->fwd_out, 0, sizeof f->fwd_out), f->fwd_out.entropy = f->out.entropy))
static const cd_optional optional_steps[] = {
    {"only correct", correct_only, FWD, {"correct"}},
    {"only entropy", entropy_only, FWD, {"entropy"}},
    {"every output and gradient NULL", no_outputs, ALL, {NULL}},
    {"'none' with only per_token_loss", none_per_token_loss_only, FWD, {"per_token_loss"}},
    {"'none', per_token_loss and dweight only", dweight_only, BWD | STEP, {"per_token_loss", "dweight"}},
};

static void test_optional_outputs(void)
{
    cd_run_optional_outputs(&api, optional_steps, TU_COUNT(optional_steps));
}

static const tu_test tests[] = {
    {"each bad argument: own status, untouched outputs, message", test_bad_arguments},
    {"valid call writes outputs; message reset", test_valid_call_and_message_reset},
    {"caller workspace: exact size, size - 1, guards; size query", test_workspace},
    {"workspace size query with gradients", test_workspace_size_with_grads},
    {"parameters and bounds", test_params},
    {"threads clamped to the CPUs available", test_threads_fit_the_machine},
    {"status strings", test_status_strings},
    {"context, initialisers, linear views, BLIS query", test_small_entry_points},
    {"optional outputs", test_optional_outputs},
    {"overlapping buffers refused, nothing written", test_overlapping_buffers},
};
const tu_suite suite_contracts = {tests, TU_COUNT(tests)};
