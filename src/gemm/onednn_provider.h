/* oneDNN matmul as a GEMM provider: f32 x f32 and bf16 x bf16 products (f32 or bf16 results) on strided views,
 * primitives cached. */
#ifndef FH_ONEDNN_PROVIDER_H
#define FH_ONEDNN_PROVIDER_H

#include "gemm.h"

/* FH_OK, or when the cache or oneDNN's engine cannot be made FH_ERR_OUT_OF_MEMORY (memory) or FH_ERR_GEMM_FAILED
 * (any other oneDNN failure), as every function here. */
fh_status fh_onednn_cache_create(fh_gemm_cache **cache);
void fh_onednn_cache_destroy(fh_gemm_cache *cache);

/* Builds (once) the primitive for these arguments. */
fh_status fh_onednn_prepare(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                            const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads);

/* C (+)= A B through the prepared primitive (prepared here if it was not). */
fh_status fh_onednn_gemm(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                         const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads);

/* "oneDNN <version>", and the implementation oneDNN picks for a matmul of this element type on this CPU (e.g.
 * "brg:avx512_core_bf16", "gemm:jit", or "unavailable"); found once. */
const char *fh_onednn_version(void);
const char *fh_onednn_implementation(fh_elem_type type);

#endif
