/* What the gradchecks (CE, GRPO, preference, distillation) share: one parser for the options they name alike, and
 * main's shape (parse, run, print the JSON, write --dump, free, exit code). Each loss keeps its own options, JSON
 * and dump contents. */
#ifndef FH_TOOLS_GRADCHECK_COMMON_H
#define FH_TOOLS_GRADCHECK_COMMON_H

#include "fusedhead.h"

#include <stdio.h>

/* Where a loss keeps each option the gradchecks name alike; NULL where it does not take one, which is then an
 * unknown option for it. The loss sets its defaults before parsing. */
typedef struct gradcheck_options {
    int64_t *n, *batch, *seq, *hidden, *vocab;
    fh_layout *layout;
    int *bias, *train_step, *fp32_du, *threads;
    double *ignore_frac, *grad_filter_eps, *logit_scale;
    fh_reduction *reduction;
    fh_filter_tail *grad_filter_tail;
    float *grad_output;
    uint64_t *seed;
    int64_t *tile_rows, *tile_vocab, *budget;
    fh_dtype *dtype, *grad_dtype;
    const char **dump;
} gradcheck_options;

/* The options every loss takes, in a spec `s` whose fields are named alike (a designated-initializer list). */
#define GRADCHECK_EVERY_LOSS_OPTIONS(s, dump_dir)                                                                   \
    .hidden = &(s)->hidden, .vocab = &(s)->vocab, .layout = &(s)->layout, .bias = &(s)->bias,                      \
    .threads = &(s)->threads, .seed = &(s)->seed, .tile_rows = &(s)->tile_rows, .tile_vocab = &(s)->tile_vocab,    \
    .dtype = &(s)->dtype, .grad_dtype = &(s)->grad_dtype, .fp32_du = &(s)->fp32_du, .dump = (dump_dir)

/* A loss's own option a with the argument after it, v (NULL after the last one): 2 when a took v as its value, 1
 * for a flag, 0 when a is not one of its options (or lacks its value), -1 for a value it refuses. */
typedef int (*gradcheck_own_option)(void *spec, const char *a, const char *v);

/* Parses argv[1..] into the shared options and the loss's own: 0, or -1 for an unknown option, a missing value or
 * a refused one. */
int gradcheck_parse(int argc, char **argv, const gradcheck_options *shared, gradcheck_own_option own, void *spec);

/* One loss's check, as gradcheck_main runs it on its own state (`check`). */
typedef struct gradcheck_loss {
    void (*usage)(void);
    int (*parse)(void *check, int argc, char **argv, const char **dump); /* 0, or -1: a usage error */
    int (*run)(void *check);          /* 0, or 2 having said why on stderr */
    int (*report)(const void *check); /* prints the JSON on stdout; 1 within every tolerance */
    int (*dump)(const void *check, const char *dir); /* the .npy files into dir (made); non-zero on a failed write */
    void (*free)(void *check);        /* after run, whatever it returned */
} gradcheck_loss;

/* Parses, runs, reports and dumps; returns the exit code: 0 within tolerance, 1 past it, 2 for a usage error, a
 * failed run or an unwritable --dump directory. */
int gradcheck_main(const gradcheck_loss *loss, void *check, int argc, char **argv);

/* Says on stderr that the library returned st (with the context's message, when not NULL or empty); returns 2. */
int gradcheck_library_failed(fh_status st, const char *message);

/* calloc that exits with 2 (a failed run) when memory runs out; count 0 allocates one element. */
void *gradcheck_calloc(size_t count, size_t size);

/* The floats as doubles (gradcheck_calloc'd); NULL for NULL. */
double *gradcheck_doubles(const float *f, size_t count);

/* A context with these parameters (0: the library's default): FH_OK, or the failing call's status with *ctx NULL
 * or to be destroyed. */
fh_status gradcheck_context(fh_context **ctx, int threads, int64_t tile_rows, int64_t tile_vocab, int64_t budget,
                            int fp32_du);

/* "name": x followed by tail, or null for NaN (JSON has none: metrics TRL does not log). */
void gradcheck_json_number(FILE *f, const char *name, double x, const char *tail);

/* The fraction of the gradient GEMMs' flops that filtering skipped (0 without any). */
double gradcheck_skipped_fraction(const fh_filter_stats *stats);

#endif
