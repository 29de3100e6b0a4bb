/* The convert path for bf16 products: bf16 operands widened to f32 panel by panel (exact: every bf16 value is an
 * f32 value) in a scratch the caller's plan owns, then BLIS sgemm. It runs on every CPU BLIS runs on. */
#ifndef FH_CONVERT_PROVIDER_H
#define FH_CONVERT_PROVIDER_H

#include "gemm.h"

/* C (+)= A B for bf16 A and B (an f32 C is written by sgemm directly; a bf16 C goes through an f32 panel, its old
 * value added in f32 when accumulating, rounded once), its panels as order asks (gemm.h). FH_ERR_GEMM_FAILED when
 * the scratch is below fh_gemm_scratch_floats(0, order). */
fh_status fh_convert_gemm(const fh_gemm_scratch *scratch, fh_gemm_order order, int64_t m, int64_t n, int64_t k,
                          const fh_gemm_input *a, const fh_gemm_input *b, int accumulate, const fh_gemm_output *c,
                          int threads);

#endif
