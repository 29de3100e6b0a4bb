/* The benchmark's own GEMM, outside the library, on the library's path for the dtype (fp32: BLIS sgemm or oneDNN's
 * f32 matmul; bf16 x bf16 -> f32: oneDNN's matmul, or the operands widened to f32 for BLIS), for the materialized
 * baselines, and on a named provider for the ceilings. */
#ifndef FH_BENCH_GEMM_H
#define FH_BENCH_GEMM_H

#include <stdint.h>

/* C = A B, operands as (pointer, row stride, column stride) views of floats, or of bf16 bits when bf16 is set.
 * Returns 0, or -1 when bf16 is refused, memory runs out or oneDNN fails. */
typedef enum bench_provider { BENCH_BLIS, BENCH_ONEDNN_F32, BENCH_WIDENED, BENCH_ONEDNN_BF16 } bench_provider;

/* The provider of the library's path for fp32 (bf16 0) or bf16 (bf16 1); -1 when that path is refused. */
int bench_library_provider(int bf16, bench_provider *provider);

/* C = A B on provider: floats for BENCH_BLIS and BENCH_ONEDNN_F32, bf16 bits for the others. 0, or -1 when memory
 * runs out or oneDNN fails (or is missing). */
int bench_gemm_on(bench_provider provider, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa,
                  const void *b, int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads);

int bench_gemm(int bf16, int64_t m, int64_t n, int64_t k, const void *a, int64_t rsa, int64_t csa, const void *b,
               int64_t rsb, int64_t csb, float *c, int64_t rsc, int64_t csc, int threads);

#endif
