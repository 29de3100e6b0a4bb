/* The linear head's shape, strides and overflow checks. */
#include "linear.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

FH_API fh_status fh_linear_init(fh_linear *lin, int64_t n, int64_t hidden, int64_t vocab, const void *x,
                                const void *weight, fh_layout layout, const float *bias)
{
    if (!lin)
        return FH_ERR_NULL_POINTER;
    if (layout != FH_LAYOUT_HV && layout != FH_LAYOUT_VH)
        return FH_ERR_INVALID_LAYOUT;
    fh_linear l = {n, hidden, vocab, x, hidden, weight, 0, 0, bias, FH_DTYPE_F32, FH_DTYPE_F32};
    l.w_stride_hidden = layout == FH_LAYOUT_HV ? vocab : 1;
    l.w_stride_vocab = layout == FH_LAYOUT_HV ? 1 : hidden;
    *lin = l;
    return FH_OK;
}

/* Offset of the last element of a rows x cols view, or -1 on overflow. */
static int64_t last_offset(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride)
{
    int64_t a, b, s;
    if (__builtin_mul_overflow(rows - 1, row_stride, &a) || __builtin_mul_overflow(cols - 1, col_stride, &b) ||
        __builtin_add_overflow(a, b, &s))
        return -1;
    return s;
}

/* Strides >= 1 whose elements do not overlap: the larger stride must step over the whole extent of
 * the smaller one (a dimension of size 1 never steps). */
static int strides_disjoint(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride)
{
    if (row_stride < 1 || col_stride < 1)
        return 0;
    if (rows == 1 || cols == 1)
        return 1;
    const int row_outer = row_stride >= col_stride;
    const int64_t inner_stride = row_outer ? col_stride : row_stride;
    const int64_t inner_count = row_outer ? cols : rows;
    const int64_t outer_stride = row_outer ? row_stride : col_stride;
    return outer_stride / inner_count >= inner_stride;
}

static fh_status check_matrix(fh_context *ctx, const char *name, int64_t rows, int64_t cols,
                              int64_t row_stride, int64_t col_stride, size_t element_size)
{
    if (!strides_disjoint(rows, cols, row_stride, col_stride))
        return fh_fail(ctx, FH_ERR_INVALID_STRIDE,
                       "%s: strides (%lld, %lld) for a %lld x %lld view are < 1, or the larger does not step over the "
                       "other dimension's extent (elements would interleave or overlap)", name,
                       (long long)row_stride, (long long)col_stride, (long long)rows, (long long)cols);
    /* Element offsets become byte offsets in pointer arithmetic: those must fit in ptrdiff_t too. */
    const int64_t last = last_offset(rows, cols, row_stride, col_stride);
    if (last < 0 || last > PTRDIFF_MAX / (int64_t)element_size)
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "%s: the last element's byte offset overflows 64 bits", name);
    return FH_OK;
}

static size_t dtype_bytes(fh_dtype dtype)
{
    return dtype == FH_DTYPE_BF16 ? sizeof(uint16_t) : sizeof(float);
}

static const char *dtype_name(fh_dtype dtype)
{
    return dtype == FH_DTYPE_F32 ? "fp32" : dtype == FH_DTYPE_BF16 ? "bf16" : "unknown";
}

/* Known dtypes, the same for x and weight (the GEMMs multiply like with like). */
static fh_status check_dtypes(fh_context *ctx, const fh_linear *lin)
{
    const fh_dtype dtypes[2] = {lin->x_dtype, lin->weight_dtype};
    const char *names[2] = {"x_dtype", "weight_dtype"};
    for (int k = 0; k < 2; k++)
        if (dtypes[k] != FH_DTYPE_F32 && dtypes[k] != FH_DTYPE_BF16)
            return fh_fail(ctx, FH_ERR_INVALID_DTYPE, "%s = %d is neither FH_DTYPE_F32 (0) nor FH_DTYPE_BF16 (1)",
                           names[k], (int)dtypes[k]);
    if (lin->x_dtype != lin->weight_dtype)
        return fh_fail(ctx, FH_ERR_INVALID_DTYPE, "x is %s but weight is %s: both must have the same dtype",
                       dtype_name(lin->x_dtype), dtype_name(lin->weight_dtype));
    return FH_OK;
}

fh_status fh_check_linear(fh_context *ctx, const fh_linear *lin)
{
    if (!lin)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_linear description is NULL");
    if (!lin->x || !lin->weight)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "%s is NULL", !lin->x ? "x (hidden states)" : "weight");
    if (lin->n < 1 || lin->hidden < 1 || lin->vocab < 1)
        return fh_fail(ctx, FH_ERR_INVALID_SIZE, "sizes must be >= 1: n = %lld, hidden = %lld, vocab = %lld",
                       (long long)lin->n, (long long)lin->hidden, (long long)lin->vocab);
    int64_t product;
    if (__builtin_mul_overflow(lin->n, lin->vocab, &product) ||
        __builtin_mul_overflow(lin->hidden, lin->vocab, &product) ||
        __builtin_mul_overflow(lin->n, lin->hidden, &product))
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "n, hidden and vocab products overflow 64 bits");
    /* The heads' per-token arrays (targets, ids, the workspace's doubles) span n x 8 bytes. */
    if (lin->n > PTRDIFF_MAX / (int64_t)sizeof(int64_t))
        return fh_fail(ctx, FH_ERR_SIZE_OVERFLOW, "n = %lld: its per-token arrays' bytes (n x 8) overflow 64 bits",
                       (long long)lin->n);
    fh_status st = check_dtypes(ctx, lin);
    const size_t element_size = dtype_bytes(lin->x_dtype);
    if (st == FH_OK)
        st = check_matrix(ctx, "x", lin->n, lin->hidden, lin->x_row_stride, 1, element_size);
    if (st == FH_OK)
        st = check_matrix(ctx, "weight", lin->hidden, lin->vocab, lin->w_stride_hidden, lin->w_stride_vocab,
                          element_size);
    return st;
}

/* ---- Overlapping buffers ----
 * A buffer spans its view's bytes from the first element to one past the last: two buffers whose spans intersect are
 * taken to overlap (interleaved views that never share an element are refused too; no caller needs them). */
fh_buffer fh_view_buffer(const char *name, const void *p, int64_t rows, int64_t cols, int64_t row_stride,
                         int64_t col_stride, fh_dtype dtype)
{
    const fh_buffer b = {name, p,
                         p ? (size_t)(last_offset(rows, cols, row_stride, col_stride) + 1) * dtype_bytes(dtype) : 0};
    return b;
}

static int intersect(const fh_buffer *a, const fh_buffer *b)
{
    const char *a0 = a->p, *b0 = b->p;
    return a0 && b0 && a0 < b0 + b->bytes && b0 < a0 + a->bytes;
}

/* FH_ERR_OVERLAPPING_BUFFERS naming the first of `outputs` that overlaps one of `others` or a later output. */
static fh_status check_buffers(fh_context *ctx, const fh_buffer *outputs, int count, const fh_buffer *others,
                               int others_count)
{
    for (int k = 0; k < count; k++) {
        for (int j = 0; j < others_count; j++)
            if (intersect(&outputs[k], &others[j]))
                return fh_fail(ctx, FH_ERR_OVERLAPPING_BUFFERS, "%s overlaps %s", outputs[k].name, others[j].name);
        for (int j = k + 1; j < count; j++)
            if (intersect(&outputs[k], &outputs[j]))
                return fh_fail(ctx, FH_ERR_OVERLAPPING_BUFFERS, "%s overlaps %s", outputs[k].name, outputs[j].name);
    }
    return FH_OK;
}

/* x, the weight and the bias. */
static void input_buffers(const fh_linear *lin, fh_buffer b[3])
{
    b[0] = fh_view_buffer("x", lin->x, lin->n, lin->hidden, lin->x_row_stride, 1, lin->x_dtype);
    b[1] = fh_view_buffer("the weight", lin->weight, lin->hidden, lin->vocab, lin->w_stride_hidden,
                          lin->w_stride_vocab, lin->weight_dtype);
    b[2] = fh_view_buffer("the bias", lin->bias, 1, lin->vocab, 0, 1, FH_DTYPE_F32);
}

/* dx, dweight and dbias (empty for those not asked for). */
static void grad_buffers(const fh_linear *lin, const fh_linear_grads *grads, fh_buffer b[3])
{
    b[0] = fh_view_buffer("dx", grads->dx, lin->n, lin->hidden, grads->dx_row_stride, 1, grads->dx_dtype);
    b[1] = fh_view_buffer("dweight", grads->dweight, lin->hidden, lin->vocab, lin->w_stride_hidden,
                          lin->w_stride_vocab, grads->dweight_dtype);
    b[2] = fh_view_buffer("dbias", grads->dbias, 1, lin->vocab, 0, 1, grads->dbias_dtype);
}

/* The caller's workspace, which every call writes (empty for the library's own). */
static fh_buffer workspace_buffer(const fh_context *ctx)
{
    const int callers = ctx && ctx->workspace_is_callers && ctx->workspace;
    const fh_buffer b = {"the caller's workspace", callers ? ctx->workspace : NULL, callers ? ctx->workspace_bytes : 0};
    return b;
}

fh_status fh_check_call(fh_context *ctx, const fh_linear *lin)
{
    if (!ctx)
        return FH_ERR_NULL_POINTER;
    fh_clear_message(ctx);
    ctx->filter_stats = (fh_filter_stats){0.0, 0.0}; /* the last call's, a refused one included */
    fh_status st = fh_check_linear(ctx, lin);
    if (st == FH_OK) {
        fh_buffer inputs[3];
        input_buffers(lin, inputs);
        const fh_buffer workspace = workspace_buffer(ctx);
        st = check_buffers(ctx, &workspace, 1, inputs, 3);
    }
    return st == FH_OK ? fh_check_finite(ctx, lin) : st;
}

fh_status fh_check_grads(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads)
{
    if (!grads)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "the fh_linear_grads description is NULL");
    const float betas[3] = {grads->dx_beta, grads->dweight_beta, grads->dbias_beta};
    const char *names[3] = {"dx_beta", "dweight_beta", "dbias_beta"};
    for (int k = 0; k < 3; k++)
        if (betas[k] != 0.0f && betas[k] != 1.0f)
            return fh_fail(ctx, FH_ERR_INVALID_BETA, "%s = %g: must be 0 (overwrite) or 1 (accumulate)",
                           names[k], (double)betas[k]);
    const fh_dtype dtypes[3] = {grads->dx_dtype, grads->dweight_dtype, grads->dbias_dtype};
    const char *dtype_names[3] = {"dx_dtype", "dweight_dtype", "dbias_dtype"};
    for (int k = 0; k < 3; k++) {
        if (dtypes[k] != FH_DTYPE_F32 && dtypes[k] != FH_DTYPE_BF16)
            return fh_fail(ctx, FH_ERR_INVALID_DTYPE, "%s = %d is not an fh_dtype", dtype_names[k], (int)dtypes[k]);
        /* The f32 accumulators behind a bf16 gradient exist on the bf16 path only. */
        if (dtypes[k] == FH_DTYPE_BF16 && lin->x_dtype != FH_DTYPE_BF16)
            return fh_fail(ctx, FH_ERR_INVALID_DTYPE, "%s is bf16 but x and weight are fp32: bf16 gradients "
                           "need bf16 inputs", dtype_names[k]);
    }
    if (grads->dx) {
        const fh_status st = check_matrix(ctx, "dx", lin->n, lin->hidden, grads->dx_row_stride, 1,
                                          dtype_bytes(grads->dx_dtype));
        if (st != FH_OK)
            return st;
    }
    /* dweight has the weight's strides but its own element size: its byte offsets must fit too. */
    if (grads->dweight) {
        const fh_status st = check_matrix(ctx, "dweight", lin->hidden, lin->vocab, lin->w_stride_hidden,
                                          lin->w_stride_vocab, dtype_bytes(grads->dweight_dtype));
        if (st != FH_OK)
            return st;
    }
    if (grads->dbias && !lin->bias)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "dbias requested but the linear head has no bias");
    return FH_OK;
}

fh_status fh_check_apart(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads, const fh_buffer *outputs,
                         int output_count, const fh_buffer *inputs, int input_count)
{
    fh_buffer outs[FH_MAX_BUFFERS + 4], others[FH_MAX_BUFFERS + 3];
    /* outputs or inputs may be NULL with a count of 0 (the MPI calls): memcpy's arguments must not be NULL. */
    if (output_count > 0)
        memcpy(outs, outputs, (size_t)output_count * sizeof *outs);
    if (input_count > 0)
        memcpy(others, inputs, (size_t)input_count * sizeof *others);
    int n_out = output_count;
    if (grads) {
        grad_buffers(lin, grads, outs + n_out);
        n_out += 3;
    }
    outs[n_out++] = workspace_buffer(ctx);
    input_buffers(lin, others + input_count);
    return check_buffers(ctx, outs, n_out, others, input_count + 3);
}

/* First non-finite element of a rows x cols view of dtype elements, or -1. */
static int64_t first_nonfinite(const void *a, fh_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                               int64_t col_stride)
{
    const float *f = a;
    const uint16_t *h = a;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const int64_t at = r * row_stride + c * col_stride;
            /* A bf16 value is not finite when its 8 exponent bits are all set. */
            if (dtype == FH_DTYPE_BF16 ? (h[at] & 0x7f80u) == 0x7f80u : !isfinite(f[at]))
                return r * cols + c;
        }
    return -1;
}

fh_status fh_check_finite(fh_context *ctx, const fh_linear *lin)
{
    if (!ctx->params[FH_PARAM_CHECK_FINITE])
        return FH_OK;
    int64_t at = first_nonfinite(lin->x, lin->x_dtype, lin->n, lin->hidden, lin->x_row_stride, 1);
    if (at >= 0)
        return fh_fail(ctx, FH_ERR_NONFINITE_INPUT, "x[%lld][%lld] is not finite", (long long)(at / lin->hidden),
                       (long long)(at % lin->hidden));
    at = first_nonfinite(lin->weight, lin->weight_dtype, lin->hidden, lin->vocab, lin->w_stride_hidden, lin->w_stride_vocab);
    if (at >= 0)
        return fh_fail(ctx, FH_ERR_NONFINITE_INPUT, "weight element (hidden %lld, vocab %lld) is not finite",
                       (long long)(at / lin->vocab), (long long)(at % lin->vocab));
    if (lin->bias && (at = first_nonfinite(lin->bias, FH_DTYPE_F32, 1, lin->vocab, 0, 1)) >= 0)
        return fh_fail(ctx, FH_ERR_NONFINITE_INPUT, "bias[%lld] is not finite", (long long)at);
    return FH_OK;
}

fh_status fh_check_targets(fh_context *ctx, const int64_t *targets, int64_t n, int64_t ignore_index, int64_t vocab)
{
    for (int64_t i = 0; i < n; i++)
        if (targets[i] != ignore_index && (targets[i] < 0 || targets[i] >= vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                           "targets[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld)", (long long)i,
                           (long long)targets[i], (long long)vocab, (long long)ignore_index);
    return FH_OK;
}
