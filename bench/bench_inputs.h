/* Inputs for the benchmark tools: allocated and touched up front (first-touch page faults belong to the
 * caller, not to the measured calls). */
#ifndef FH_BENCH_INPUTS_H
#define FH_BENCH_INPUTS_H

#include "fusedhead.h"

#include <stddef.h>
#include <stdint.h>

typedef struct bench_inputs {
    float *x, *w, *dx, *dw, *lse;
    int64_t *targets;
    uint16_t *x_bf16, *w_bf16; /* x and w rounded to bf16 (bench_inputs_add_bf16), else NULL */
} bench_inputs;

/* What the hidden states, the weight and the targets hold (fh_bench --distribution). */
typedef enum bench_distribution_kind {
    BENCH_UNIFORM, /* x ~ U(-1, 1), w ~ U(-a, a), a = sqrt(3 / H): logits of standard deviation ~1, a near-uniform
                      softmax; targets spread over the vocabulary */
    BENCH_PEAKED,  /* a language model's softmax in miniature, of a chosen mean entropy (bench_inputs.c says how) */
    BENCH_REPLAY   /* a saved batch: DIR/hidden.npy [N, H] float32, DIR/targets.npy [N] int64 and DIR/weight.npy
                      [V, H] float32 (torch's lm_head layout), as examples/train_tiny_lm.py --save-batch writes */
} bench_distribution_kind;

typedef struct bench_distribution {
    bench_distribution_kind kind;
    double entropy;  /* peaked: the mean softmax entropy asked for, in nats */
    float scale;     /* peaked: the factor on every hidden state; 1 until bench_peaked_calibrate (bench_softmax.h)
                        sets it */
    const char *dir; /* replay: the folder of the .npy files */
} bench_distribution;

/* "uniform", "peaked" (mean entropy 2 nats), "peaked:E" (E > 0 nats) or a folder (replay). Returns 0, or -1 when
 * E is not a positive number. */
int bench_distribution_parse(const char *text, bench_distribution *d);

/* The rows N, hidden size H and vocabulary V of a saved batch, its three files checked for dtype, order and
 * agreeing shapes. Returns 0, or -1 with the reason in why. */
int bench_replay_shape(const char *dir, int64_t *n, int64_t *hidden, int64_t *vocab, char *why, size_t why_size);

/* Allocates and fills the inputs of distribution d for the weight layout; a replay reads the first n rows of the
 * batch. Returns 0, or -1 with the reason in why (what was allocated is freed). */
int bench_inputs_make_from(const bench_distribution *d, fh_layout layout, int64_t n, int64_t hidden, int64_t vocab,
                           bench_inputs *in, char *why, size_t why_size);
/* The uniform distribution. Returns 0, or -1 when memory runs out. */
int bench_inputs_make(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in);
void bench_inputs_free(bench_inputs *in);
/* A distillation teacher's inputs, the uniform distribution's with seeds of their own and the logits scaled:
 * x ~ U(-1, 1) [n, hidden] and w ~ U(-a, a) [hidden, vocab], a = 3 logit_std / sqrt(hidden), so that the logits
 * have standard deviation ~logit_std (any layout: the entries are independent). dx, dw, lse and targets stay NULL.
 * Returns 0, or -1 when memory runs out. */
int bench_inputs_make_teacher(int64_t n, int64_t hidden, int64_t vocab, float logit_std, bench_inputs *in);
/* Adds bf16 copies of x and w. Returns 0, or -1 when memory runs out. */
int bench_inputs_add_bf16(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in);

/* count values in [-scale/2, scale/2), deterministic in seed; NULL when memory runs out. */
float *bench_filled(size_t count, float scale, unsigned seed);

#endif
