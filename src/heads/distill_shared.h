/* What the two distillation heads (distill.c: a teacher head; distill_topk.c: a teacher's top-k) share: the options
 * they have alike, checked alike; the rows that count and their upstream coefficients; the reduced outputs from each
 * row's divergence and cross-entropy. */
#ifndef FH_DISTILL_SHARED_H
#define FH_DISTILL_SHARED_H

#include "core/linear.h"
#include "counted_rows.h"

/* The options both heads have, by value. */
typedef struct fh_distill_terms {
    double temperature, weight_soft_loss, weight_hard_loss;
    int64_t ignore_index;
    fh_reduction reduction;
} fh_distill_terms;

/* The weights (finite, >= 0), the temperature (1/temperature a positive finite fp32), the reduction, and the targets
 * (NULL only without a hard loss; each in [0, V) or ignore_index). */
fh_status fh_distill_check_terms(fh_context *ctx, const fh_linear *student, const int64_t *targets,
                                 const fh_distill_terms *t);

/* out not NULL, with per_token_loss for 'none'. */
fh_status fh_distill_check_outputs(fh_context *ctx, fh_reduction reduction, const fh_distill_outputs *out);

/* The most buffers a teacher has (a teacher head's x, weight and bias). */
#define FH_DISTILL_TEACHER_BUFFERS 3

/* No output (out's, grads' when not NULL) overlaps an input (targets, grad_output when given, the head's teacher_count
 * teacher buffers, the student's), another output or the workspace. */
fh_status fh_distill_check_apart(fh_context *ctx, const fh_linear *student, const int64_t *targets,
                                 fh_reduction reduction, const float *grad_output, const fh_buffer *teacher,
                                 int teacher_count, const fh_distill_outputs *out, const fh_linear_grads *grads);

/* grad_output (not NULL, finite: one value, or N for 'none') and the gradients. */
fh_status fh_distill_check_backward(fh_context *ctx, const fh_linear *student, fh_reduction reduction,
                                    const float *grad_output, const fh_linear_grads *grads);

/* Row i counts: no targets, or its target is not ignore_index. */
static inline int fh_distill_counted(const int64_t *targets, int64_t ignore_index, int64_t i)
{
    return !targets || targets[i] != ignore_index;
}

/* coef[i] = d objective / d l_i: the upstream gradient over the mean's count, 0 for a row that does not count (and for
 * every row of a mean over no row). */
void fh_distill_coefficients(int64_t n, const int64_t *targets, const fh_distill_terms *t, const float *grad_output,
                             double *coef);

/* The outputs from each row's divergence d[i] and, with targets, cross-entropy lse_u[i] - u_target[i]: per-token
 * losses (0 where a row does not count), the reduced loss and its parts. */
void fh_distill_write_outputs(int64_t n, const int64_t *targets, const fh_distill_terms *t, const double *d,
                              const double *lse_u, const double *u_target, fh_distill_outputs *out);

/* A distillation call on its counted rows (counted_rows.h): an ignored token has no loss and no gradient, so the
 * GEMMs of both heads skip it. Its per-row arrays are the upstream gradient ('none') and the per-token losses. */
typedef struct fh_distill_counted_call {
    const fh_linear *student;
    const fh_linear_grads *grads;
    const int64_t *targets;
    int64_t ignore_index;
    fh_reduction reduction;
    const float *grad_output;
    fh_distill_outputs *out;
    size_t teacher_row_bytes; /* the scratch a counted row of the head's teacher needs */
    /* The head's call on the whole problem (as self gives it) ... */
    fh_status (*whole)(fh_context *ctx, const void *self);
    /* ... and on the counted rows: their targets, upstream gradient and outputs, and teacher_row_bytes per row at
     * teacher_rows (8-byte aligned) for the teacher's counted rows. */
    fh_status (*counted)(fh_context *ctx, const void *self, const fh_counted_rows *rows, const int64_t *targets,
                         const float *grad_output, fh_distill_outputs *out, void *teacher_rows);
    const void *self;
} fh_distill_counted_call;

/* fh_counted_rows_run for a distillation call. */
fh_status fh_distill_run_counted(fh_context *ctx, const fh_distill_counted_call *call);

#endif
