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
    return targets ? fh_check_targets(ctx, targets, student->n, t->ignore_index, student->vocab) : FH_OK;
}

static fh_status check_outputs(fh_context *ctx, fh_reduction reduction, const fh_distill_outputs *out)
{
    if (!out)
        return fh_fail(ctx, FH_ERR_NULL_POINTER, "outputs are NULL");
    if (reduction == FH_REDUCTION_NONE && !out->per_token_loss)
        return fh_fail(ctx, FH_ERR_MISSING_OUTPUT, "reduction 'none' needs per_token_loss");
    return FH_OK;
}

/* No output (out's, grads' when not NULL) overlaps an input (targets, grad_output when given, the teacher's
 * buffers, the student's), another output or the workspace. */
static fh_status check_apart(fh_context *ctx, const fh_distill_kind *kind, const fh_distill_call *c,
                             fh_reduction reduction, const fh_linear_grads *grads)
{
    const size_t n = (size_t)c->student->n;
    fh_buffer inputs[2 + FH_DISTILL_TEACHER_BUFFERS] = {
        {"targets", c->targets, n * sizeof(int64_t)},
        {"grad_output", c->grad_output, (reduction == FH_REDUCTION_NONE ? n : 1) * sizeof(float)}};
    const int teacher_count = kind->teacher_buffers(c, inputs + 2);
    const fh_distill_outputs *out = c->out;
    const fh_buffer outputs[] = {{"loss", out->loss, sizeof(double)},
                                 {"soft_loss", out->soft_loss, sizeof(double)},
                                 {"hard_loss", out->hard_loss, sizeof(double)},
                                 {"per_token_loss", out->per_token_loss, n * sizeof(float)}};
    return fh_check_apart(ctx, c->student, grads, outputs, 4, inputs, 2 + teacher_count);
}

static fh_status check_backward(fh_context *ctx, const fh_linear *student, fh_reduction reduction,
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

fh_engine_pass fh_distill_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *student,
                               const fh_pair_kernels *kernels)
{
    const fh_engine_pass p = {.plan = plan, .ws = ws, .lin = student, .tf = FH_IDENTITY_TRANSFORM, .pair = kernels};
    return p;
}

/* The counted-rows driver's view of a call. */
typedef struct counted_call {
    const fh_distill_kind *kind;
    const fh_distill_call *c;
    fh_reduction reduction;
} counted_call;

static fh_status whole(fh_context *ctx, const void *self)
{
    const counted_call *d = self;
    return d->kind->run(ctx, d->c);
}

/* The arrays: the upstream gradient ('none') in a[0], the per-token losses in a[1]. */
static fh_status counted(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                         float *const *a, void *extra)
{
    const counted_call *d = self;
    const fh_distill_call *c = d->c;
    fh_distill_outputs out = *c->out;
    out.per_token_loss = a[1];
    const fh_distill_call compacted = {&rows->lin, c->teacher, targets, c->options,
                                       d->reduction == FH_REDUCTION_NONE ? a[0] : c->grad_output, &out,
                                       c->grads ? &rows->grads : NULL};
    return d->kind->run_counted(ctx, &compacted, rows, extra);
}

fh_status fh_distill_entry(fh_context *ctx, const fh_distill_kind *kind, const fh_distill_call *c, int train_step)
{
    fh_status st = fh_check_call(ctx, c->student);
    if (st == FH_OK)
        st = kind->check(ctx, c);
    if (st != FH_OK)
        return st;
    const fh_distill_terms t = kind->terms(c->options);
    st = check_outputs(ctx, t.reduction, c->out);
    if (st == FH_OK)
        st = check_apart(ctx, kind, c, t.reduction, NULL);
    if (st == FH_OK && train_step)
        st = check_backward(ctx, c->student, t.reduction, c->grad_output, c->grads);
    if (st == FH_OK && train_step)
        st = check_apart(ctx, kind, c, t.reduction, c->grads);
    if (st != FH_OK)
        return st;
    const counted_call d = {kind, c, t.reduction};
    const float *const in[] = {t.reduction == FH_REDUCTION_NONE ? c->grad_output : NULL};
    float *const out[] = {c->out->per_token_loss};
    /* Gradient filtering does not apply to distillation; one input and one output keep extra 8-byte aligned. */
    const fh_counted_call call = {.lin = c->student, .grads = c->grads,
                                  .targets = c->targets, .ignore_index = t.ignore_index,
                                  .in = in, .inputs = 1, .out = out, .outputs = 1,
                                  .extra_row_bytes = kind->teacher_row_bytes(c->teacher),
                                  .whole = whole, .counted = counted, .self = &d};
    return fh_counted_rows_run(ctx, &call);
}
