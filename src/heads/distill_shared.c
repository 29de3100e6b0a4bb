/* What the two distillation heads share (distill_shared.h). */
#include "distill_shared.h"

#include "core/linear.h"

#include <math.h>

fh_status fh_distill_check_terms(fh_context *ctx, const fh_linear *student, const int64_t *targets,
                                 const fh_distill_terms *t)
{
    if (!(t->weight_soft_loss >= 0.0 && isfinite(t->weight_soft_loss)) ||
        !(t->weight_hard_loss >= 0.0 && isfinite(t->weight_hard_loss)))
        return fh_fail(ctx, FH_ERR_INVALID_DISTILL_OPTION,
                       "weight_soft_loss = %g and weight_hard_loss = %g must be finite and >= 0", t->weight_soft_loss,
                       t->weight_hard_loss);
    /* 1/temperature scales fp32 logits: it must be a finite, nonzero fp32 value. */
    if (!(t->temperature > 0.0 && isfinite(t->temperature) && isfinite((float)(1.0 / t->temperature)) &&
          (float)(1.0 / t->temperature) > 0.0f))
        return fh_fail(ctx, FH_ERR_INVALID_TEMPERATURE, "temperature = %g must be > 0 with 1/temperature in fp32 range",
                       t->temperature);
    if (t->reduction != FH_REDUCTION_MEAN && t->reduction != FH_REDUCTION_SUM && t->reduction != FH_REDUCTION_NONE)
        return fh_fail(ctx, FH_ERR_INVALID_REDUCTION, "reduction = %d is not mean (0), sum (1) or none (2)",
                       (int)t->reduction);
    if (!targets && t->weight_hard_loss != 0.0)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "targets are NULL and weight_hard_loss = %g needs them",
                       t->weight_hard_loss);
    for (int64_t i = 0; targets && i < student->n; i++)
        if (targets[i] != t->ignore_index && (targets[i] < 0 || targets[i] >= student->vocab))
            return fh_fail(ctx, FH_ERR_TARGET_OUT_OF_RANGE,
                           "targets[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld)", (long long)i,
                           (long long)targets[i], (long long)student->vocab, (long long)t->ignore_index);
    return FH_OK;
}

fh_status fh_distill_check_backward(fh_context *ctx, const fh_linear *student, fh_reduction reduction,
                                    const float *grad_output, const fh_linear_grads *grads)
{
    if (!grad_output)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "grad_output is NULL");
    const fh_status st = fh_check_grads(ctx, student, grads);
    if (st != FH_OK)
        return st;
    const int64_t count = reduction == FH_REDUCTION_NONE ? student->n : 1;
    for (int64_t i = 0; i < count; i++)
        if (!isfinite(grad_output[i]))
            return fh_fail(ctx, FH_ERR_INVALID_GRAD_OUTPUT, "grad_output[%lld] = %g is not finite", (long long)i,
                           (double)grad_output[i]);
    return FH_OK;
}

void fh_distill_coefficients(int64_t n, const int64_t *targets, const fh_distill_terms *t, const float *grad_output,
                             double *coef)
{
    double count = 0.0;
    for (int64_t i = 0; i < n; i++)
        count += fh_distill_counted(targets, t->ignore_index, i);
    /* A mean over no token is 0 with zero gradients, never NaN. */
    const double scale = t->reduction == FH_REDUCTION_MEAN ? (count > 0.0 ? 1.0 / count : 0.0) : 1.0;
    for (int64_t i = 0; i < n; i++) {
        const double g = grad_output[t->reduction == FH_REDUCTION_NONE ? i : 0];
        coef[i] = fh_distill_counted(targets, t->ignore_index, i) ? g * scale : 0.0;
    }
}

void fh_distill_write_outputs(int64_t n, const int64_t *targets, const fh_distill_terms *t, const double *d,
                              const double *lse_u, const double *u_target, fh_distill_outputs *out)
{
    double soft = 0.0, hard = 0.0, count = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double di = 0.0, ce = 0.0;
        if (fh_distill_counted(targets, t->ignore_index, i)) {
            di = d[i];
            ce = targets ? lse_u[i] - u_target[i] : 0.0;
            count += 1.0;
        }
        soft += di;
        hard += ce;
        if (out->per_token_loss)
            out->per_token_loss[i] = (float)(t->weight_soft_loss * di + t->weight_hard_loss * ce);
    }
    if (t->reduction == FH_REDUCTION_MEAN) {
        soft = count > 0.0 ? soft / count : 0.0;
        hard = count > 0.0 ? hard / count : 0.0;
    }
    if (out->loss)
        *out->loss = t->weight_soft_loss * soft + t->weight_hard_loss * hard;
    if (out->soft_loss)
        *out->soft_loss = soft;
    if (out->hard_loss)
        *out->hard_loss = hard;
}
