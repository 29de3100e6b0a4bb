/* One preference check: random inputs from a spec, the fused library's outputs (fh_preference_forward, and
 * fh_preference_forward_backward with its gradients), the reference's (ref_preference, TRL semantics), and their
 * differences. Shared by the CUnit suite and fh_gradcheck. */
#ifndef FH_PREFERENCE_CASE_H
#define FH_PREFERENCE_CASE_H

#include "fusedhead.h"
#include "ref_preference.h"

typedef enum preference_ref_mode {
    PREFERENCE_REF_NONE = 0, /* reference-free */
    PREFERENCE_REF_SEQUENCE, /* fh_preference_batch.ref_logps */
    PREFERENCE_REF_TOKEN     /* fh_preference_batch.ref_per_token_logps */
} preference_ref_mode;

typedef struct preference_case_spec {
    int64_t pairs, seq, hidden, vocab;
    fh_layout layout;
    int bias;
    fh_preference_options options;
    preference_ref_mode ref; /* dpo only: the library takes no reference for the other losses */
    int threads;
    int64_t tile_rows, tile_vocab; /* tile_rows < 2 seq makes the single-call step stream */
    uint64_t seed;
    float grad_output;
    fh_dtype dtype;      /* of x and weight: FH_DTYPE_BF16 rounds them to bf16 for both sides */
    fh_dtype grad_dtype; /* of dx, dweight and dbias (bf16 needs bf16 inputs) */
    int fp32_du;         /* FH_PARAM_FP32_DU */
} preference_case_spec;

/* B = 4 pairs, T = 23, H = 67, V = 5003, TRL's dpo defaults, reference-free, grad_output 1. */
void preference_case_spec_default(preference_case_spec *spec);

/* What one fused call writes besides the gradients. */
typedef struct preference_fused_outputs {
    double loss;
    fh_preference_metrics metrics;
    float *sequence_logps, *rewards, *logp; /* [2B], [2B], [2B T] */
} preference_fused_outputs;

typedef struct preference_case {
    preference_case_spec spec;
    float *x, *weight, *bias, *mask, *ref_logps, *ref_per_token_logps; /* bf16-valued for a bf16 case */
    uint16_t *x_bf16, *weight_bf16;                                   /* what the library reads then */
    int64_t *targets;
    preference_fused_outputs forward, step; /* fh_preference_forward, fh_preference_forward_backward */
    float *dx, *dweight, *dbias;            /* the step's, dweight in the weight's layout */
    double ref_loss;
    fh_preference_metrics ref_metrics;
    double *ref_sequence_logps, *ref_rewards, *ref_logp, *ref_dx, *ref_dweight, *ref_dbias;
} preference_case;

typedef struct preference_diff {
    double loss, loss_tolerance;          /* |fused - reference|, the larger of the two calls' */
    double metrics;                       /* max over the metrics of |f - r| / max(1, |r|); NaN only against NaN */
    double sequence_logps, rewards, logp; /* max |f - r| / (1 + |r|) over both calls */
    double dx, dweight, dbias;            /* normwise relative */
    double grad_tolerance, dbias_tolerance; /* ce_grad_tolerance of PREFERENCE_GRAD_NORM_REL_TOL */
    int64_t masked_rows_touched; /* dx rows of mask-0 tokens that are not exactly 0 */
} preference_diff;

/* Tolerances, justified in preference_case.c. */
#define PREFERENCE_LOSS_TOL 1e-6
#define PREFERENCE_METRIC_TOL 1e-5
#define PREFERENCE_TOKEN_TOL 1e-5
#define PREFERENCE_GRAD_NORM_REL_TOL 1e-5
/* Drawn pairs keep |1 - beta u| (hinge's kink) and |reward margin| at least this far from 0 (preference_case.c). */
#define PREFERENCE_KINK_GUARD 1e-3

/* The library's options as the reference's, and the reference's metrics in the library's struct: the one
 * conversion every fused-vs-reference comparison uses. */
ref_preference_options preference_ref_options(const fh_preference_options *o);
fh_preference_metrics preference_fh_metrics(const ref_preference_metrics *m);

/* Draws the inputs, runs both fused calls and the reference, measures. Returns FH_OK, or the library's status
 * (then the case holds only its inputs and whatever the calls wrote). */
fh_status preference_case_run(const preference_case_spec *spec, preference_case *c, preference_diff *d);

/* fh_preference_forward_backward once more on the case's inputs and settings, with this grad_output and gradient
 * beta, no other output: dx [2B T, H], dweight (the weight's layout) and dbias [V] (NULL without bias) are float
 * buffers, which a bf16 grad_dtype passes to the library as bf16 copies and reads back. */
fh_status preference_case_step(const preference_case *c, float grad_output, float grad_beta, float *dx,
                               float *dweight, float *dbias);

/* The comparisons behind preference_diff: max over the metrics of |f - r| / max(1, |r|) (NaN equal to NaN, NaN
 * against a number infinite), and max |f - r| / (1 + |r|) over an array (NaN anywhere gives NaN). */
double preference_metrics_diff(const fh_preference_metrics *f, const fh_preference_metrics *r);
/* One metric's: |f - r| / max(1, |r|), NaN equal to NaN (a metric TRL does not log), NaN against a number infinite
 * (the KTO case's metrics too). */
double preference_value_diff(double f, double r);
double preference_token_diff(const float *f, const double *r, size_t count);

int preference_diff_pass(const preference_diff *d);
void preference_case_free(preference_case *c);

#endif
