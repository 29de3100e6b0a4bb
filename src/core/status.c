/* Human-readable texts for fh_status values. */
#include "fusedhead.h"

FH_API const char *fh_status_string(fh_status status)
{
    switch (status) {
    case FH_OK: return "success";
    case FH_ERR_NULL_POINTER: return "a required pointer is NULL";
    case FH_ERR_INVALID_SIZE: return "a size (N, H or V) is zero or negative";
    case FH_ERR_INVALID_STRIDE: return "a stride is smaller than 1 or makes matrix elements overlap";
    case FH_ERR_SIZE_OVERFLOW: return "a size or offset does not fit in 64 bits";
    case FH_ERR_TARGET_OUT_OF_RANGE: return "a target is outside [0, V) and is not ignore_index";
    case FH_ERR_MISSING_OUTPUT: return "an output required by this call is NULL";
    case FH_ERR_NONFINITE_INPUT: return "NaN or Inf in x, weight or bias";
    case FH_ERR_INVALID_LAYOUT: return "the weight layout is neither FH_LAYOUT_HV nor FH_LAYOUT_VH";
    case FH_ERR_INVALID_DTYPE: return "an unknown or unsupported dtype, or x and weight of different dtypes";
    case FH_ERR_INVALID_REDUCTION: return "reduction is not mean, sum or none";
    case FH_ERR_INVALID_LABEL_SMOOTHING: return "label_smoothing is outside [0, 1]";
    case FH_ERR_INVALID_SOFTCAP: return "softcap is neither 0 (off) nor a positive normal fp32 value";
    case FH_ERR_INVALID_Z_LOSS: return "z_loss is negative or not finite";
    case FH_ERR_INVALID_CLASS_WEIGHT: return "a class weight is negative or not finite";
    case FH_ERR_INVALID_BETA: return "a gradient beta is neither 0 nor 1";
    case FH_ERR_INVALID_GRAD_OUTPUT: return "the upstream gradient is not finite";
    case FH_ERR_INVALID_MASK: return "a completion-mask value is negative or not finite";
    case FH_ERR_INVALID_TEMPERATURE: return "temperature is <= 0 or 1/temperature is outside fp32 range";
    case FH_ERR_INVALID_GRPO_OPTION: return "a GRPO option is out of range";
    case FH_ERR_WORKSPACE_TOO_SMALL: return "the workspace is smaller than the size query returned";
    case FH_ERR_OUT_OF_MEMORY: return "out of memory";
    case FH_ERR_BUDGET_TOO_SMALL: return "the memory budget cannot hold the smallest tile";
    case FH_ERR_WISDOM_IO: return "the wisdom file cannot be read or written";
    case FH_ERR_OVERLAPPING_BUFFERS: return "an output's memory overlaps an input, another output or the workspace";
    case FH_ERR_INVALID_WISDOM: return "malformed wisdom entry, or the wisdom table is full";
    case FH_ERR_INVALID_PREFERENCE_OPTION: return "a preference-loss option is out of range";
    case FH_ERR_INVALID_DISTILL_OPTION: return "a distillation option is out of range";
    case FH_ERR_TEACHER_MISMATCH: return "the teacher's tokens or vocabulary differ from the student's";
    case FH_ERR_INVALID_LOGIT_SCALE:
        return "logit_scale is not a positive normal fp32 value, or softcap or temperature put it out of range";
    case FH_ERR_INVALID_SUPPORT:
        return "a support's offsets or ids are malformed, or a counted token's target is not in its support";
    case FH_ERR_INVALID_PARAM: return "unknown parameter";
    case FH_ERR_INVALID_PARAM_VALUE: return "parameter value out of bounds";
    case FH_ERR_KERNELS_UNAVAILABLE:
        return "FH_ROW_KERNELS, FH_BF16_GEMM or FH_FP32_GEMM names a kernel set or GEMM path that is unknown or missing "
               "here";
    case FH_ERR_GEMM_FAILED: return "a GEMM provider refused a product or failed while running it";
    case FH_ERR_MPI: return "a collective (MPI's or the caller's) failed";
    case FH_ERR_MPI_LAYOUT: return "groups of ranks, vocabulary shards or token counts are inconsistent across ranks";
    case FH_ERR_MPI_MISMATCH: return "ranks made the call with different configurations";
    }
    return "unknown status";
}
