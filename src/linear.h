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
fh_status fh_check_grads(fh_context *ctx, const fh_linear *lin, const fh_linear_grads *grads);

#endif
