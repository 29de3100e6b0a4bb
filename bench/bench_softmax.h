/* The softmax that the benchmark's inputs give: measured on a sample of rows, and for the peaked distribution
 * calibrated to a mean entropy. */
#ifndef FH_BENCH_SOFTMAX_H
#define FH_BENCH_SOFTMAX_H

#include "bench_inputs.h"

typedef struct bench_softmax_stats {
    int64_t rows;                  /* rows sampled */
    double mean_entropy;           /* nats */
    double below_2m12, below_2m28; /* fractions of the entries p below 2^-12 and 2^-28 (gradient filtering's eps for
                                      bf16 and fp32: their machine epsilon / 32) */
} bench_softmax_stats;

/* Peaked inputs made with d->scale 1: finds the scale that gives d->entropy on a sample of rows, stores it in d
 * and scales in->x by it (bench_inputs_make_from(d, ...) then makes these inputs). Returns 0, or -1 with the
 * reason in why (an entropy of ln V or more, one too small to reach, or no memory). */
int bench_peaked_calibrate(bench_distribution *d, bench_inputs *in, fh_layout layout, int64_t n, int64_t hidden,
                           int64_t vocab, int threads, char *why, size_t why_size);

/* The softmax statistics of the fp32 inputs, in double, on up to 128 rows spread over the batch: half their
 * spacing away from the rows the calibration used, so another sample when N >= 256. Returns 0, or -1 when memory
 * runs out. */
int bench_softmax_measure(const bench_inputs *in, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab,
                          int threads, bench_softmax_stats *stats);

#endif
