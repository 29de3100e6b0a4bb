/* Provider dispatch: the one place that knows which library multiplies which element types. */
#include "gemm.h"

#include "blis_provider.h"

void fh_gemm(int64_t m, int64_t n, int64_t k, const fh_gemm_input *a, const fh_gemm_input *b, int accumulate,
             const fh_gemm_output *c, int threads)
{
    switch (c->type) {
    case FH_ELEM_F32:
        fh_blis_sgemm(m, n, k, a->data, a->row_stride, a->col_stride, b->data, b->row_stride, b->col_stride,
                      accumulate ? 1.0f : 0.0f, c->data, c->row_stride, c->col_stride, threads);
        break;
    }
}
