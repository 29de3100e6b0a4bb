/* Provider dispatch: the one place that knows which library multiplies which element types. */
#include "gemm.h"

#include "blis_provider.h"
#ifdef FH_HAVE_ONEDNN
#include "onednn_provider.h"
#endif

/* f32 x f32 -> f32 goes to BLIS; bf16 x bf16 -> f32 or bf16 to oneDNN when the build has it. */
#ifdef FH_HAVE_ONEDNN
static int is_bf16(const fh_gemm_input *a, const fh_gemm_input *b)
{
    return a->type == FH_ELEM_BF16 && b->type == FH_ELEM_BF16;
}
#endif

static int is_f32(const fh_gemm_input *a, const fh_gemm_input *b)
{
    return a->type == FH_ELEM_F32 && b->type == FH_ELEM_F32;
}

fh_status fh_gemm_prepare(fh_gemm_cache **cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                          const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads)
{
    if (is_f32(a, b))
        return c->type == FH_ELEM_F32 ? FH_OK : FH_ERR_INVALID_DTYPE;
#ifdef FH_HAVE_ONEDNN
    if (is_bf16(a, b)) {
        const fh_status st = *cache ? FH_OK : fh_onednn_cache_create(cache);
        if (st != FH_OK)
            return st;
        return fh_onednn_prepare(*cache, m, n, k, a, b, accumulate, c, threads);
    }
#else
    (void)cache, (void)m, (void)n, (void)k, (void)accumulate, (void)threads;
#endif
    return FH_ERR_INVALID_DTYPE;
}

fh_status fh_gemm(fh_gemm_cache *cache, int64_t m, int64_t n, int64_t k, const fh_gemm_input *a,
                  const fh_gemm_input *b, int accumulate, const fh_gemm_output *c, int threads)
{
    if (is_f32(a, b) && c->type == FH_ELEM_F32) {
        fh_blis_sgemm(m, n, k, a->data, a->row_stride, a->col_stride, b->data, b->row_stride, b->col_stride,
                      accumulate ? 1.0f : 0.0f, c->data, c->row_stride, c->col_stride, threads);
        return FH_OK;
    }
#ifdef FH_HAVE_ONEDNN
    if (is_bf16(a, b) && cache)
        return fh_onednn_gemm(cache, m, n, k, a, b, accumulate, c, threads);
#else
    (void)cache;
#endif
    return FH_ERR_INVALID_DTYPE;
}

void fh_gemm_cache_destroy(fh_gemm_cache *cache)
{
#ifdef FH_HAVE_ONEDNN
    fh_onednn_cache_destroy(cache);
#else
    (void)cache;
#endif
}

const char *fh_gemm_bf16_provider(void)
{
#ifdef FH_HAVE_ONEDNN
    return fh_onednn_description();
#else
    return "none";
#endif
}
