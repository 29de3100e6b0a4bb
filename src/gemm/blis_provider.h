/* BLIS as the fp32 GEMM provider: its kernel-set selection (made once, before BLIS initialises) and sgemm. */
#ifndef FH_BLIS_PROVIDER_H
#define FH_BLIS_PROVIDER_H

#include "fusedhead.h"

/* C = A B + beta C, all operands as (pointer, row stride, column stride) views. alpha is 1. */
void fh_blis_sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t rsb, int64_t csb, float beta, float *c, int64_t rsc, int64_t csc, int threads);

/* The kernel set BLIS runs and who chose it (info's BLIS fields; elementwise is left alone). */
void fh_blis_kernel_set(fh_kernel_info *info);

#endif
