/* The GRPO loss family over materialized logits in double: the obviously-right path that the fused library's
 * GRPO head and the finite-difference checks are compared against. Not part of the installed library.
 *
 * Semantics are those of TRL's GRPOTrainer._compute_loss (TRL 1.16.0, trl/trainer/grpo_trainer.py; first written to
 * huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8, whose luspo reduction and entropy-bonus normaliser
 * 1.16.0 changed) for one micro-batch on one process (current_gradient_accumulation_steps = 1,
 * num_processes = 1), every option that changes the loss or its gradient; include/fusedhead.h states the same
 * formulas for the library:
 *
 *   z      = (x W + b) / temperature                          tempered logits, one row per token i = b*T + t
 *   logp_i = log_softmax(z_i)[completion_ids_i]
 *   H_i    = lse(z_i) - sum_j p_ij z_ij                        entropy of the tempered distribution
 *   m_i    = completion_mask;  n_b = sum_t m;  n'_b = max(n_b, 1)
 *   old    = old_logp, or sg(logp) when absent (on-policy: ratio 1, gradient still flows through logp)
 *   token level:          lw_i = logp_i - old_i
 *   sequence level:       lw_i = s_b = sum_t m (logp - old) / n'_b   (GSPO; the gradient flows through the mean
 *                         into every masked token of the row, as in TRL)
 *   sequence_token level: lw_i = logp_i - sg(logp_i) + sg(s_b)   (GSPO-token, trl/experimental/gspo_token)
 *   r_i    = exp(lw_i)                                          (TRL's coef_1)
 *   grpo, bnpo, dr_grpo, dapo, luspo: c2 = clamp(r, 1 - eps_low, 1 + eps_high); c1 = min(r, delta) if delta else r
 *                              pol_i = -min(c1 A_b, c2 A_b)
 *   cispo:                     pol_i = -sg(min(r, eps_high)) A_b logp_i   (eps_high is an absolute cap)
 *   sapo:                      tau = A_b > 0 ? tau_pos : tau_neg;  pol_i = -sigmoid(tau (r - 1)) (4 / tau) A_b
 *   vespo:                     pol_i = -sg(phi_b) A_b logp_i, TRL's get_gamma_weights:
 *                              log w = clamp(sum_t m clamp(sg(logp) - old, -20, 20) [+ sum_t clamp(log is_t,
 *                              log 1e-8, 20), all T positions, when the correction applies], log 1e-8, 20),
 *                              (k, lam) = A_b >= 0 ? (k_pos, lam_pos) : (k_neg, lam_neg), lam = max(lam, 1e-4),
 *                              phi_b = exp(lam + k log w - lam exp(log w)), 0 where not finite
 *   is_i   (the vLLM importance-sampling correction: sampling_logp given and vllm_importance_sampling_correction;
 *           detached): token modes exp((old_i - samp_i) m_i), sequence modes exp(sum_t (old - samp) m) for every
 *           token of the row; *_truncate clamps to [clip_min, clip_max], *_mask sets a ratio outside them to 0
 *           (a NaN bound is absent)
 *   keep_b (off_policy_mask_threshold set): A_b >= 0 or sum_t m (samp - sg(logp)) / n'_b <= threshold, samp =
 *           sampling_logp, else old
 *   e_i    (top_entropy_quantile q < 1): m_i != 0 and H_i m_i >= Q, Q = torch.quantile (linear) at 1 - q of the
 *           entropies of the tokens with m != 0 (none: e = 0), all in fp32 as TRL's entropies are; e_i = 1 when
 *           q = 1. A comparison: no gradient.
 *   l_i    = pol_i keep_b e_i [is_i, not for vespo] + beta kl_i [r_i with use_bias_correction_kl, the gradient
 *            flowing through r too]   (kl_i = exp(ref - logp) - (ref - logp) - 1, only when beta != 0)
 *            [- entropy_coef H_i with REF_GRPO_ENTROPY_PER_TOKEN]
 *   loss   grpo, sapo: mean_b( sum_t m l / n'_b )
 *          bnpo:       sum m l / max(sum m, 1)
 *          dr_grpo:    sum m l / (B * max_completion_length)
 *          dapo, cispo, vespo: sum m l / N,  N = max(num_items_in_batch, 1) (TRL clamps it), or max(sum m, 1)
 *                      when it is <= 0 or NaN
 *          luspo:      mean_b( sum_t m l )
 *          [- entropy_coef sum e m H / max(sum e m, 1), every loss type, with REF_GRPO_ENTROPY_TRL]
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
    REF_GRPO_LOSS_SAPO,
    REF_GRPO_LOSS_LUSPO,
    REF_GRPO_LOSS_VESPO
} ref_grpo_loss_type;

typedef enum ref_grpo_is_level {
    REF_GRPO_IS_TOKEN = 0,      /* TRL importance_sampling_level="token" */
    REF_GRPO_IS_SEQUENCE,       /* TRL importance_sampling_level="sequence" (GSPO) */
    REF_GRPO_IS_SEQUENCE_TOKEN  /* TRL experimental GSPO-token ("sequence_token") */
} ref_grpo_is_level;

typedef enum ref_grpo_vllm_is_mode { /* TRL vllm_importance_sampling_mode */
    REF_GRPO_VLLM_IS_TOKEN_TRUNCATE = 0,
    REF_GRPO_VLLM_IS_TOKEN_MASK,
    REF_GRPO_VLLM_IS_SEQUENCE_TRUNCATE,
    REF_GRPO_VLLM_IS_SEQUENCE_MASK
} ref_grpo_vllm_is_mode;

typedef enum ref_grpo_entropy_bonus {
    /* TRL 1.16.0's entropy_coef: loss -= entropy_coef * sum(e m H) / max(sum e m, 1) for every loss type (e: the
     * top-entropy mask; static coefficient only, the adaptive controller is trainer state, not a loss). */
    REF_GRPO_ENTROPY_TRL = 0,
    /* The original issue's form: l_i -= entropy_coef * H_i, then the loss_type's reduction. Not in TRL. */
    REF_GRPO_ENTROPY_PER_TOKEN
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
    double num_items_in_batch;                 /* dapo/cispo/vespo normaliser as TRL finally divides by it (already
                                                  divided by processes etc.), clamped to >= 1 as TRL does; <= 0 or
                                                  NaN (default): max(sum of mask, 1) */
    int64_t max_completion_length;             /* dr_grpo's constant; <= 0 (default): T */
    double entropy_coef;                       /* entropy bonus, 0.0 */
    ref_grpo_entropy_bonus entropy_bonus;      /* how the bonus enters; default TRL's */
    double top_entropy_quantile;               /* 1.0: no entropy mask; in [0, 1] */
    double off_policy_mask_threshold;          /* NaN (default): no off-policy mask */
    int use_bias_correction_kl;                /* 0 */
    int vllm_importance_sampling_correction;   /* 1; applies when the tokens have sampling_logp */
    ref_grpo_vllm_is_mode vllm_importance_sampling_mode; /* sequence_mask */
    double vllm_importance_sampling_clip_min;  /* NaN: none */
    double vllm_importance_sampling_clip_max;  /* 3.0; NaN: none */
    double vespo_k_pos, vespo_lambda_pos;      /* 2.0, 3.0 */
    double vespo_k_neg, vespo_lambda_neg;      /* 3.0, 2.0 */
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
     * above (the on-policy old, cispo's clamped ratio, GSPO-token's sg(logp) and sg(s_b), vespo's phi, the
     * off-policy mask, the importance-sampling ratio of an on-policy batch) is evaluated with logp replaced by
     * sg_logp. With sg_logp = logp (what NULL means) this is TRL; with sg_logp frozen at the logp of a base
     * point, the loss becomes a plain function whose derivative at that point is the autograd gradient TRL
     * computes, which finite differences can check. */
    const double *sg_logp;
    const double *sampling_logp;   /* the sampler's log-probs (TRL sampling_per_token_logps), or NULL */
    /* The entropies the top-entropy mask compares, for finite-difference checks only (as sg_logp; NULL: entropy):
     * the mask is a step function of the entropies, which must not move under a finite-difference step. */
    const double *sg_entropy;
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
    const double *sampling_logp, *sg_entropy;                                   /* as in ref_grpo_tokens */
} ref_grpo_problem;

typedef struct ref_grpo_metrics {
    /* TRL's logged values for this micro-batch. kl and entropy: masked means over all completion tokens,
     * sum(mask x) / max(sum mask, 1) (kl of l's KL term: times r with use_bias_correction_kl). The clip ratios
     * use coef_1 after the delta clamp, as TRL does; at the sequence level coef_1 is one value per sequence and
     * TRL averages the flags over the batch rows (x.mean(), every row counted, masked-out rows too), at the token
     * and sequence_token levels it takes the masked token mean. NaN where TRL logs nothing. */
    double kl;               /* NaN when beta == 0 */
    double entropy;          /* NaN without entropies */
    double clip_low_mean;    /* clip_ratio/low_mean:    c1 < 1 - eps_low  and A < 0; clipped family and luspo */
    double clip_high_mean;   /* clip_ratio/high_mean:   c1 > 1 + eps_high and A > 0; clipped family and luspo */
    double clip_region_mean; /* clip_ratio/region_mean: either;                       clipped family and luspo */
    double cispo_clip_ratio; /* cispo_clip_ratio: r > eps_high and A > 0; NaN unless cispo */
    /* clip_ratio/low_min, clip_ratio/high_max: TRL's nanmin / nanmax over the rows of masked_seq_mean of the flag,
     * sum_t m flag / sum_t m (an empty row: 0 / 0 = NaN, skipped; every row NaN: NaN); at the sequence level the
     * row's flag. Clipped family and luspo. */
    double clip_low_min, clip_high_max;
    double policy_loss;      /* the loss before TRL's entropy bonus; entropy_coef != 0 only */
    double entropy_coef;     /* entropy_coef != 0 only */
    double vespo_phi_seq_mean; /* vespo/phi_seq_mean: mean over the B rows of phi_b; vespo only */
    /* sampling/...: only when the importance-sampling correction applies. |old - samp| over the tokens with
     * m != 0 (mean, max); the ratio is over the tokens with m != 0 in token modes and over all B rows in sequence
     * modes (min, mean, max); 0 when there is nothing to take them over. */
    double sampling_logp_diff_mean, sampling_logp_diff_max;
    double is_ratio_min, is_ratio_mean, is_ratio_max;
} ref_grpo_metrics;

typedef struct ref_grpo_result {
    double loss;
    ref_grpo_metrics metrics;
    /* [batch*seq] each, caller-allocated, may be NULL. logp and entropy are written by ref_grpo_forward only
     * (ref_grpo_head takes them as inputs). per_token_loss is TRL's per_token_loss before masking (l_i above,
     * broadcast over the row at the sequence level, including the per-token entropy term when that mode is
     * on); ratio is coef_1 = exp(lw_i) before any clamp; per_token_kl is 0 when beta == 0. */
    double *logp, *entropy, *per_token_loss, *ratio, *per_token_kl;
    /* [batch*seq] each, may be NULL: the detached factors of the policy term, keep_b * e_i * is_i as l_i applies
     * them (1 where an option is off; is_i only where it multiplies, i.e. not for vespo); the policy term itself
     * (pol_i times those factors: l_i without the KL and the per-token entropy term); the vLLM importance-sampling
     * ratio after its bounds (1 where the correction does not apply; the row's in the sequence modes); vespo's phi_b
     * and log w_b (after its clamp) broadcast over the row (NaN unless vespo); and d loss / d l_i, the weight of
     * l_i in the loss type's reduction. */
    double *policy_factor, *policy_term, *is_ratio, *vespo_phi, *vespo_log_w, *loss_weight;
} ref_grpo_result;

/* Return values of the functions below: 0, -1 if memory runs out, -2 on invalid arguments (a NULL required
 * array, non-positive sizes or temperature, beta != 0 without ref_logp, entropy_coef != 0 or
 * top_entropy_quantile < 1 without entropies, an unknown enum value, top_entropy_quantile outside [0, 1] or NaN,
 * a completion id out of range where the mask is non-zero; where the importance-sampling correction applies: a
 * *_truncate mode without a bound, clip_min >= clip_max, vespo with a sequence mode, as TRL refuses them). */

/* The loss head from per-token logp and entropy. Fills r (may be NULL) and the per-token coefficients of
 * grad_output * d loss: g_logp[i] = d/d logp_i and g_entropy[i] = d/d H_i (each [batch*seq], may be NULL),
 * with TRL's autograd semantics (stop-gradients, min ties split half/half, clamp passing the gradient at its
 * bounds). This is what the fused library's head is compared against. */
int ref_grpo_head(const ref_grpo_tokens *tk, const ref_grpo_options *o, double grad_output, ref_grpo_result *r,
                  double *g_logp, double *g_entropy);

/* d loss / d u for one token's row of untempered logits u (z = u / temperature), from its coefficients:
 * du_j = (g_logp (onehot_j - p_j) - g_entropy p_j (z_j - sum_k p_k z_k)) / temperature.
 * A target outside [0, vocab) has the constant log-prob 0 (ref_grpo_forward): g_logp is not used then. */
void ref_grpo_row_grad(const double *u, int64_t vocab, double temperature, int64_t target, double g_logp,
                       double g_entropy, double *du);

/* torch.quantile(values, q) (linear interpolation) as torch computes it for fp32 entropies: the values rounded to
 * fp32, the rank q (n - 1) in fp32, torch.lerp of its two neighbours in fp32. Rounds and sorts values[0..n) in
 * place; n >= 1. */
double ref_grpo_quantile(double *values, int64_t n, double q);

/* Materializes the logits, computes logp and entropy, then the head. */
int ref_grpo_forward(const ref_grpo_problem *p, const ref_grpo_options *o, ref_grpo_result *r);

/* Gradients of grad_output * loss: dx [batch*seq, hidden] = dU W^T, dweight [hidden, vocab] = x^T dU,
 * dbias [vocab] = sum_i dU_i; each may be NULL; all are overwritten. */
int ref_grpo_backward(const ref_grpo_problem *p, const ref_grpo_options *o, double grad_output, double *dx,
                      double *dweight, double *dbias);

#endif
