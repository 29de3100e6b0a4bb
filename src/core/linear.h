/* Validation of the linear-head description and of gradient outputs, shared by every head. */
#ifndef FH_LINEAR_H
#define FH_LINEAR_H

#include "context.h"

/* The checks every entry point starts with: ctx not NULL (else FH_ERR_NULL_POINTER, nothing written),
 * its message cleared, then lin and (if asked) its finiteness. */
fh_status fh_check_call(fh_context *ctx, const fh_linear *lin);
fh_status fh_check_linear(fh_context *ctx, const fh_linear *lin);
/* With FH_PARAM_CHECK_FINITE set: FH_ERR_NONFINITE_INPUT if x, weight or bias holds NaN or Inf. */
fh_status fh_check_finite(fh_context *ctx, const fh_linear *lin);
/* Each of the n targets in [0, vocab) or ignore_index (FH_ERR_TARGET_OUT_OF_RANGE names the first that is not). */
fh_status fh_check_targets(fh_context *ctx, const int64_t *targets, int64_t n, int64_t ignore_index, int64_t vocab);

/* Betas, dtypes, strides and the bias of the gradients asked for; their overlaps are fh_check_apart's. */
fh_status fh_check_grads(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads);

/* A head's own buffer for the overlap check: name, first byte, size in bytes (p NULL: absent). x, the weight, the
 * bias, the gradients and the caller's workspace are this layer's. */
typedef struct fh_buffer {
    const char *name;
    const void *p;
    size_t bytes;
} fh_buffer;
#define FH_MAX_BUFFERS 12

/* The bytes a rows x cols view at these strides spans, from its first element to its last (a view check_matrix
 * accepted, or p NULL). */
fh_buffer fh_view_buffer(const char *name, const void *p, int64_t rows, int64_t cols, int64_t row_stride,
                         int64_t col_stride, fh_dtype dtype);

/* FH_ERR_OVERLAPPING_BUFFERS naming the first pair in which one of `outputs`, of the gradients in grads (when not
 * NULL) or the caller's workspace overlaps one of `inputs`, x, the weight, the bias or another of them. A head leaves
 * out of `inputs` an input that its documented in-place form lets an output replace exactly. At most
 * FH_MAX_BUFFERS of each. */
fh_status fh_check_apart(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads, const fh_buffer *outputs,
                         int output_count, const fh_buffer *inputs, int input_count);

#endif
