/* Inputs for the benchmark tools: allocated and touched up front (first-touch page faults belong to the
 * caller, not to the measured calls). Weight in [H, V] layout. */
#ifndef FH_BENCH_INPUTS_H
#define FH_BENCH_INPUTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct bench_inputs {
    float *x, *w, *dx, *dw, *lse;
    int64_t *targets;
    uint16_t *x_bf16, *w_bf16; /* x and w rounded to bf16 (bench_inputs_add_bf16), else NULL */
} bench_inputs;

/* Returns 0, or -1 when memory runs out (what was allocated is freed). */
int bench_inputs_make(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in);
void bench_inputs_free(bench_inputs *in);
/* Adds bf16 copies of x and w. Returns 0, or -1 when memory runs out. */
int bench_inputs_add_bf16(int64_t n, int64_t hidden, int64_t vocab, bench_inputs *in);

/* count values in [-scale/2, scale/2), deterministic in seed; NULL when memory runs out. */
float *bench_filled(size_t count, float scale, unsigned seed);

#endif
