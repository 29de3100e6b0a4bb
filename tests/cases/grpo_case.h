/* One GRPO check: random inputs from a spec, the fused library's outputs and gradients, the reference's
 * (ref_grpo, TRL semantics), and their differences. Shared by the CUnit suites and fh_gradcheck. */
#ifndef FH_GRPO_CASE_H
#define FH_GRPO_CASE_H

#include "fusedhead.h"

#include <stddef.h>

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

/* Detached factors exponential in a row's SUM of log-probs. vespo's phi_b = exp(lam + k log w_b - lam w_b) with
 * log w_b = sum_t m (logp - old) [+ sum_t log is_t, which carry logp on-policy], d log phi_b / d log w_b = k -
 * lam w_b; and, on-policy (no old log-probs), the sequence modes' importance-sampling ratio exp(sum_t m (logp -
 * samp)), d log is_b / d (sum) = 1. A sum over the row, not a mean: every token's log-prob error e_t adds to it. To
 * first order the two sides' factor differs by the relative s_b = c_b sum_t m (|e_t| + 2^-24 |logp_t|) (c_b: |k -
 * lam w_b|, or 1; e_t: the per-token log-prob difference as output, plus the output's own fp32 rounding, since
 * the head sees the unrounded value), which moves
 *   the loss and policy_loss by             sum_b s_b sum_t |d loss / d l_t| |policy term_t|,
 *   vespo/phi_seq_mean by                   sum_b phi_b s_b / B,
 *   sampling/importance_sampling_ratio/{min,mean,max} by max_b is_b s_b,
 *   the gradients by at most                max_b s_b relative (each token's policy coefficient scales with it).
 * No gradient carries this (the factors are detached), so nothing averages it down: at T = 47 and |k - lam w| ~ 5 it
 * is ~4e-5 relative, above the generic tolerances. The comparisons add twice these (second-order terms, and rows
 * where a clamp makes the factor flat count as if it were not). 0 for every other case. */
typedef struct grpo_slack {
    double loss, phi_mean, is_ratio, grad_rel;
} grpo_slack;

/* The reference's per-token values the slack needs (ref_grpo_result's outputs of the same names). */
typedef struct grpo_ref_detail {
    double *policy_term, *is_ratio, *vespo_phi, *vespo_log_w, *loss_weight;
} grpo_ref_detail;

void grpo_ref_detail_alloc(grpo_ref_detail *d, size_t n);
void grpo_ref_detail_free(grpo_ref_detail *d);

/* The problem: the batch's mask, advantages, whether it has old and sampler log-probs; the fused and the
 * reference per-token log-probs; the reference's details. */
grpo_slack grpo_slack_of(const fh_grpo_options *o, const fh_grpo_batch *batch, const float *logp,
                         const double *ref_logp, const grpo_ref_detail *d);

/* Twice the slack of metric k (grpo_metrics_fields' order); 0 for the metrics it does not move. */
double grpo_metric_slack(const grpo_slack *slack, int k);

typedef struct grpo_metrics_diff {
    double abs_diff_loss, loss_tolerance;
    double logp_max_abs, per_token_loss_max_abs, entropy_max_abs;
    double metrics_max_abs; /* over every metric of fh_grpo_metrics (NaN must match NaN), less its conditioning
                               slack (grpo_slack: policy_loss, vespo/phi_seq_mean, the IS ratios) */
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
    grpo_ref_detail ref_detail; /* for grpo_slack_of */
} grpo_case;

/* Tolerances, justified in grpo_case.c. */
#define GRPO_LOSS_TOL 1e-6
#define GRPO_METRIC_TOL 1e-5
#define GRPO_GRAD_NORM_REL_TOL 1e-5

fh_status grpo_case_run(const grpo_case_spec *spec, grpo_case *c, grpo_metrics_diff *d);
int grpo_metrics_pass(const grpo_metrics_diff *d);
void grpo_case_free(grpo_case *c);

#endif
