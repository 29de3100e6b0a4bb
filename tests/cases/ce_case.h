/* One cross-entropy check: random inputs from a spec, the fused library's outputs, the reference's,
 * and the differences between them. Shared by the CUnit suites and fh_gradcheck. */
#ifndef FH_CE_CASE_H
#define FH_CE_CASE_H

#include "fusedhead.h"
#include "rng.h"

typedef struct ce_case_spec {
    int64_t n, hidden, vocab;
    fh_layout layout;
    int bias;
    double ignore_frac;
    double label_smoothing;
    int class_weights;
    double softcap;
    double z_loss;
    double ce_logit_scale; /* fh_ce_options.logit_scale; 0 means 1 */
    int token_scaling;    /* fh_ce_options.token_scaling (DFT) */
    int entropy;          /* ask for the entropy output (the forward then folds sum_j p_j z_j) */
    fh_reduction reduction;
    int threads;          /* 0 = library default */
    uint64_t seed;
    double logit_scale;   /* typical |x W|, before ce_logit_scale; 0 means 3 */
    int64_t tile_rows, tile_vocab; /* 0 = library default */
    float grad_beta;      /* 0: gradients overwrite NaN-filled buffers; 1: accumulate onto known values */
    int train_step;       /* 1: one fh_ce_forward_backward call instead of fh_ce_forward + fh_ce_backward */
    int64_t budget;       /* FH_PARAM_MEMORY_BUDGET; 0 = library default */
    fh_dtype dtype;       /* of x and weight: FH_DTYPE_BF16 rounds them to bf16 for both sides */
    fh_dtype grad_dtype;  /* of dx, dweight and dbias (bf16 needs bf16 inputs) */
    int fp32_du;          /* FH_PARAM_FP32_DU */
    double grad_filter_eps; /* FH_PARAM_GRAD_FILTER_EPS; the reference then filters as the call's tiles do
                               (ref_filter), tile_rows as set or as the library's default */
    fh_filter_tail grad_filter_tail; /* FH_PARAM_GRAD_FILTER_TAIL (0: the tail estimate), the reference's too */
} ce_case_spec;

/* Sets every field to a small default case (mean reduction, no options). */
void ce_case_spec_default(ce_case_spec *spec);

typedef struct ce_case {
    ce_case_spec spec;
    /* inputs */
    float *x, *weight, *bias, *class_weights, *grad_output; /* bf16-valued for a bf16 case */
    uint16_t *x_bf16, *weight_bf16;                         /* what the library reads in a bf16 case */
    int64_t *targets;
    /* fused outputs (entropy only when the spec asks for it) */
    double loss, z_loss;
    float *per_token_loss, *logp, *lse, *entropy, *dx, *dweight, *dbias;
    int64_t *argmax, correct;
    fh_filter_stats filter_stats; /* the fused backward's (fh_context_filter_stats) */
    /* reference outputs (dweight in the same layout as weight) */
    double ref_loss, ref_z_loss;
    double *ref_per_token_loss, *ref_logp, *ref_lse, *ref_entropy, *ref_dx, *ref_dweight, *ref_dbias;
    int64_t *ref_argmax, ref_correct;
} ce_case;

typedef struct ce_metrics {
    double abs_diff_loss, rel_diff_loss, abs_diff_z_loss;
    double per_token_loss_max_abs, logp_max_abs, lse_max_abs;
    double dhidden_max_abs, dhidden_max_rel, dhidden_norm_rel;
    double dweight_max_abs, dweight_max_rel, dweight_norm_rel;
    double dbias_norm_rel;
    int64_t argmax_mismatches; /* rows whose fused argmax is not a (near-)maximal reference logit */
    int64_t correct_mismatch;  /* |correct - counted rows whose fused argmax is their target| */
    double entropy_max_abs;    /* largest |entropy - reference| (0 when not asked for) */
    double entropy_tol;        /* its tolerance (ce_case.c) */
    double loss_rel_tol;       /* CE_LOSS_REL_TOL, plus CE_DFT_REL_TOL with token_scaling */
    double grad_norm_rel_tol;  /* ce_grad_tolerance of dx and dweight */
    double dbias_norm_rel_tol; /* and of dbias (which sums the f32 dU) */
} ce_metrics;

/* Tolerances, justified in ce_case.c. */
#define CE_LOSS_REL_TOL 1e-6
#define CE_GRAD_NORM_REL_TOL 1e-5
#define CE_BF16_GRAD_NORM_REL_TOL 4e-3
#define CE_DFT_REL_TOL 4e-5     /* added to the loss's and the gradients' with token_scaling */
#define CE_ENTROPY_ABS_TOL 5e-5

/* A gradient's normwise tolerance: fp32_tol, or CE_BF16_GRAD_NORM_REL_TOL when its GEMMs read dU rounded to
 * bf16 (bf16 inputs without fp32 dU), plus CE_BF16_GRAD_NORM_REL_TOL when the gradient itself is written in
 * bf16 (ce_case.c says why). */
double ce_grad_tolerance(double fp32_tol, int du_rounded, fh_dtype grad_dtype);

/* The loss's and the fp32 gradients' tolerances of a call with or without token_scaling (ce_case.c says why). */
double ce_loss_tolerance(int token_scaling);
double ce_fp32_grad_tolerance(int token_scaling);

/* The argmax and correct-count metrics (argmax_mismatches, correct_mismatch) of n rows: the fused argmax must be a
 * maximal logit up to fp32 rounding (near-ties may break either way; logit(self, i, j) is z_ij in double from the
 * inputs), and correct exactly the count of rows not ignored whose fused argmax is their target. */
typedef double ce_logit_fn(const void *self, int64_t i, int64_t j);
typedef struct ce_argmax_check {
    int64_t n, vocab, ignore_index;
    const int64_t *targets, *argmax, *ref_argmax;
    int64_t correct;
    ce_logit_fn *logit;
    const void *self;
} ce_argmax_check;
void ce_measure_argmax(const ce_argmax_check *check, ce_metrics *m);

/* Runs the case. Returns FH_OK, or the library's status (then the case holds only its inputs). */
fh_status ce_case_run(const ce_case_spec *spec, ce_case *c, ce_metrics *m);

/* 1 when every metric is within tolerance. */
int ce_metrics_pass(const ce_metrics *m);

void ce_case_free(ce_case *c);

/* What a case sets on its context (0: the library's default). */
typedef struct ce_case_settings {
    int threads;
    int64_t tile_rows, tile_vocab, budget;
    int fp32_du;
    double grad_filter_eps;
    fh_filter_tail grad_filter_tail;
} ce_case_settings;

/* A context with those settings, or the status of a failed fh_context_create. */
fh_status ce_case_context(const ce_case_settings *settings, fh_context **ctx);

/* The linear over a case's inputs in `layout`: the fp32 arrays, or with dtype bf16 the bits they were rounded to. */
fh_linear ce_case_linear(int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, fh_dtype dtype, const float *x,
                         const uint16_t *x_bf16, const float *weight, const uint16_t *weight_bf16, const float *bias);

/* calloc that never returns NULL for a zero count (the cases' arrays), and a float array as doubles (NULL: NULL);
 * the caller frees either. */
void *ce_zalloc(size_t count, size_t size);
double *ce_doubles(const float *f, size_t count);

/* Random linear-head inputs: x [n, h] in U(-1, 1), weight (h x v, any layout: same distribution) scaled so
 * that logits have standard deviation ~logit_scale, bias (if not NULL) in U(-0.5, 0.5). */
void ce_fill_linear(uint64_t *rng, int64_t n, int64_t h, int64_t v, double logit_scale, float *x, float *weight,
                    float *bias);

/* Gradient outputs for a call with gradient beta `beta` (dbias only when has_bias; calloc'd, the caller frees them):
 * NaN for beta 0, which must overwrite them, 1.0 for beta 1, which must add onto them. */
void ce_alloc_grads(size_t n, size_t h, size_t v, int has_bias, float beta, float **dx, float **dweight,
                    float **dbias);

/* The library's view of a call's gradients: the float buffers themselves, or with bf16 gradients their bf16
 * copies (dx at row stride hidden; NULL buffers stay NULL), which ce_grads_io_finish reads back into the floats
 * and frees. */
typedef struct ce_grads_io {
    fh_linear_grads grads;
    float *values[3];
    uint16_t *bits[3];
    size_t counts[3];
} ce_grads_io;

void ce_grads_io_begin(ce_grads_io *io, fh_dtype dtype, size_t n, size_t h, size_t v, float beta, float *dx,
                       float *dweight, float *dbias);
void ce_grads_io_finish(ce_grads_io *io);

/* Fused (fp32) against reference (double): largest absolute difference, that over the largest |reference|,
 * and the normwise (Frobenius) relative difference; a zero reference makes the relative ones absolute. */
typedef struct ce_diff {
    double max_abs, max_rel, norm_rel;
} ce_diff;

ce_diff ce_compare(const float *fused, const double *reference, size_t count);

/* Offset of weight element (k, j) in a layout. */
size_t ce_weight_index(fh_layout layout, int64_t hidden, int64_t vocab, int64_t k, int64_t j);

/* A weight in `layout` as doubles in the reference's [hidden, vocab] layout (calloc'd; the caller frees it), and
 * back: a reference [hidden, vocab] array (a weight gradient) written into `out` in `layout`. */
double *ce_weight_to_reference(fh_layout layout, int64_t hidden, int64_t vocab, const float *weight);
void ce_weight_from_reference(fh_layout layout, int64_t hidden, int64_t vocab, const double *reference, double *out);

#endif
