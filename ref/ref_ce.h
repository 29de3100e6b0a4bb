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
    double logit_scale;         /* m of z = softcap > 0 ? c tanh(m u / c) : m u; 1 for none */
    int token_scaling;          /* DFT: each token's loss times p_y, as a constant (no gradient through it) */
    const double *token_scales; /* with token_scaling: [n] constants in place of p_y (finite differences hold them
                                   fixed at p_y); NULL: p_y */
    const ref_filter *filter; /* NULL: exact gradients; else dx and dweight as that filter leaves them */
} ref_ce_options;

typedef struct ref_ce_result {
    double loss;   /* reduced (sum of per-token losses for none) */
    double z_loss; /* z-loss part, reduced like the loss */
    double *per_token_loss, *logp, *lse, *entropy; /* [n] each, caller-allocated, may be NULL; entropy 0 where
                                                       ignored */
    int64_t *argmax;                                /* [n] or NULL */
    int64_t correct; /* non-ignored tokens whose argmax (lowest index of the largest z) is their target */
} ref_ce_result;

/* z of one logit u (o's logit_scale and softcap), and dz/du when dzdu is not NULL. */
double ref_ce_transform(const ref_ce_options *o, double u, double *dzdu);

/* Returns 0, or -1 if memory runs out. */
int ref_ce_forward(const ref_linear *lin, const int64_t *targets, const ref_ce_options *o, ref_ce_result *r);

/* Gradients of the loss scaled by grad_output (1 value, or n for none). dx [n, hidden], dweight
 * [hidden, vocab], dbias [vocab]; each may be NULL; all are overwritten. */
int ref_ce_backward(const ref_linear *lin, const int64_t *targets, const ref_ce_options *o,
                    const double *grad_output, double *dx, double *dweight, double *dbias);

#endif
