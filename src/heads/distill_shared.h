/* What the two distillation heads (distill.c: a teacher head; distill_topk.c: a teacher's top-k) share: the options
 * they have alike, checked alike; the rows that count and their upstream coefficients; the reduced outputs from each
 * row's divergence and cross-entropy. */
#ifndef FH_DISTILL_SHARED_H
#define FH_DISTILL_SHARED_H

#include "core/context.h"

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

#endif
