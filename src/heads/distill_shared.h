/* What the two distillation heads (distill.c: a teacher head; distill_topk.c: a teacher's top-k) share: the options
 * they have alike, checked alike; the rows that count and their upstream coefficients; the reduced outputs from each
 * row's divergence and cross-entropy; the entry points' checks and their call on the counted rows, around what a head
 * gives of its own (fh_distill_kind). */
#ifndef FH_DISTILL_SHARED_H
#define FH_DISTILL_SHARED_H

#include "core/linear.h"
#include "counted_rows.h"
#include "engine/engine.h"

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

/* A pass over the student's logits with the head's pair kernels (no logit transform: the temperature is the
 * kernels'). */
fh_engine_pass fh_distill_pass(const fh_plan *plan, const fh_workspace *ws, const fh_linear *student,
                               const fh_pair_kernels *kernels);

/* One distillation call, either head's: its teacher and options are the head's own (distill.c: an fh_linear and
 * fh_distill_options; distill_topk.c: an fh_topk_teacher and fh_distill_topk_options). */
typedef struct fh_distill_call {
    const fh_linear *student;
    const void *teacher;
    const int64_t *targets;
    const void *options;
    const float *grad_output; /* the train step's; NULL in the forward */
    fh_distill_outputs *out;
    const fh_linear_grads *grads; /* NULL: the forward */
} fh_distill_call;

/* The most buffers a teacher has (a teacher head's x, weight and bias). */
#define FH_DISTILL_TEACHER_BUFFERS 3

/* What a head gives the entry points they share. */
typedef struct fh_distill_kind {
    /* The teacher's and the options' checks (after fh_check_call), in the head's order. */
    fh_status (*check)(fh_context *ctx, const fh_distill_call *c);
    /* What the options of both heads have. */
    fh_distill_terms (*terms)(const void *options);
    /* The teacher's buffers for the overlap check (at most FH_DISTILL_TEACHER_BUFFERS): returns their count. */
    int (*teacher_buffers)(const fh_distill_call *c, fh_buffer *buffers);
    /* The scratch one counted row of the teacher takes. */
    size_t (*teacher_row_bytes)(const void *teacher);
    /* The call on the whole problem ... */
    fh_status (*run)(fh_context *ctx, const fh_distill_call *c);
    /* ... and on the counted rows (counted_rows.h): counted is the compacted call but for its teacher, whose counted
     * rows go to teacher_rows (teacher_row_bytes each, 8-byte aligned). */
    fh_status (*run_counted)(fh_context *ctx, const fh_distill_call *counted, const fh_counted_rows *rows,
                             void *teacher_rows);
} fh_distill_kind;

/* A distillation entry point (train_step: forward_backward): fh_check_call, the head's checks, the outputs (out not
 * NULL; per_token_loss for 'none'), no output overlapping an input; for the train step grad_output (not NULL,
 * finite: one value, or N for 'none') and the gradients, then the overlaps again with them. Then the call, on the
 * counted rows when some row is ignored and some counts: an ignored token has no loss and no gradient, so the GEMMs
 * of both heads skip it (the per-row arrays: the upstream gradient for 'none', the per-token losses). */
fh_status fh_distill_entry(fh_context *ctx, const fh_distill_kind *kind, const fh_distill_call *c, int train_step);

#endif
