/* The path fusedhead replaces: full [N, V] fp32 logits and their gradient, on the same GEMM libraries (BLIS for
 * fp32, oneDNN for bf16). Used by fh_bench as the baseline for time and peak memory. Mean cross-entropy, no
 * options. */
#ifndef FH_MATERIALIZED_H
#define FH_MATERIALIZED_H

#include <stdint.h>

typedef struct materialized_buffers {
    int bf16;       /* bf16 x and weight: the gradient GEMMs read the logits' gradient in bf16 */
    float *logits;  /* [n, vocab] fp32 */
    void *dlogits;  /* [n, vocab] fp32, or bf16 bits */
} materialized_buffers;

/* Allocates the two [n, vocab] buffers (as an autograd framework holds them). Returns 0 or -1. */
int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab, int bf16);
void materialized_free(materialized_buffers *b);

/* Forward and backward. x [n, hidden] row-major; w the hidden x vocab view with fh_linear's strides (either
 * layout), both fp32 or (b->bf16) bf16 bits; dw the same view in fp32; dx, dw overwritten. Returns the loss, or
 * NaN when a GEMM fails. */
double materialized_train_step(const materialized_buffers *b, int64_t n, int64_t hidden, int64_t vocab,
                               const void *x, const void *w, int64_t w_stride_hidden, int64_t w_stride_vocab,
                               const int64_t *targets, float *dx, float *dw, int threads);

#endif
