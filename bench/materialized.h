/* The path fusedhead replaces: full [N, V] fp32 logits and their gradient, on the same GEMM libraries (BLIS for
 * fp32, oneDNN for bf16). Used by fh_bench as the baseline for time and peak memory: mean cross-entropy with no
 * options, and distillation. */
#ifndef FH_MATERIALIZED_H
#define FH_MATERIALIZED_H

#include "fusedhead.h"

#include <stdint.h>

typedef struct materialized_buffers {
    int bf16;               /* bf16 x and weight: the gradient GEMMs read the logits' gradient in bf16 */
    float *logits;          /* [n, vocab] fp32 (distillation: the student's) */
    float *teacher_logits;  /* [n, vocab] fp32 for distillation, else NULL */
    void *dlogits;          /* [n, vocab] fp32, or bf16 bits; distillation: bf16 only (its fp32 gradient
                               overwrites the student's logits), else NULL */
} materialized_buffers;

/* Allocates the [n, vocab] buffers (as an autograd framework holds them): cross-entropy's logits and their
 * gradient, or (distill) both heads' logits, and with bf16 the gradient's bf16 copy. Returns 0 or -1. */
int materialized_alloc(materialized_buffers *b, int64_t n, int64_t vocab, int bf16, int distill);
void materialized_free(materialized_buffers *b);

/* The target of a row that torch's cross_entropy ignores (its default ignore_index). */
#define MATERIALIZED_IGNORE_INDEX (-100)

/* Forward and backward of the mean cross-entropy over the rows whose target is not MATERIALIZED_IGNORE_INDEX (every
 * row's logits computed, as torch does). x [n, hidden] row-major; w the hidden x vocab view with fh_linear's strides
 * (either layout), both fp32 or (b->bf16) bf16 bits; dw the same view in fp32; dx, dw overwritten. Returns the loss,
 * or NaN when a GEMM fails. */
double materialized_train_step(const materialized_buffers *b, int64_t n, int64_t hidden, int64_t vocab,
                               const void *x, const void *w, int64_t w_stride_hidden, int64_t w_stride_vocab,
                               const int64_t *targets, float *dx, float *dw, int threads);

/* Distillation's forward and backward (fusedhead.h's formulas; reduction mean, upstream gradient 1, no bias):
 * both heads' logits in full, the loss and the student's dU elementwise over them, then its dx [n, hidden_s]
 * and dw (the student's weight view, fp32) from dU. Student and teacher are fp32 or (b->bf16) bf16. targets may
 * be NULL when o->weight_hard_loss is 0. Returns the loss, or NaN when a GEMM fails. */
double materialized_distill_train_step(const materialized_buffers *b, const fh_linear *student,
                                       const fh_linear *teacher, const int64_t *targets,
                                       const fh_distill_options *o, float *dx, float *dw, int threads);

#endif
