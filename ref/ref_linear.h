/* The linear layer under every reference head, in double and materialized: u = x W + b forward, and the
 * gradients dx = dU W^T, dW = x^T dU, db = sum_i dU_i from a head's d loss / d u. Not part of the installed
 * library. */
#ifndef FH_REF_LINEAR_H
#define FH_REF_LINEAR_H

#include <stdint.h>

typedef struct ref_linear {
    int64_t n, hidden, vocab;
    const double *x;      /* [n, hidden] contiguous */
    const double *weight; /* [hidden, vocab] contiguous */
    const double *bias;   /* [vocab] or NULL */
} ref_linear;

/* u = x W + b, [n, vocab], malloc'd (the caller frees it); NULL if memory runs out. */
double *ref_linear_logits(const ref_linear *lin);

/* dx [n, hidden] = du W^T, dweight [hidden, vocab] = x^T du, dbias [vocab] = sum_i du_i, from du [n, vocab];
 * each output may be NULL; all are overwritten. */
void ref_linear_backward(const ref_linear *lin, const double *du, double *dx, double *dweight, double *dbias);

/* log sum_j exp(u_j) over one row of `vocab` logits, shifted by the row's maximum. */
double ref_linear_row_lse(const double *u, int64_t vocab);

#endif
