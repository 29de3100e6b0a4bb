/* fh_kernel_query: which kernels run, from the two layers that choose them (GEMM providers, row kernels), and what
 * the environment forced that cannot run here. */
#include "gemm/blis_provider.h"
#include "gemm/gemm.h"
#include "kernels/row_kernels.h"

FH_API fh_status fh_kernel_query(fh_kernel_info *info)
{
    if (!info)
        return FH_ERR_NULL_POINTER;
    fh_blis_kernel_set(info);
    info->elementwise = fh_row_kernels_name();
    info->bf16_gemm = fh_gemm_bf16_provider();
    info->bf16_path = fh_gemm_bf16_refusal()                      ? "refused"
                      : fh_gemm_bf16_path() == FH_BF16_NATIVE ? "native"
                                                              : "convert";
    info->fp32_gemm = fh_gemm_fp32_provider();
    info->fp32_path = fh_gemm_fp32_refusal()                      ? "refused"
                      : fh_gemm_fp32_path() == FH_FP32_ONEDNN ? "onednn"
                                                              : "blis";
    info->refusal = fh_row_kernels_refusal() ? fh_row_kernels_refusal()
                    : fh_gemm_bf16_refusal() ? fh_gemm_bf16_refusal()
                                             : fh_gemm_fp32_refusal();
    return FH_OK;
}
