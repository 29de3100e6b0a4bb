/* The GEMM layer: C (+)= A B on strided views. The engine calls only fh_gemm_prepare and fh_gemm; which
 * library multiplies (a provider: BLIS for fp32, oneDNN for bf16) is decided in gemm.c, in one place, from
 * the views' element types, so that the engine and the heads never learn which one ran. */
#ifndef FH_GEMM_H
#define FH_GEMM_H

#include "fusedhead.h"

/* Element types of GEMM operands. bf16 operands are multiplied exactly and accumulated in f32. */
typedef enum fh_elem_type { FH_ELEM_F32, FH_ELEM_BF16 } fh_elem_type;

/* An operand read in place: element (r, c) at data + r * row_stride + c * col_stride (strides in
 * elements of type). */
typedef struct fh_gemm_input {
    const void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_input;

/* The result, written or accumulated into in place: f32, or bf16 for bf16 operands (accumulated in f32,
 * the old value added in f32, rounded once). */
typedef struct fh_gemm_output {
    void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_output;

/* What the providers keep between calls (oneDNN's primitives); owned by a context, created on first need. */
typedef struct fh_gemm_cache fh_gemm_cache;

/* Makes ready what fh_gemm needs for these shapes, strides, types, accumulate mode and threads (the data
 * pointers do not matter), creating *cache when a provider needs one; so that a pass can fail before it
 * writes any output. FH_ERR_OUT_OF_MEMORY, FH_ERR_GEMM_FAILED when the provider refuses them otherwise, or
 * FH_ERR_INVALID_DTYPE when no provider multiplies these types. */
fh_status fh_gemm_prepare(fh_gemm_cache **cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                          const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads);

/* C = A B (accumulate 0: C is not read) or C += A B (accumulate 1), with A m x k, B k x n and C m x n,
 * on threads threads. After fh_gemm_prepare with the same arguments it fails only if the provider fails
 * inside (FH_ERR_OUT_OF_MEMORY, FH_ERR_GEMM_FAILED). */
fh_status fh_gemm(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                  const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads);

void fh_gemm_cache_destroy(fh_gemm_cache *cache);

/* The bf16 provider and the implementation it runs on this CPU, or "none". */
const char *fh_gemm_bf16_provider(void);

#endif
