/* The benchmark's own GEMM, outside the library: fp32 through BLIS, bf16 x bf16 -> f32 on the library's bf16 path
 * (oneDNN's matmul, or the operands widened to f32 for BLIS), for the ceilings and the materialized baselines. */
#ifndef FH_BENCH_GEMM_H
#define FH_BENCH_GEMM_H

#include <stdint.h>

/* C = A B, operands as (pointer, row stride, column stride) views of floats, or of bf16 bits when bf16 is set.
 * Returns 0, or -1 when bf16 is refused, memory runs out or oneDNN fails. */
int bench_gemm(int bf16, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
               int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads);

#endif
