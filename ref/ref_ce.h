/* Materialized-logits cross-entropy in double: the obviously-right path that the fused library and the
 * finite-difference checks are compared against. Not part of the installed library. */
#ifndef FH_REF_CE_H
#define FH_REF_CE_H

#include "ref_filter.h"
#include "ref_linear.h"

#include <stdint.h>

typedef struct ref_ce_options {
    int64_t ignore_index;
    int reduction; /* 0 mean, 1 sum, 2 none (as fh_reduction) */
    double label_smoothing;
    const double *class_weights; /* [vocab] or NULL */
    double softcap;
    double z_loss;
    const ref_filter *filter; /* NULL: exact gradients; else dx and dweight as that filter leaves them */
} ref_ce_options;

typedef struct ref_ce_result {
    double loss;   /* reduced (sum of per-token losses for none) */
    double z_loss; /* z-loss part, reduced like the loss */
    double *per_token_loss, *logp, *lse; /* [n] each, caller-allocated, may be NULL */
    int64_t *argmax;                     /* [n] or NULL */
} ref_ce_result;

/* Returns 0, or -1 if memory runs out. */
int ref_ce_forward(const ref_linear *lin, const int64_t *targets, const ref_ce_options *o, ref_ce_result *r);

/* Gradients of the loss scaled by grad_output (1 value, or n for none). dx [n, hidden], dweight
 * [hidden, vocab], dbias [vocab]; each may be NULL; all are overwritten. */
int ref_ce_backward(const ref_linear *lin, const int64_t *targets, const ref_ce_options *o,
                    const double *grad_output, double *dx, double *dweight, double *dbias);

#endif
