/* fh_blis_query: which kernels run, from the two layers that choose them (GEMM providers, row kernels). */
#include "gemm/blis_provider.h"
#include "gemm/gemm.h"
#include "row_kernels.h"

FH_API fh_status fh_blis_query(fh_blis_info *info)
{
    if (!info)
        return FH_ERR_NULL_POINTER;
    fh_blis_kernel_set(info);
    info->elementwise = fh_row_kernels_name();
    info->bf16_gemm = fh_gemm_bf16_provider();
    return FH_OK;
}
