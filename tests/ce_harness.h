/* The cross-entropy suites' harness: ce_case specs (tests/cases/ce_case.h, random inputs) run and judged with the
 * failure text naming the spec, and "problems" with caller-chosen inputs (targets, logits, ignore_index...) run
 * through the fused library and the double reference (ref/ref_ce.h). Tolerances: those of ce_case
 * (CE_LOSS_REL_TOL, CE_GRAD_NORM_REL_TOL, justified in tests/cases/ce_case.c), through ce_metrics_pass. */
#ifndef FH_CE_HARNESS_H
#define FH_CE_HARNESS_H

#include "ce_case.h"
#include "fusedhead.h"
#include "ref_ce.h"
#include "test_util.h"

#include <stddef.h>
#include <stdint.h>

/* Runs a ce_case spec and asserts FH_OK and ce_metrics_pass (tolerances justified in tests/cases/ce_case.c);
 * the failure text names the spec and every metric. Returns 1 on pass. */
int cp_check_spec(const ce_case_spec *spec, const char *label);
/* The same, and the call's gradient-filtering statistics in *filter_stats (when it ran). */
int cp_check_spec_stats(const ce_case_spec *spec, const char *label, fh_filter_stats *filter_stats);
void cp_format_spec(const ce_case_spec *s, char *buf, size_t size);
void cp_format_metrics(const ce_metrics *m, char *buf, size_t size);

/* ---- problems with caller-chosen inputs ---- */
enum { CP_BIAS = 1, CP_CLASS_WEIGHTS = 2 };

typedef struct cp_problem {
    int64_t n, hidden, vocab;
    fh_layout layout;
    float *x;             /* [n, hidden] contiguous */
    float *weight;        /* contiguous in `layout` */
    float *bias;          /* [vocab] or NULL */
    float *class_weights; /* [vocab] or NULL */
    int64_t *targets;     /* [n] */
    float *grad_output;   /* [n]; element 0 serves mean and sum */
    fh_ce_options options; /* class_weights points at the field above */
    uint16_t *x_bf16, *weight_bf16; /* set by cp_problem_use_bf16: the calls read these (bf16), else NULL */
} cp_problem;

/* Zeroed inputs, default options, grad_output 1. */
void cp_problem_init(cp_problem *p, int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, int flags);
/* Random inputs like ce_case's: logits of typical size logit_scale, class weights in [0.5, 1.5),
 * random targets, grad_output of magnitude in [0.25, 1) and random sign. */
void cp_problem_randomize(cp_problem *p, uint64_t seed, double logit_scale);
/* hidden = n, x = identity, weight = the given [n, vocab] logits: the fp32 GEMM is then exact (each
 * logit is 1 * w plus exact zeros), so z equals the given floats bit for bit. */
void cp_problem_from_logits(cp_problem *p, int64_t n, int64_t vocab, fh_layout layout, const float *logits);
void cp_problem_free(cp_problem *p);
/* Rounds x and weight to bf16 in place and makes the library's calls read their bf16 bits. */
void cp_problem_use_bf16(cp_problem *p);
size_t cp_weight_index(const cp_problem *p, int64_t k, int64_t v);
void cp_problem_linear(const cp_problem *p, fh_linear *lin);

typedef struct cp_config {
    int threads;
    int64_t tile_rows, tile_vocab, memory_budget; /* 0 = library default */
    float grad_beta; /* 0: gradients overwrite NaN-filled buffers; 1: accumulate onto 1.0 */
    int train_step;  /* 1: one fh_ce_forward_backward call instead of fh_ce_forward + fh_ce_backward */
} cp_config;

/* A context with cfg's parameters (asserts each set succeeds). */
fh_context *cp_context(const cp_config *cfg);

typedef struct cp_fused {
    double loss, z_loss;
    float *per_token_loss, *logp, *lse, *dx, *dweight, *dbias;
    int64_t *argmax, correct;
} cp_fused;

/* Forward then backward (or the train step) on a fresh context (cp_run_fused) or a given one, whose
 * parameters are then left alone. Gradient buffers are filled with NaN (beta 0) or 1.0 (beta 1) first.
 * Returns the first non-OK status. */
fh_status cp_run_fused(const cp_problem *p, const cp_config *cfg, cp_fused *f);
fh_status cp_run_fused_on(fh_context *ctx, const cp_problem *p, const cp_config *cfg, cp_fused *f);
void cp_fused_free(cp_fused *f);

typedef struct cp_reference {
    double loss, z_loss;
    double *per_token_loss, *logp, *lse, *dx, *dweight, *dbias; /* dweight in the problem's layout */
    int64_t *argmax, correct;
} cp_reference;

/* ref_ce_forward/ref_ce_backward on the inputs converted to double; with grad_beta 1 the gradients
 * include the 1.0 that the fused run accumulates onto. */
void cp_run_reference(const cp_problem *p, float grad_beta, cp_reference *r);
void cp_reference_free(cp_reference *r);

/* cp_run_fused, asserting FH_OK (the failure text starts with `label`), then cp_run_reference with cfg's
 * grad_beta. Returns 1 with f and r filled, or 0 with neither (nothing to free). */
int cp_run_fused_and_reference(const cp_problem *p, const cp_config *cfg, const char *label, cp_fused *f,
                               cp_reference *r);

/* The logit z_ij in double from the fp32 inputs (logit_scale and softcap applied). */
double cp_logit(const cp_problem *p, int64_t i, int64_t j);

/* The same metrics as ce_case (judged by ce_metrics_pass). */
void cp_measure(const cp_problem *p, const cp_fused *f, const cp_reference *r, ce_metrics *m);

/* Fused vs reference under cfg; asserts OK status and ce_metrics_pass. Returns 1 on pass. */
int cp_check_against_reference(const cp_problem *p, const cp_config *cfg, const char *label);

#endif
