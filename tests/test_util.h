/* What every CUnit suite may use, whatever it tests: formatted assertions, the suite type the runner registers,
 * allocation, contexts, array predicates. Each head's harness builds on it (ce_harness.h, grpo_harness.h). */
#ifndef FH_TEST_UTIL_H
#define FH_TEST_UTIL_H

#include "fusedhead.h"

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

/* The byte every output is filled with before a call that must not write it (0xA5A5A5A5 is a NaN-free, odd
 * pattern: a float -2.9e-16, an int64 well outside any index), and the fill. */
#define TU_CANARY 0xA5
void tu_fill_canary(void *p, size_t bytes);

/* p[i] = lo + (hi - lo) u_i for u_i from ref_uniform(rng), i < count. */
void tu_fill_uniform(float *p, size_t count, uint64_t *rng, double lo, double hi);

/* calloc that aborts the run when memory runs out (count 0 allocates one element). */
void *tu_alloc(size_t count, size_t size);
/* The floats as doubles (tu_alloc'd); NULL for NULL. */
double *tu_doubles(const float *f, size_t count);

/* A context with these parameters (0 = library default); asserts that each set succeeds. */
fh_context *tu_context(int threads, int64_t tile_rows, int64_t tile_vocab, int64_t memory_budget);

/* Helpers over arrays. */
int tu_all_finite_f(const float *a, size_t count);
int tu_all_equal_f(const float *a, size_t count, float value); /* a[i] == value for all i (NaN fails) */
double tu_max_abs_diff(const float *f, const double *r, size_t count);
/* ||a - b|| / ||b|| (Frobenius; the absolute norm when b is 0). */
double tu_norm_rel_f(const float *a, const float *b, size_t count);
double tu_max_abs_d(const double *a, size_t count);

/* 1 if `word` occurs in `text` starting at a word boundary (start, or after a non-alphanumeric
 * character; '_' counts as a boundary so that "dx_beta" mentions "beta"). Case-sensitive. */
int tu_mentions(const char *text, const char *word);

#endif
