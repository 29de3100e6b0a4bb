/* The distillation losses (forward KL, reverse KL, generalized JSD) over materialized logits in double: the
 * obviously-right path that the fused library's distillation head and the finite-difference checks are compared
 * against. Not part of the installed library.
 *
 * Semantics are fusedhead.h's (TRL's GKD generalized_jsd_loss, Liger-Kernel's distillation losses), per token i of
 * n, student logits u_s and teacher logits u_t over the same vocabulary:
 *
 *   s = u_s / temperature,  t = u_t / temperature,  p = softmax(s),  q = softmax(t)
 *   forward_kl:  D_i = sum_j q_j (log q_j - log p_j)
 *   reverse_kl:  D_i = sum_j p_j (log p_j - log q_j)
 *   jsd:         log m = logaddexp(log(1 - beta) + log p, log(beta) + log q),
 *                D_i = beta sum_j q_j (log q_j - log m_j) + (1 - beta) sum_j p_j (log p_j - log m_j);
 *                beta == 0 exactly is forward_kl and beta == 1 exactly reverse_kl (TRL's special cases; the
 *                mixture form tends to 0, not to the KLs, at those ends)
 *   hard_i = log sum_j exp(u_s_ij) - u_s_i[target_i]   (cross-entropy on the untempered student logits)
 *   l_i = weight_soft_loss D_i + weight_hard_loss hard_i over the counted tokens: those whose target is not
 *         ignore_index, or every token when targets is NULL (allowed only with weight_hard_loss == 0)
 *   mean: sum_i l_i / count (0 when nothing counts);  sum: sum_i l_i;  none: per-token l_i, 0 for ignored ones.
 * No temperature^2 factor. The teacher is a constant: only the student gets gradients. A probability that is 0
 * (underflow, or a -inf logit) contributes 0 to every sum (0 log 0 = 0).
 *
 * Top-k (0 < top_k < vocab; TRL 1.16.0's IWOPDTrainer.generalized_jsd_loss, trl/experimental/iw_opd/iw_opd_trainer.py):
 * D_i over the support S_i = the teacher's top_k of t (forward_kl, jsd at beta 0), the student's top_k of s
 * (reverse_kl, jsd at beta 1), or the union of both (jsd), ties to the lower id; with lp = log p, lq = log q:
 *   add_tail 0: xs = lp - logsumexp_S(lp), xt = lq - logsumexp_S(lq) over S;
 *   add_tail 1: xs = lp, xt = lq over S, plus one entry each, log(1 - exp(min(logsumexp_S(.), -1e-7)));
 *   D_i = the divergence above over those entries with p = exp(xs), q = exp(xt) (jsd: m = beta q + (1 - beta) p).
 * The support is a constant (no gradient through the selection). */
#ifndef FH_REF_DISTILL_H
#define FH_REF_DISTILL_H

#include "ref_linear.h"

#include <stdint.h>

typedef enum ref_divergence {
    REF_DIVERGENCE_FORWARD_KL = 0,
    REF_DIVERGENCE_REVERSE_KL,
    REF_DIVERGENCE_JSD
} ref_divergence;

typedef struct ref_distill_options {
    ref_divergence divergence; /* jsd */
    double beta;               /* 0.5; in [0, 1], used by jsd only */
    double temperature;        /* 1.0; > 0 */
    double weight_soft_loss;   /* 1.0; >= 0 */
    double weight_hard_loss;   /* 0.0; >= 0, needs targets when non-zero */
    int64_t ignore_index;      /* -100 */
    int reduction;             /* mean: 0 mean, 1 sum, 2 none (as fh_reduction) */
    int64_t top_k;             /* 0: the whole vocabulary; >= vocab likewise */
    int add_tail;              /* 1; read when 0 < top_k < vocab */
} ref_distill_options;

/* Sets the defaults (listed above: Liger's and TRL's). */
void ref_distill_options_default(ref_distill_options *o);

typedef struct ref_distill_result {
    double loss;            /* reduced; for none the sum of the per-token losses (as ref_ce) */
    double soft_loss;       /* the D_i part, reduced like loss, before weight_soft_loss */
    double hard_loss;       /* the hard_i part, likewise before weight_hard_loss; computed whenever targets are
                               given (whatever its weight), 0 without targets */
    double *per_token_loss; /* [n] l_i (0 for ignored tokens), caller-allocated, may be NULL */
} ref_distill_result;

/* Return values of the functions below: 0, -1 if memory runs out, -2 on invalid arguments (a NULL required array,
 * non-positive sizes, an option out of the ranges above, targets NULL with weight_hard_loss != 0, a target outside
 * [0, vocab) that is not ignore_index, student and teacher with different n or vocab). */

/* The loss head from student logits u_s and teacher logits u_t, [n, vocab] each (raw: bias included, before the
 * temperature). Fills r (may be NULL) and, if du_s is non-NULL, du_s [n, vocab] = d (grad_output loss) / d u_s:
 * grad_output is one value for mean and sum, n values for none (row i scaled by grad_output[i]); it may be NULL
 * when du_s is. This is what the fused library's head is compared against. */
int ref_distill_head(int64_t n, int64_t vocab, const double *u_s, const double *u_t, const int64_t *targets,
                     const ref_distill_options *o, const double *grad_output, ref_distill_result *r,
                     double *du_s);

/* Materializes both heads' logits (their hidden sizes may differ), runs the head, and back-propagates through the
 * student's linear layer: dx [n, student hidden], dweight [student hidden, vocab], dbias [vocab]; each may be NULL
 * (all NULL: the forward only, and grad_output may be NULL); all are overwritten. The teacher gets no gradient. */
int ref_distill_linear(const ref_linear *student, const ref_linear *teacher, const int64_t *targets,
                       const ref_distill_options *o, const double *grad_output, ref_distill_result *r, double *dx,
                       double *dweight, double *dbias);

#endif
