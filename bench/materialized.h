/* The path fusedhead replaces: full [N, V] fp32 logits and their gradient, on the same BLIS. Used by
 * fh_bench as the baseline for time and peak memory. Mean cross-entropy, no options. */
#ifndef FH_MATERIALIZED_H
#define FH_MATERIALIZED_H

#include <stdint.h>

typedef struct materialized_buffers {
    float *logits;  /* [n, vocab] */
    float *dlogits; /* [n, vocab] */
} materialized_buffers;

/* Allocates the two [n, vocab] buffers (as an autograd framework holds them). Returns 0 or -1. */
int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab);
void materialized_free(materialized_buffers *b);

/* Forward and backward. x [n, hidden] row-major; w the hidden x vocab view with fh_linear's strides (either
 * layout), dw the same view; dx, dw overwritten. Returns the loss. */
double materialized_train_step(const materialized_buffers *b, int64_t n, int64_t hidden, int64_t vocab,
                               const float *x, const float *w, int64_t w_stride_hidden, int64_t w_stride_vocab,
                               const int64_t *targets, float *dx, float *dw, int threads);

#endif
