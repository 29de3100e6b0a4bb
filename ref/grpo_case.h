/* One GRPO check: random inputs from a spec, the fused library's outputs and gradients, the reference's
 * (ref_grpo, TRL semantics), and their differences. Shared by the CUnit suites and fh_gradcheck. */
#ifndef FH_GRPO_CASE_H
#define FH_GRPO_CASE_H

#include "fusedhead.h"

typedef struct grpo_case_spec {
    int64_t batch, seq, hidden, vocab;
    fh_layout layout;
    int bias;
    fh_grpo_options options;
    int old_logps;     /* 1: old_per_token_logps given (ratios spread around 1); 0: on-policy */
    int sampling_logps; /* 1: sampling_per_token_logps given: the old log-probs (the current ones on-policy) plus
                           U(-0.15, 0.15), importance-sampling ratios of about e^+-0.15 per token, e^+-0.4 per
                           sequence */
    int train_step;    /* 1: fh_grpo_forward_backward instead of forward + backward */
    int threads;
    int64_t tile_rows, tile_vocab;
    int64_t budget;    /* FH_PARAM_MEMORY_BUDGET in bytes; 0: the library's default */
    uint64_t seed;
    float grad_output;
    fh_dtype dtype;    /* of x and weight: FH_DTYPE_BF16 rounds them to bf16 for both sides */
    fh_dtype grad_dtype; /* of dx, dweight and dbias (bf16 needs bf16 inputs) */
    int fp32_du;       /* FH_PARAM_FP32_DU */
    double logit_scale;     /* typical |logit|; 0 means 3 */
    double grad_filter_eps; /* FH_PARAM_GRAD_FILTER_EPS; the reference then filters as the call's tiles
                               do (ref_filter) */
    fh_filter_tail grad_filter_tail; /* FH_PARAM_GRAD_FILTER_TAIL (0: the tail estimate), the reference's too */
} grpo_case_spec;

/* B=3, T=47, H=67, V=5003, TRL defaults, old log-probs on, grad_output 1. */
void grpo_case_spec_default(grpo_case_spec *spec);

typedef struct grpo_metrics_diff {
    double abs_diff_loss, loss_tolerance;
    double logp_max_abs, per_token_loss_max_abs, entropy_max_abs;
    double metrics_max_abs; /* over every metric of fh_grpo_metrics (NaN must match NaN), less its conditioning
                               slack (grpo_vespo_slack: vespo's phi mean and policy loss; 0 for the others) */
    double dhidden_max_abs, dhidden_max_rel, dhidden_norm_rel;
    double dweight_max_abs, dweight_max_rel, dweight_norm_rel;
    double dbias_norm_rel;
    double grad_norm_rel_tol, dbias_norm_rel_tol; /* ce_grad_tolerance from GRPO_GRAD_NORM_REL_TOL */
} grpo_metrics_diff;

typedef struct grpo_case {
    grpo_case_spec spec;
    float *x, *weight, *bias, *mask, *advantages, *old_logps, *ref_logps; /* bf16-valued for a bf16 case */
    float *sampling_logps;                                                /* NULL unless spec.sampling_logps */
    uint16_t *x_bf16, *weight_bf16;                                       /* what the library reads then */
    int64_t *ids;
    double loss;
    fh_grpo_metrics metrics;
    fh_filter_stats filter_stats; /* the fused backward's (fh_context_filter_stats) */
    float *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias;
    double ref_loss;
    fh_grpo_metrics ref_metrics;
    double *ref_logp, *ref_per_token_loss, *ref_entropy, *ref_dx, *ref_dweight, *ref_dbias;
    double *ref_vespo_phi, *ref_vespo_log_w; /* [B*T], vespo's phi_b and log w_b per token (NaN otherwise) */
} grpo_case;

/* vespo's weight phi_b = exp(lam + k log w_b - lam w_b) is detached and exponential in log w_b = sum_t m
 * (logp - old) [+ the importance-sampling logs, which carry logp on-policy]: a sum over the row, not a mean, so
 * every token's log-prob error e_t adds to it, and d log phi_b / d log w_b = k - lam w_b. To first order the two
 * sides' phi_b differ by phi_b s_b, s_b = |k - lam w_b| sum_t m (|e_t| + 2^-24 |logp_t|) (e_t: the per-token
 * log-prob difference as output, plus the output's own fp32 rounding), which moves
 *   the loss and policy_loss by      sum_b phi_b s_b |A_b| |sum_t m logp_t| / N,
 *   vespo/phi_seq_mean by            sum_b phi_b s_b / B,
 *   the policy part of the gradients by at most max_b s_b relative (each token's coefficient -phi_b A_b m / N).
 * No gradient carries this (phi is detached), so nothing averages it down: at T = 47 and |k - lam w| ~ 5 it is
 * ~4e-5 relative, above the generic tolerances. The comparisons add twice these (second-order terms, and rows
 * where the clamp of log w or the nan_to_num make phi flat count as if it were not). 0 for the other losses. */
typedef struct grpo_vespo_slack {
    double loss, phi_mean, grad_rel;
} grpo_vespo_slack;

grpo_vespo_slack grpo_vespo_slack_of(const fh_grpo_options *o, int64_t batch, int64_t seq, const float *mask,
                                     const float *advantages, const double *ref_logp, const float *logp,
                                     const double *phi, const double *log_w);

/* Tolerances, justified in grpo_case.c. */
#define GRPO_LOSS_TOL 1e-6
#define GRPO_METRIC_TOL 1e-5
#define GRPO_GRAD_NORM_REL_TOL 1e-5

fh_status grpo_case_run(const grpo_case_spec *spec, grpo_case *c, grpo_metrics_diff *d);
int grpo_metrics_pass(const grpo_metrics_diff *d);
void grpo_case_free(grpo_case *c);

#endif
