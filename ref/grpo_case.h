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
    int train_step;    /* 1: fh_grpo_forward_backward instead of forward + backward */
    int threads;
    int64_t tile_rows, tile_vocab;
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
    double metrics_max_abs; /* over kl, entropy and the clip ratios (NaN must match NaN) */
    double dhidden_max_abs, dhidden_max_rel, dhidden_norm_rel;
    double dweight_max_abs, dweight_max_rel, dweight_norm_rel;
    double dbias_norm_rel;
    double grad_norm_rel_tol, dbias_norm_rel_tol; /* ce_grad_tolerance from GRPO_GRAD_NORM_REL_TOL */
} grpo_metrics_diff;

typedef struct grpo_case {
    grpo_case_spec spec;
    float *x, *weight, *bias, *mask, *advantages, *old_logps, *ref_logps; /* bf16-valued for a bf16 case */
    uint16_t *x_bf16, *weight_bf16;                                       /* what the library reads then */
    int64_t *ids;
    double loss;
    fh_grpo_metrics metrics;
    fh_filter_stats filter_stats; /* the fused backward's (fh_context_filter_stats) */
    float *logp, *per_token_loss, *entropy, *lse, *dx, *dweight, *dbias;
    double ref_loss;
    fh_grpo_metrics ref_metrics;
    double *ref_logp, *ref_per_token_loss, *ref_entropy, *ref_dx, *ref_dweight, *ref_dbias;
} grpo_case;

/* Tolerances, justified in grpo_case.c. */
#define GRPO_LOSS_TOL 1e-6
#define GRPO_METRIC_TOL 1e-5
#define GRPO_GRAD_NORM_REL_TOL 1e-5

fh_status grpo_case_run(const grpo_case_spec *spec, grpo_case *c, grpo_metrics_diff *d);
int grpo_metrics_pass(const grpo_metrics_diff *d);
void grpo_case_free(grpo_case *c);

#endif
