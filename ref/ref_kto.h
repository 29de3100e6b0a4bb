/* The KTO losses over materialized logits in double: the obviously-right path that the fused library's KTO head and
 * the finite-difference check are compared against. Not part of the installed library.
 *
 * Semantics are those of TRL's KTOTrainer._compute_loss (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8,
 * trl/trainer/kto_trainer.py) for one micro-batch on one process, as fusedhead.h states them:
 *
 *   B sequences of T tokens, token i = s T + t; labels[s] 1: desirable (TRL's "chosen"), 0: undesirable.
 *   z = x W + b;  logp_i = log_softmax(z_i)[target_i]  (0 when the target is outside [0, V): masked padding)
 *   l_s = sum_t m logp;  ref_s = ref_logps[s] or sum_t m ref_per_token_logps;  r_s = l_s - ref_s
 *   kl  = *kl, or max(mean_s kl_logratios_s, 0) (kto); 0 (apo_zero_unpaired)
 *   kto:               desirable 1 - sig(beta (r - kl)),  undesirable 1 - sig(beta (kl - r))
 *   apo_zero_unpaired: desirable 1 - sig(beta r),         undesirable sig(beta r)
 *   loss = (1 / B) sum_s w_s L_s (TRL's losses.nanmean() over the concatenated weighted losses)
 *   rewards = beta r
 * The reference log-probs and the KL term are constants; rewards and metrics carry no gradient. */
#ifndef FH_REF_KTO_H
#define FH_REF_KTO_H

#include <stdint.h>

typedef enum ref_kto_loss_type { REF_KTO_LOSS_KTO = 0, REF_KTO_LOSS_APO_ZERO_UNPAIRED } ref_kto_loss_type;

typedef struct ref_kto_options {
    ref_kto_loss_type loss_type;
    double beta, desirable_weight, undesirable_weight;
} ref_kto_options;

/* The loss head's inputs: per-token values, no logits. Token arrays are [batch, seq] row-major. */
typedef struct ref_kto_tokens {
    int64_t batch, seq;
    const double *logp, *mask;         /* required */
    const uint8_t *labels;             /* required, [batch] */
    const double *ref_logps;           /* [batch]; or NULL */
    const double *ref_per_token_logps; /* or NULL (exactly one of the two) */
    const double *kl;                  /* one value; or NULL */
    const double *kl_logratios;        /* [batch]; or NULL (kto: exactly one of the two; apo: neither) */
    const double *logit_means;         /* (1/V) sum_j z_ij per token, or NULL (logits metrics NaN) */
    const double *entropy;             /* per token, or NULL (entropy metric 0) */
} ref_kto_tokens;

typedef struct ref_kto_problem {
    int64_t batch, seq, hidden, vocab;
    const double *x;       /* [batch seq, hidden] */
    const double *weight;  /* [hidden, vocab] */
    const double *bias;    /* [vocab] or NULL */
    const int64_t *targets;
    const double *mask;
    const uint8_t *labels;
    const double *ref_logps, *ref_per_token_logps, *kl, *kl_logratios; /* as in ref_kto_tokens */
} ref_kto_problem;

typedef struct ref_kto_metrics { /* TRL's logged metrics (its non-Liger path); NaN where TRL logs nothing */
    double kl;
    double rewards_chosen, rewards_rejected, rewards_margins;
    double logps_chosen, logps_rejected;
    double logits_chosen, logits_rejected;
    double entropy;
} ref_kto_metrics;

typedef struct ref_kto_result {
    double loss;
    ref_kto_metrics metrics;
    /* Caller-allocated, each may be NULL: sequence_logps and rewards [batch], logp [batch seq] (written by
     * ref_kto_forward only). */
    double *sequence_logps, *rewards, *logp;
} ref_kto_result;

/* Return values: 0, -1 if memory runs out, -2 on invalid arguments (a NULL required array, non-positive sizes,
 * options out of range, not exactly one reference input, KL inputs other than the loss type's, a label other than
 * 0 / 1, a target out of range where the mask is non-zero). */

/* The loss head from per-token logp: fills r (may be NULL) and g_logp[i] = grad_output d loss / d logp_i (may be
 * NULL). */
int ref_kto_head(const ref_kto_tokens *tk, const ref_kto_options *o, double grad_output, ref_kto_result *r,
                 double *g_logp);

/* Materializes the logits, computes logp, the logits' means and entropies, then the head. */
int ref_kto_forward(const ref_kto_problem *p, const ref_kto_options *o, ref_kto_result *r);

/* Gradients of grad_output * loss: dx [batch seq, hidden], dweight [hidden, vocab], dbias [vocab]; each may be
 * NULL; all are overwritten. */
int ref_kto_backward(const ref_kto_problem *p, const ref_kto_options *o, double grad_output, double *dx,
                     double *dweight, double *dbias);

#endif
