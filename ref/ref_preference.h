/* The preference losses (DPO, CPO, SimPO, ORPO) over materialized logits in double: the obviously-right path that
 * the fused library's preference head and the finite-difference checks are compared against. Not part of the
 * installed library.
 *
 * Semantics are those of TRL's DPOTrainer, CPOTrainer (SimPO is its loss_type "simpo") and ORPOTrainer for one
 * micro-batch on one process, as fusedhead.h states them:
 *
 *   2B sequences of T tokens, chosen ones first: pair b is sequences b and B + b; token i = s T + t.
 *   z      = x W + b;  logp_i = log_softmax(z_i)[target_i]  (0 when the target is outside [0, V): masked padding)
 *   l_s    = sum_t m logp, or that / max(sum_t m, 1) for loss_type ipo, simpo and orpo ("averaged")
 *   c_b, r_b = l of sequences b and B + b;  ref_s likewise from the reference log-probs (dpo; 0 without them)
 *   dpo:    u = (c - ref_c) - (r - ref_r);  cpo: u = c - r;  simpo: u = c - r - simpo_gamma / beta
 *           sigmoid  -(1 - ls) log sig(beta u) - ls log sig(-beta u)
 *           robust   (-(1 - ls) log sig(beta u) + ls log sig(-beta u)) / (1 - 2 ls)
 *           hinge    relu(1 - beta u)              ipo  (u - 1 / (2 beta))^2
 *   orpo:   o = (c - r) - (log(1 - e^c) - log(1 - e^r)),  pair loss -beta log sig(o)
 *   NLL    = -sum_{chosen i} m logp / max(sum_{chosen} m, 1)
 *   loss   = mean_b pair loss + alpha NLL,  alpha = rpo_alpha (dpo), cpo_alpha (cpo, simpo), 1 (orpo)
 *   rewards: beta (l - ref) for dpo, beta l otherwise
 * That is dpo at TRL v0.28.0 (dpo_semantics REF_PREFERENCE_TRL_0_28). At TRL's current semantics (the default) l and
 * ref are sums for every loss type, the loss is the weighted sum of the listed types' terms (fusedhead.h's formulas;
 * sft is NLL, rpo_alpha must be 0), logits means over no token are 0, nll_loss is NaN (not logged), and entropy and
 * mean_token_accuracy are logged.
 * The reference log-probs are constants (nothing is differentiated through them); rewards and metrics carry no
 * gradient. relu's gradient at 0 is 0, as torch's. */
#ifndef FH_REF_PREFERENCE_H
#define FH_REF_PREFERENCE_H

#include <stdint.h>

typedef enum ref_preference_loss {
    REF_PREFERENCE_DPO = 0,
    REF_PREFERENCE_ORPO,
    REF_PREFERENCE_SIMPO,
    REF_PREFERENCE_CPO
} ref_preference_loss;

typedef enum ref_preference_loss_type {
    REF_PREFERENCE_SIGMOID = 0, /* every loss */
    REF_PREFERENCE_HINGE,       /* dpo, cpo */
    REF_PREFERENCE_IPO,         /* dpo, cpo */
    REF_PREFERENCE_ROBUST,      /* dpo */
    /* dpo at TRL's current semantics only: */
    REF_PREFERENCE_EXO_PAIR,
    REF_PREFERENCE_NCA_PAIR,
    REF_PREFERENCE_BCO_PAIR,
    REF_PREFERENCE_SPPO_HARD,
    REF_PREFERENCE_AOT,
    REF_PREFERENCE_AOT_UNPAIRED,
    REF_PREFERENCE_APO_ZERO,
    REF_PREFERENCE_APO_DOWN,
    REF_PREFERENCE_DISCOPOP,
    REF_PREFERENCE_SFT,
    REF_PREFERENCE_SIGMOID_NORM,
    REF_PREFERENCE_LOSS_TYPES
} ref_preference_loss_type;

/* Which TRL DPOTrainer dpo follows: TRL's current one (since v0.29.0, as at f2cd5771), or v0.28.0's. */
typedef enum ref_preference_dpo_semantics { REF_PREFERENCE_TRL_CURRENT = 0, REF_PREFERENCE_TRL_0_28 } ref_preference_dpo_semantics;

typedef struct ref_preference_options {
    ref_preference_loss loss;           /* dpo */
    ref_preference_loss_type loss_type; /* sigmoid */
    double beta;                        /* 0.1; > 0 */
    double label_smoothing;             /* 0; in [0, 0.5], < 0.5 for robust */
    double simpo_gamma;                 /* 0.5 */
    double rpo_alpha;                   /* 0 (TRL's None): no NLL term for dpo */
    double cpo_alpha;                   /* 1.0 */
    ref_preference_dpo_semantics dpo_semantics; /* current */
    /* dpo at current semantics: loss = sum_k weights[k] term_k over the types listed (types[0 .. count), or
     * loss_type with weight 1 when count is 0), each term as fusedhead.h writes it */
    int count;
    ref_preference_loss_type types[16];
    double weights[16];
    double discopop_tau;                /* 0.05 */
} ref_preference_options;

/* Sets TRL's defaults (listed above). */
void ref_preference_options_default(ref_preference_options *o);

/* 1 when l is averaged over the sequence's tokens under these options. */
int ref_preference_averaged(const ref_preference_options *o);

/* The loss head's inputs: per-token values, no logits. Token arrays are [2 pairs, seq] row-major. */
typedef struct ref_preference_tokens {
    int64_t pairs, seq;
    const double *logp;                /* required */
    const double *mask;                /* required */
    const double *ref_logps;           /* [2 pairs] reference l, already aggregated; or NULL */
    const double *ref_per_token_logps; /* reference token log-probs, aggregated here like l; or NULL */
    const double *logit_means;         /* (1/V) sum_j z_ij per token, for the logits metrics; or NULL (NaN) */
    const double *entropy;             /* per token, for the entropy metric (current dpo); or NULL (NaN) */
    const double *correct;             /* 1 where the argmax (lowest index of the largest z) is the target, else 0;
                                          for mean_token_accuracy (current dpo); or NULL (NaN) */
} ref_preference_tokens;

/* The full problem: hidden states, lm_head and the per-token data. */
typedef struct ref_preference_problem {
    int64_t pairs, seq, hidden, vocab;
    const double *x;                   /* [2 pairs seq, hidden] */
    const double *weight;              /* [hidden, vocab] */
    const double *bias;                /* [vocab] or NULL */
    const int64_t *targets;            /* in [0, vocab) wherever the mask is non-zero */
    const double *mask, *ref_logps, *ref_per_token_logps; /* as in ref_preference_tokens */
} ref_preference_problem;

typedef struct ref_preference_metrics { /* TRL's logged metrics: means over the B pairs */
    double rewards_chosen, rewards_rejected, rewards_accuracies, rewards_margins;
    double logps_chosen, logps_rejected;
    double logits_chosen, logits_rejected; /* mask-weighted mean of z over a half's tokens and the whole
                                              vocabulary; NaN when that half's mask sums to 0 (torch's mean of
                                              nothing) */
    double nll_loss;                       /* NaN when the loss has no NLL term (its alpha is 0) */
    double log_odds_ratio, log_odds_chosen; /* orpo: means of log sig(o) and of o; NaN otherwise */
    double entropy, mean_token_accuracy;   /* current dpo: masked mean of the entropies over every token, masked
                                              share of the chosen half's correct argmaxes (0 over no token); NaN
                                              otherwise */
} ref_preference_metrics;

typedef struct ref_preference_result {
    double loss;
    ref_preference_metrics metrics;
    /* Caller-allocated, each may be NULL: sequence_logps and rewards [2 pairs], logp [2 pairs seq] (written by
     * ref_preference_forward only; ref_preference_head takes logp as an input). */
    double *sequence_logps, *rewards, *logp;
} ref_preference_result;

/* Return values of the functions below: 0, -1 if memory runs out, -2 on invalid arguments (a NULL required array,
 * non-positive sizes, an option out of the ranges above, a loss_type the loss does not have, both reference
 * arrays, reference log-probs for a loss other than dpo, a target out of range where the mask is non-zero). */

/* The loss head from per-token logp. Fills r (may be NULL) and g_logp[i] = grad_output d loss / d logp_i
 * ([2 pairs seq], may be NULL). This is what the fused library's head is compared against. */
int ref_preference_head(const ref_preference_tokens *tk, const ref_preference_options *o, double grad_output,
                        ref_preference_result *r, double *g_logp);

/* Materializes the logits, computes logp and the logits' means, then the head. */
int ref_preference_forward(const ref_preference_problem *p, const ref_preference_options *o,
                           ref_preference_result *r);

/* Gradients of grad_output * loss: dx [2 pairs seq, hidden], dweight [hidden, vocab], dbias [vocab]; each may be
 * NULL; all are overwritten. */
int ref_preference_backward(const ref_preference_problem *p, const ref_preference_options *o, double grad_output,
                            double *dx, double *dweight, double *dbias);

#endif
