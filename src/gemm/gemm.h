/* The GEMM layer: C (+)= A B on strided views. The engine calls only fh_gemm; which library multiplies
 * (a provider: BLIS for fp32) is decided in gemm.c, in one place, from the views' element types, so that a
 * second provider slots in without the engine or the heads learning which one ran. */
#ifndef FH_GEMM_H
#define FH_GEMM_H

#include <stdint.h>

/* Element types of GEMM operands. */
typedef enum fh_elem_type { FH_ELEM_F32 } fh_elem_type;

/* An operand read in place: element (r, c) at data + r * row_stride + c * col_stride (strides in
 * elements of type). */
typedef struct fh_gemm_input {
    const void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_input;

/* The result, written or accumulated into in place. */
typedef struct fh_gemm_output {
    void *data;
    int64_t row_stride, col_stride;
    fh_elem_type type;
} fh_gemm_output;

/* C = A B (accumulate 0: C is not read) or C += A B (accumulate 1), with A m x k, B k x n and C m x n,
 * on threads threads. */
void fh_gemm(int64_t m, int64_t n, int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate,
             const fh_gemm_output *c, int threads);

#endif
