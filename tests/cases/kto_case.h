/* One KTO check: random inputs from a spec, the fused library's outputs (fh_kto_forward, and fh_kto_forward_backward
 * with its gradients), the reference's (ref_kto, TRL semantics), and their differences. Shared by the CUnit suite
 * and fh_gradcheck. */
#ifndef FH_KTO_CASE_H
#define FH_KTO_CASE_H

#include "fusedhead.h"
#include "ref_kto.h"

typedef enum kto_ref_mode {
    KTO_REF_SEQUENCE = 0, /* fh_kto_batch.ref_logps */
    KTO_REF_TOKEN         /* fh_kto_batch.ref_per_token_logps */
} kto_ref_mode;

typedef enum kto_kl_mode {
    KTO_KL_VALUE = 0, /* fh_kto_batch.kl (kto) */
    KTO_KL_LOGRATIOS, /* fh_kto_batch.kl_logratios (kto) */
    KTO_KL_NONE       /* apo_zero_unpaired's: kto_case_run uses it whatever the spec says for that loss type */
} kto_kl_mode;

typedef struct kto_case_spec {
    int64_t batch, seq, hidden, vocab;
    fh_layout layout;
    int bias;
    fh_kto_options options;
    kto_ref_mode ref;
    kto_kl_mode kl;
    int threads;
    int64_t tile_rows, tile_vocab; /* tile_rows < seq makes the single-call step stream */
    uint64_t seed;
    float grad_output;
    fh_dtype dtype;      /* of x and weight: FH_DTYPE_BF16 rounds them to bf16 for both sides */
    fh_dtype grad_dtype; /* of dx, dweight and dbias (bf16 needs bf16 inputs) */
    int fp32_du;         /* FH_PARAM_FP32_DU */
} kto_case_spec;

/* B = 8 sequences, T = 23, H = 67, V = 5003, TRL's kto defaults, sequence reference, a KL value, grad_output 1. */
void kto_case_spec_default(kto_case_spec *spec);

/* What one fused call writes besides the gradients. */
typedef struct kto_fused_outputs {
    double loss;
    fh_kto_metrics metrics;
    float *sequence_logps, *rewards, *logp; /* [B], [B], [B T] */
} kto_fused_outputs;

typedef struct kto_case {
    kto_case_spec spec;
    float *x, *weight, *bias, *mask, *ref_logps, *ref_per_token_logps, *kl, *kl_logratios;
    uint16_t *x_bf16, *weight_bf16;
    int64_t *targets;
    uint8_t *labels;
    kto_fused_outputs forward, step; /* fh_kto_forward, fh_kto_forward_backward */
    float *dx, *dweight, *dbias;      /* the step's, dweight in the weight's layout */
    double ref_loss;
    fh_kto_metrics ref_metrics;
    double *ref_sequence_logps, *ref_rewards, *ref_logp, *ref_dx, *ref_dweight, *ref_dbias;
} kto_case;

typedef struct kto_diff {
    double loss, loss_tolerance;          /* |fused - reference|, the larger of the two calls' */
    double metrics;                       /* max over the metrics of preference_value_diff */
    double sequence_logps, rewards, logp; /* max |f - r| / (1 + |r|) over both calls */
    double dx, dweight, dbias;            /* normwise relative */
    double grad_tolerance, dbias_tolerance;
    int64_t masked_rows_touched; /* dx rows of mask-0 tokens that are not exactly 0 */
} kto_diff;

/* Tolerances, justified in kto_case.c. */
#define KTO_LOSS_TOL 1e-6
#define KTO_METRIC_TOL 1e-5
#define KTO_TOKEN_TOL 1e-5
#define KTO_GRAD_NORM_REL_TOL 1e-5

fh_kto_metrics kto_fh_metrics(const ref_kto_metrics *m);
double kto_metrics_diff(const fh_kto_metrics *f, const fh_kto_metrics *r);

/* Draws the inputs, runs both fused calls and the reference, measures. Returns FH_OK, or the library's status. */
fh_status kto_case_run(const kto_case_spec *spec, kto_case *c, kto_diff *d);

/* fh_kto_forward_backward once more on the case's inputs and settings, with this grad_output and gradient beta, no
 * other output: float dx, dweight (the weight's layout), dbias (NULL without bias). */
fh_status kto_case_step(const kto_case *c, float grad_output, float grad_beta, float *dx, float *dweight,
                        float *dbias);

/* The case's batch as the library takes it. */
fh_kto_batch kto_case_batch(const kto_case *c);

int kto_diff_pass(const kto_diff *d);
void kto_case_free(kto_case *c);

#endif
