/* Shared helpers for the CUnit suites: formatted assertions, suite registration, and a "problem" with
 * caller-chosen inputs (targets, logits, ignore_index...) run through the fused library and the
 * double reference. ce_case (ref/) draws its own inputs; this is for the cases that need to pick them. */
#ifndef FH_TEST_UTIL_H
#define FH_TEST_UTIL_H

#include "ce_case.h"
#include "fusedhead.h"
#include "ref_ce.h"

#include <CUnit/CUnit.h>
#include <stddef.h>
#include <stdint.h>

#define TU_COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* 2^-24: unit roundoff of fp32 (round to nearest). */
#define TU_FP32_U 0x1.0p-24

/* A CUnit assertion whose failure text is printf-formatted (CUnit copies the text). */
void tu_check(int ok, unsigned line, const char *file, const char *func, const char *format, ...)
    __attribute__((format(printf, 5, 6)));
#define TU_CHECK(cond, ...) tu_check(!!(cond), __LINE__, __FILE__, __func__, __VA_ARGS__)

/* A suite: its tests, in order. Each suite file defines `const tu_suite suite_<name>`, and tests/suites.def lists
 * it (the runner registers it under <name>). */
typedef struct tu_test {
    const char *name;
    CU_TestFunc run;
} tu_test;
typedef struct tu_suite {
    const tu_test *tests;
    size_t count;
} tu_suite;

/* Runs a ce_case spec and asserts FH_OK and ce_metrics_pass (tolerances justified in ref/ce_case.c);
 * the failure text names the spec and every metric. Returns 1 on pass. */
int tu_check_spec(const ce_case_spec *spec, const char *label);
void tu_format_spec(const ce_case_spec *s, char *buf, size_t size);
void tu_format_metrics(const ce_metrics *m, char *buf, size_t size);

/* ---- problems with caller-chosen inputs ---- */
enum { TU_BIAS = 1, TU_CLASS_WEIGHTS = 2 };

typedef struct tu_problem {
    int64_t n, hidden, vocab;
    fh_layout layout;
    float *x;             /* [n, hidden] contiguous */
    float *weight;        /* contiguous in `layout` */
    float *bias;          /* [vocab] or NULL */
    float *class_weights; /* [vocab] or NULL */
    int64_t *targets;     /* [n] */
    float *grad_output;   /* [n]; element 0 serves mean and sum */
    fh_ce_options options; /* class_weights points at the field above */
} tu_problem;

/* Zeroed inputs, default options, grad_output 1. */
void tu_problem_init(tu_problem *p, int64_t n, int64_t hidden, int64_t vocab, fh_layout layout, int flags);
/* Random inputs like ce_case's: logits of typical size logit_scale, class weights in [0.5, 1.5),
 * random targets, grad_output of magnitude in [0.25, 1) and random sign. */
void tu_problem_randomize(tu_problem *p, uint64_t seed, double logit_scale);
/* hidden = n, x = identity, weight = the given [n, vocab] logits: the fp32 GEMM is then exact (each
 * logit is 1 * w plus exact zeros), so z equals the given floats bit for bit. */
void tu_problem_from_logits(tu_problem *p, int64_t n, int64_t vocab, fh_layout layout, const float *logits);
void tu_problem_free(tu_problem *p);
size_t tu_weight_index(const tu_problem *p, int64_t k, int64_t v);
void tu_problem_linear(const tu_problem *p, fh_linear *lin);

typedef struct tu_config {
    int threads;
    int64_t tile_rows, tile_vocab, memory_budget; /* 0 = library default */
    float grad_beta; /* 0: gradients overwrite NaN-filled buffers; 1: accumulate onto 1.0 */
    int train_step;  /* 1: one fh_ce_forward_backward call instead of fh_ce_forward + fh_ce_backward */
} tu_config;

/* A context with cfg's parameters (asserts each set succeeds). */
fh_context *tu_context(const tu_config *cfg);

typedef struct tu_fused {
    double loss, z_loss;
    float *per_token_loss, *logp, *lse, *dx, *dweight, *dbias;
    int64_t *argmax;
} tu_fused;

/* Forward then backward (or the train step) on a fresh context (tu_run_fused) or a given one, whose
 * parameters are then left alone. Gradient buffers are filled with NaN (beta 0) or 1.0 (beta 1) first.
 * Returns the first non-OK status. */
fh_status tu_run_fused(const tu_problem *p, const tu_config *cfg, tu_fused *f);
fh_status tu_run_fused_on(fh_context *ctx, const tu_problem *p, const tu_config *cfg, tu_fused *f);
void tu_fused_free(tu_fused *f);

typedef struct tu_reference {
    double loss, z_loss;
    double *per_token_loss, *logp, *lse, *dx, *dweight, *dbias; /* dweight in the problem's layout */
    int64_t *argmax;
} tu_reference;

/* ref_ce_forward/ref_ce_backward on the inputs converted to double; with grad_beta 1 the gradients
 * include the 1.0 that the fused run accumulates onto. */
void tu_run_reference(const tu_problem *p, float grad_beta, tu_reference *r);
void tu_reference_free(tu_reference *r);

/* The logit z_ij in double from the fp32 inputs (softcap applied). */
double tu_logit(const tu_problem *p, int64_t i, int64_t j);

/* The same metrics as ce_case (judged by ce_metrics_pass). */
void tu_measure(const tu_problem *p, const tu_fused *f, const tu_reference *r, ce_metrics *m);

/* Fused vs reference under cfg; asserts OK status and ce_metrics_pass. Returns 1 on pass. */
int tu_check_against_reference(const tu_problem *p, const tu_config *cfg, const char *label);

/* Helpers over arrays. */
int tu_all_finite_f(const float *a, size_t count);
int tu_all_equal_f(const float *a, size_t count, float value); /* a[i] == value for all i (NaN fails) */
double tu_max_abs_diff(const float *f, const double *r, size_t count);
double tu_max_abs_d(const double *a, size_t count);

/* 1 if `word` occurs in `text` starting at a word boundary (start, or after a non-alphanumeric
 * character; '_' counts as a boundary so that "dx_beta" mentions "beta"). Case-sensitive. */
int tu_mentions(const char *text, const char *word);

#endif
