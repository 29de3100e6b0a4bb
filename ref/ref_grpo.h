/* The GRPO loss family over materialized logits in double: the obviously-right path that the fused library's
 * GRPO head and the finite-difference checks are compared against. Not part of the installed library.
 *
 * Semantics are those of TRL's GRPOTrainer._compute_loss (huggingface/trl, trl/trainer/grpo_trainer.py) for
 * one micro-batch on one process (current_gradient_accumulation_steps = 1, num_processes = 1), without the
 * vLLM importance-sampling correction, the top-entropy mask, the off-policy mask or the bias-corrected KL:
 *
 *   z      = (x W + b) / temperature                          tempered logits, one row per token i = b*T + t
 *   logp_i = log_softmax(z_i)[completion_ids_i]
 *   H_i    = lse(z_i) - sum_j p_ij z_ij                        entropy of the tempered distribution
 *   old    = old_logp, or sg(logp) when absent (on-policy: ratio 1, gradient still flows through logp)
 *   token level:          lw_i = logp_i - old_i
 *   sequence level:       lw_i = s_b = sum_t mask (logp - old) / max(sum_t mask, 1)   (GSPO; the gradient
 *                         flows through the mean into every masked token of the row, as in TRL)
 *   sequence_token level: lw_i = logp_i - sg(logp_i) + sg(s_b)   (GSPO-token, trl/experimental/gspo_token)
 *   r_i    = exp(lw_i)
 *   grpo, bnpo, dr_grpo, dapo: c2 = clamp(r, 1 - eps_low, 1 + eps_high); c1 = min(r, delta) if delta else r
 *                              pol_i = -min(c1 A_b, c2 A_b)
 *   cispo:                     pol_i = -sg(min(r, eps_high)) A_b logp_i   (eps_high is an absolute cap)
 *   sapo:                      tau = A_b > 0 ? tau_pos : tau_neg;  pol_i = -sigmoid(tau (r - 1)) (4 / tau) A_b
 *   l_i    = pol_i + beta kl_i  (kl_i = exp(ref - logp) - (ref - logp) - 1, only when beta != 0)
 *            [- entropy_coef H_i with REF_GRPO_ENTROPY_PER_TOKEN]
 *   loss   grpo, sapo: mean_b( sum_t mask l / max(sum_t mask, 1) )
 *          bnpo:       sum mask l / max(sum mask, 1)
 *          dr_grpo:    sum mask l / (B * max_completion_length)
 *          dapo, cispo: sum mask l / num_items_in_batch
 *          [- entropy_coef sum mask H / max(sum mask, 1) with REF_GRPO_ENTROPY_MASKED_MEAN]
 *
 * The mask multiplies literally, as in TRL: a non-finite per-token loss at a masked position poisons the loss.
 * The full derivation and the list of TRL facts this follows are in ref_grpo.c. */
#ifndef FH_REF_GRPO_H
#define FH_REF_GRPO_H

#include "ref_filter.h"

#include <stdint.h>

typedef enum ref_grpo_loss_type {
    REF_GRPO_LOSS_GRPO = 0,
    REF_GRPO_LOSS_BNPO,
    REF_GRPO_LOSS_DR_GRPO,
    REF_GRPO_LOSS_DAPO,
    REF_GRPO_LOSS_CISPO,
    REF_GRPO_LOSS_SAPO
} ref_grpo_loss_type;

typedef enum ref_grpo_is_level {
    REF_GRPO_IS_TOKEN = 0,      /* TRL importance_sampling_level="token" */
    REF_GRPO_IS_SEQUENCE,       /* TRL importance_sampling_level="sequence" (GSPO) */
    REF_GRPO_IS_SEQUENCE_TOKEN  /* TRL experimental GSPO-token ("sequence_token") */
} ref_grpo_is_level;

typedef enum ref_grpo_entropy_bonus {
    /* The form: l_i -= entropy_coef * H_i, then the loss_type's reduction. Not in TRL's GRPOTrainer. */
    REF_GRPO_ENTROPY_PER_TOKEN = 0,
    /* TRL's entropy_coef (recent GRPOConfig): loss -= entropy_coef * sum(mask H) / max(sum mask, 1), whatever
     * the loss_type (static coefficient only; the adaptive controller is trainer state, not a loss). */
    REF_GRPO_ENTROPY_MASKED_MEAN
} ref_grpo_entropy_bonus;

typedef struct ref_grpo_options {
    ref_grpo_loss_type loss_type;              /* default grpo */
    ref_grpo_is_level importance_sampling_level; /* default token */
    double temperature;                        /* 1.0; must be > 0 */
    double epsilon_low;                        /* TRL `epsilon`, 0.2 */
    double epsilon_high;                       /* NaN (default): epsilon_low. For cispo: the absolute cap */
    double delta;                              /* two-sided clipping bound on c1; <= 0 or NaN (default): off */
    double beta;                               /* KL coefficient, 0.0 (= TRL's current default): no KL */
    double sapo_temperature_pos;               /* 1.0 */
    double sapo_temperature_neg;               /* 1.05 */
    double num_items_in_batch;                 /* dapo/cispo normaliser as TRL finally divides by it (already
                                                  divided by processes etc.); <= 0 or NaN (default):
                                                  max(sum of mask, 1) */
    int64_t max_completion_length;             /* dr_grpo's constant; <= 0 (default): T */
    double entropy_coef;                       /* entropy bonus, 0.0 */
    ref_grpo_entropy_bonus entropy_bonus;      /* how the bonus enters; default per-token (the issue's) */
    const ref_filter *filter;                  /* NULL (default): exact gradients; else dx and dweight as that
                                                  gradient filter leaves them (ref_grpo_backward) */
} ref_grpo_options;

/* Sets TRL's defaults (listed above). */
void ref_grpo_options_default(ref_grpo_options *o);

/* The loss head's inputs: everything per token, no logits. All arrays are [batch, seq] row-major. */
typedef struct ref_grpo_tokens {
    int64_t batch, seq;
    const double *logp;            /* required */
    const double *entropy;         /* or NULL: then metrics.entropy is NaN and entropy_coef must be 0 */
    const double *completion_mask; /* required; 0/1 */
    const double *advantages;      /* [batch], required */
    const double *old_logp;        /* or NULL: on-policy, old = sg(logp) */
    const double *ref_logp;        /* required when beta != 0 */
    /* Stop-gradient anchor, for finite-difference checks only; leave NULL. Every sg(.) in the formulas
     * above (the on-policy old, cispo's clamped ratio, GSPO-token's sg(logp) and sg(s_b)) is evaluated with
     * logp replaced by sg_logp. With sg_logp = logp (what NULL means) this is TRL; with sg_logp frozen at the
     * logp of a base point, the loss becomes a plain function whose derivative at that point is the
     * autograd gradient TRL computes, which finite differences can check. */
    const double *sg_logp;
} ref_grpo_tokens;

/* The full problem: hidden states, lm_head and the per-token data. */
typedef struct ref_grpo_problem {
    int64_t batch, seq, hidden, vocab;
    const double *x;               /* [batch*seq, hidden], row i = b*seq + t */
    const double *weight;          /* [hidden, vocab] */
    const double *bias;            /* [vocab] or NULL */
    const int64_t *completion_ids; /* [batch, seq]; in [0, vocab) wherever the mask is non-zero (elsewhere an
                                      out-of-range id gives logp 0) */
    const double *completion_mask, *advantages, *old_logp, *ref_logp, *sg_logp; /* as in ref_grpo_tokens */
} ref_grpo_problem;

typedef struct ref_grpo_metrics {
    /* TRL's logged values for this micro-batch. kl and entropy: masked means over all completion tokens,
     * sum(mask x) / max(sum mask, 1). The clip ratios use coef_1 after the delta clamp, as TRL does; at the
     * sequence level coef_1 is one value per sequence and TRL averages the flags over the batch rows
     * (x.mean(), every row counted, masked-out rows too), at the token and sequence_token levels it takes the
     * masked token mean. */
    double kl;               /* NaN when beta == 0 */
    double entropy;          /* NaN without entropies */
    double clip_low_mean;    /* clip_ratio/low_mean:    c1 < 1 - eps_low  and A < 0; NaN unless clipped family */
    double clip_high_mean;   /* clip_ratio/high_mean:   c1 > 1 + eps_high and A > 0; NaN unless clipped family */
    double clip_region_mean; /* clip_ratio/region_mean: either;                       NaN unless clipped family */
    double cispo_clip_ratio; /* cispo_clip_ratio: r > eps_high and A > 0; NaN unless cispo */
} ref_grpo_metrics;

typedef struct ref_grpo_result {
    double loss;
    ref_grpo_metrics metrics;
    /* [batch*seq] each, caller-allocated, may be NULL. logp and entropy are written by ref_grpo_forward only
     * (ref_grpo_head takes them as inputs). per_token_loss is TRL's per_token_loss before masking (l_i above,
     * broadcast over the row at the sequence level, including the per-token entropy term when that mode is
     * on); ratio is coef_1 = exp(lw_i) before any clamp; per_token_kl is 0 when beta == 0. */
    double *logp, *entropy, *per_token_loss, *ratio, *per_token_kl;
} ref_grpo_result;

/* Return values of the functions below: 0, -1 if memory runs out, -2 on invalid arguments (a NULL required
 * array, non-positive sizes or temperature, beta != 0 without ref_logp, entropy_coef != 0 without entropies,
 * an unknown enum value, a completion id out of range where the mask is non-zero). */

/* The loss head from per-token logp and entropy. Fills r (may be NULL) and the per-token coefficients of
 * grad_output * d loss: g_logp[i] = d/d logp_i and g_entropy[i] = d/d H_i (each [batch*seq], may be NULL),
 * with TRL's autograd semantics (stop-gradients, min ties split half/half, clamp passing the gradient at its
 * bounds). This is what the fused library's head is compared against. */
int ref_grpo_head(const ref_grpo_tokens *tk, const ref_grpo_options *o, double grad_output, ref_grpo_result *r,
                  double *g_logp, double *g_entropy);

/* d loss / d u for one token's row of untempered logits u (z = u / temperature), from its coefficients:
 * du_j = (g_logp (onehot_j - p_j) - g_entropy p_j (z_j - sum_k p_k z_k)) / temperature.
 * target outside [0, vocab) means no one-hot term. */
void ref_grpo_row_grad(const double *u, int64_t vocab, double temperature, int64_t target, double g_logp,
                       double g_entropy, double *du);

/* Materializes the logits, computes logp and entropy, then the head. */
int ref_grpo_forward(const ref_grpo_problem *p, const ref_grpo_options *o, ref_grpo_result *r);

/* Gradients of grad_output * loss: dx [batch*seq, hidden] = dU W^T, dweight [hidden, vocab] = x^T dU,
 * dbias [vocab] = sum_i dU_i; each may be NULL; all are overwritten. */
int ref_grpo_backward(const ref_grpo_problem *p, const ref_grpo_options *o, double grad_output, double *dx,
                      double *dweight, double *dbias);

#endif
