/* One log-prob check: random inputs from a spec, fh_logprob_*'s outputs and gradients, the double reference's
 * (ref_logprob) and their differences. Shared by the CUnit suite (tests/test_logprob.c) and fh_gradcheck. */
#ifndef FH_LOGPROB_CASE_H
#define FH_LOGPROB_CASE_H

#include "fusedhead.h"

typedef enum logprob_support_kind {
    LOGPROB_FULL_VOCAB,
    LOGPROB_SUPPORT_CSR,
    LOGPROB_SUPPORT_PADDED
} logprob_support_kind;

typedef struct logprob_case_spec {
    int64_t n, hidden, vocab;
    fh_layout layout;
    int bias;
    double ignore_frac;
    fh_logprob_options options;
    int g_entropy, g_lse; /* give those upstream gradients (g_logp always) */
    int train_step;       /* 1: fh_logprob_forward_backward; 0: forward, then backward */
    int keep_logits;      /* forward then backward through fh_logprob_forward_keep and fh_logprob_backward_kept */
    int threads;
    int64_t tile_rows, tile_vocab, budget;
    uint64_t seed;
    double data_scale;    /* typical |x W| (before logit_scale and the temperature); 0 means 3 */
    float grad_beta;
    fh_dtype dtype, grad_dtype;
    int fp32_du;
    logprob_support_kind support; /* through fh_logprob_support_* over a random support per row */
    int64_t support_size;         /* a counted row's ids, its target among them: CSR 1 .. support_size per row,
                                     padded support_size entries of which up to a third -1; V: every id */
} logprob_case_spec;

/* n=97 H=67 V=3001, vh layout with bias, 20% ignored, temperature 1, both extra gradients, forward + backward. */
void logprob_case_spec_default(logprob_case_spec *spec);

typedef struct logprob_diff {
    double logp_max_abs, entropy_max_abs, lse_max_abs, value_tol;
    double dhidden_norm_rel, dweight_norm_rel, dbias_norm_rel, grad_tol, dbias_tol;
    int ignored_outputs_zero; /* ignored rows: logp, entropy, lse 0, and dx 0 (beta 0) or untouched (beta 1) */
} logprob_diff;

/* Tolerances, justified in logprob_case.c. */
#define LOGPROB_VALUE_TOL 1e-5
#define LOGPROB_BF16_VALUE_TOL 2e-5
#define LOGPROB_GRAD_NORM_REL_TOL 1e-5

/* A run's inputs (fp32, bf16-valued for a bf16 case, and the bits the library reads), the fused values (logp,
 * entropy, lse: 3 n floats) and gradients (dweight in the weight's layout), and the reference's. */
typedef struct logprob_case {
    float *x, *weight, *bias, *g[3];
    uint16_t *x_bf16, *weight_bf16;
    int64_t *targets;
    int64_t *support_ids, *support_offsets; /* support cases: the library's form */
    unsigned char *support_mask;            /* [n, V], the reference's */
    float *values, *grads[3];
    double *ref_values, *ref_grads[3];
} logprob_case;

/* Runs the case into c (logprob_case_free frees it whatever the status); FH_OK or the library's status (then only
 * the inputs are set). */
fh_status logprob_case_run(const logprob_case_spec *spec, logprob_case *c, logprob_diff *d);
int logprob_diff_pass(const logprob_diff *d);
/* The spec and every difference against its tolerance, for a failure's message. */
void logprob_diff_describe(const logprob_case_spec *s, const logprob_diff *d, char *buffer, size_t size);
void logprob_case_free(logprob_case *c);

#endif
