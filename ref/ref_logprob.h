/* The log-prob head over materialized logits in double: the obviously-right path that fh_logprob_* and its finite-
 * difference check are compared against. Not part of the installed library.
 *
 *   u = x W + b,  v = logit_scale u,  z = softcap > 0 ? softcap tanh(v / softcap) : v,  s = z / temperature
 *   lse_i = log sum_j exp(s_ij),  p = softmax(s_i),  logp_i = s_{i, y_i} - lse_i,  H_i = lse_i - sum_j p_ij s_ij
 *   L = sum_i g_logp_i logp_i + g_entropy_i H_i + g_lse_i lse_i     (the backward's objective)
 *   dL/ds_ij = g_logp_i ([j = y_i] - p_ij) - g_entropy_i p_ij (s_ij - lse_i + H_i) + g_lse_i p_ij
 *   dL/du_ij = dL/ds_ij (logit_scale / temperature) (1 - tanh^2(v_ij / softcap))   (the last factor 1 without cap)
 * Rows whose target is ignore_index: logp, H, lse 0 and no gradient.
 * Over a support (ref_logprob_support): s_ij = -inf for j outside row i's support, so that the sums, p and the
 * gradient are those over the support (its columns' dL/du 0). */
#ifndef FH_REF_LOGPROB_H
#define FH_REF_LOGPROB_H

#include "ref_linear.h"

typedef struct ref_logprob_options {
    int64_t ignore_index;
    double temperature, softcap, logit_scale;
} ref_logprob_options;

/* Upstream gradients, [n] each or NULL (0). */
typedef struct ref_logprob_grads {
    const double *logp, *entropy, *lse;
} ref_logprob_grads;

/* Per-token values (each [n] or NULL) and, with g, the gradients dx, dweight, dbias (each or NULL, overwritten).
 * Returns 0, or -1 when memory runs out. */
int ref_logprob(const ref_linear *lin, const int64_t *targets, const ref_logprob_options *o, double *logp,
                double *entropy, double *lse, const ref_logprob_grads *g, double *dx, double *dweight, double *dbias);

/* The same over a support: support[i V + j] non-zero where column j is in row i's (NULL: every column); a counted
 * row's target must be in it. */
int ref_logprob_support(const ref_linear *lin, const int64_t *targets, const unsigned char *support,
                        const ref_logprob_options *o, double *logp, double *entropy, double *lse,
                        const ref_logprob_grads *g, double *dx, double *dweight, double *dbias);

/* The backward's objective L at these inputs (for finite differences); NaN when memory runs out. */
double ref_logprob_objective(const ref_linear *lin, const int64_t *targets, const ref_logprob_options *o,
                             const ref_logprob_grads *g);
double ref_logprob_support_objective(const ref_linear *lin, const int64_t *targets, const unsigned char *support,
                                     const ref_logprob_options *o, const ref_logprob_grads *g);

#endif
