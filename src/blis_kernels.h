/* BLIS kernel-set selection and the single GEMM entry point the engine uses. */
#ifndef FH_BLIS_KERNELS_H
#define FH_BLIS_KERNELS_H

#include <stdint.h>

/* Makes sure the kernel set has been chosen; call before the first BLIS call. Idempotent, thread-safe. */
void fh_blis_ensure_selected(void);

/* C = A B + beta C, all operands as (pointer, row stride, column stride) views. alpha is 1. */
void fh_sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
              int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc, int threads);

#endif
