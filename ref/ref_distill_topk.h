/* Top-k teacher distillation over materialized student logits in double: the obviously-right path that the fused
 * head (fh_distill_topk_*) and the finite-difference check are compared against. Not part of the installed library.
 *
 * Semantics are fusedhead.h's, TRL's ServerDistillationTrainer._compute_server_forward_kl_loss with _add_tail_bucket
 * and _jsd_divergence(beta = 0, support_mask) (trl/experimental/server_distillation/server_distillation_trainer.py at
 * f2cd57710ae345ea6428ae95363267fcf38a3dc8), written entry by entry as TRL's tensors hold them. Per counted token i,
 * the teacher's entries e < k (valid where logprobs > -inf; the others masked, their ids unread):
 *
 *   log p = log_softmax(u / temperature) over the vocabulary;  ls_e = log p[id_e], lt_e = logprobs_e
 *   no tail: xs_e = ls_e - logsumexp_valid(ls), xt_e = lt_e - logsumexp_valid(lt)
 *   tail:    xs_e = ls_e, xt_e = lt_e, and an entry more on each side: log(-expm1(min(logsumexp_valid(.), -1e-7)))
 *   D_i = sum over the valid entries and the tail of exp(xt) (xt - xs), 0 without any valid entry
 *   hard_i = logsumexp(u) - u[target_i];  l_i = weight_soft_loss D_i + weight_hard_loss hard_i
 *   mean over the counted tokens (0 when none), sum, or none (per token, 0 for ignored ones). */
#ifndef FH_REF_DISTILL_TOPK_H
#define FH_REF_DISTILL_TOPK_H

#include "ref_distill.h"

typedef struct ref_distill_topk_options {
    int add_tail;            /* 1 */
    double temperature;      /* 1.0; > 0 */
    double weight_soft_loss; /* 1.0; >= 0 */
    double weight_hard_loss; /* 0.0; >= 0, needs targets when non-zero */
    int64_t ignore_index;    /* -100 */
    int reduction;           /* 0 mean, 1 sum, 2 none (as fh_reduction) */
} ref_distill_topk_options;

void ref_distill_topk_options_default(ref_distill_topk_options *o);

/* The teacher: k entries per token, ids [n, k] and log-probs [n, k] (-inf: padding). */
typedef struct ref_topk_teacher {
    int64_t k;
    const int64_t *ids;
    const double *logprobs;
} ref_topk_teacher;

/* Returns 0, -1 if memory runs out, -2 on invalid arguments (sizes, options, a target or a valid entry's id outside
 * [0, vocab), a log-prob NaN or +inf). Fills r (may be NULL; the loss fields of ref_distill_result) and, if du is not
 * NULL, du [n, vocab] = d (grad_output loss) / du (grad_output: one value for mean and sum, n for none). */
int ref_distill_topk_head(int64_t n, int64_t vocab, const double *u, const ref_topk_teacher *teacher,
                          const int64_t *targets, const ref_distill_topk_options *o, const double *grad_output,
                          ref_distill_result *r, double *du);

/* Materializes the student's logits, runs the head and back-propagates through the linear layer (dx, dweight,
 * dbias each may be NULL; all NULL: the forward only). */
int ref_distill_topk_linear(const ref_linear *student, const ref_topk_teacher *teacher, const int64_t *targets,
                            const ref_distill_topk_options *o, const double *grad_output, ref_distill_result *r,
                            double *dx, double *dweight, double *dbias);

#endif
