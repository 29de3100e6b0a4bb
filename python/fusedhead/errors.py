"""Exceptions raised for fusedhead status codes.

Every failing library call raises a FusedheadError subclass chosen by the status code:

    FusedheadError (RuntimeError)            .status, .status_name, .status_string, .message, .function
      FusedheadValueError (+ ValueError)     statuses 1..19, 24, 25, 30, 31, 50..54: bad shapes, strides, targets,
        TargetOutOfRangeError, ...           options, supports, wisdom entries (one class per status)
      FusedheadMemoryError (+ MemoryError)   statuses 20..22: workspace and memory
      WisdomIOError (+ OSError)              status 23: a wisdom file cannot be read or written
      KernelsUnavailableError                status 32: FH_ROW_KERNELS / FH_BF16_GEMM force what this CPU lacks
      GemmFailedError                        status 40: the bf16 GEMM provider refused a product or failed
      MPIError, MPILayoutError, MPIMismatchError  statuses 60, 61, 62 (the MPI module: fusedhead.mpi)

Argument problems caught in Python before the library is called (wrong dtype, device, shape or layout)
raise plain TypeError / ValueError that say what was expected.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from ._lib import Status


class FusedheadError(RuntimeError):
    """A fusedhead call returned a non-zero fh_status."""

    def __init__(self, status: int, status_string: str, message: str = "", function: Optional[str] = None):
        self.status = int(status)
        try:
            self.status_name = "FH_" + Status(self.status).name
        except ValueError:
            self.status_name = f"fh_status {self.status}"
        self.status_string = status_string
        self.message = message
        self.function = function
        where = f"{function}: " if function else ""
        detail = f": {message}" if message else ""
        super().__init__(f"{where}{self.status_name} ({self.status}, {status_string}){detail}")

    def __reduce__(self):  # picklable (multiprocessing)
        return (type(self), (self.status, self.status_string, self.message, self.function))


class FusedheadValueError(FusedheadError, ValueError):
    """Invalid shapes, strides, pointers, targets, options or parameters."""


class FusedheadMemoryError(FusedheadError, MemoryError):
    """Workspace too small, out of memory, or a memory budget too small for the smallest tile."""


class NullPointerError(FusedheadValueError): pass
class InvalidSizeError(FusedheadValueError): pass
class InvalidStrideError(FusedheadValueError): pass
class SizeOverflowError(FusedheadValueError): pass
class TargetOutOfRangeError(FusedheadValueError): pass
class MissingOutputError(FusedheadValueError): pass
class NonfiniteInputError(FusedheadValueError): pass
class InvalidDtypeError(FusedheadValueError): pass
class InvalidReductionError(FusedheadValueError): pass
class InvalidLabelSmoothingError(FusedheadValueError): pass
class InvalidSoftcapError(FusedheadValueError): pass
class InvalidZLossError(FusedheadValueError): pass
class InvalidClassWeightError(FusedheadValueError): pass
class InvalidBetaError(FusedheadValueError): pass
class InvalidGradOutputError(FusedheadValueError): pass
class InvalidMaskError(FusedheadValueError): pass
class InvalidTemperatureError(FusedheadValueError): pass
class InvalidGRPOOptionError(FusedheadValueError): pass
class InvalidPreferenceOptionError(FusedheadValueError): pass
class InvalidDistillOptionError(FusedheadValueError): pass
class TeacherMismatchError(FusedheadValueError): pass
class InvalidLogitScaleError(FusedheadValueError): pass
class InvalidSupportError(FusedheadValueError): pass
class WorkspaceTooSmallError(FusedheadMemoryError): pass
class OutOfMemoryError(FusedheadMemoryError): pass
class BudgetTooSmallError(FusedheadMemoryError): pass
class WisdomIOError(FusedheadError, OSError): pass
class InvalidWisdomError(FusedheadValueError): pass
class OverlappingBuffersError(FusedheadValueError): pass
class InvalidLayoutError(FusedheadValueError): pass
class InvalidParamError(FusedheadValueError): pass
class InvalidParamValueError(FusedheadValueError): pass
class KernelsUnavailableError(FusedheadError): pass
class GemmFailedError(FusedheadError): pass
class MPIError(FusedheadError): pass
class MPILayoutError(FusedheadValueError): pass
class MPIMismatchError(FusedheadValueError): pass


ERROR_CLASSES: Dict[int, Type[FusedheadError]] = {
    Status.ERR_NULL_POINTER: NullPointerError,
    Status.ERR_INVALID_SIZE: InvalidSizeError,
    Status.ERR_INVALID_STRIDE: InvalidStrideError,
    Status.ERR_SIZE_OVERFLOW: SizeOverflowError,
    Status.ERR_TARGET_OUT_OF_RANGE: TargetOutOfRangeError,
    Status.ERR_MISSING_OUTPUT: MissingOutputError,
    Status.ERR_NONFINITE_INPUT: NonfiniteInputError,
    Status.ERR_INVALID_LAYOUT: InvalidLayoutError,
    Status.ERR_INVALID_DTYPE: InvalidDtypeError,
    Status.ERR_INVALID_REDUCTION: InvalidReductionError,
    Status.ERR_INVALID_LABEL_SMOOTHING: InvalidLabelSmoothingError,
    Status.ERR_INVALID_SOFTCAP: InvalidSoftcapError,
    Status.ERR_INVALID_Z_LOSS: InvalidZLossError,
    Status.ERR_INVALID_CLASS_WEIGHT: InvalidClassWeightError,
    Status.ERR_INVALID_BETA: InvalidBetaError,
    Status.ERR_INVALID_GRAD_OUTPUT: InvalidGradOutputError,
    Status.ERR_INVALID_MASK: InvalidMaskError,
    Status.ERR_INVALID_TEMPERATURE: InvalidTemperatureError,
    Status.ERR_INVALID_GRPO_OPTION: InvalidGRPOOptionError,
    Status.ERR_WORKSPACE_TOO_SMALL: WorkspaceTooSmallError,
    Status.ERR_OUT_OF_MEMORY: OutOfMemoryError,
    Status.ERR_BUDGET_TOO_SMALL: BudgetTooSmallError,
    Status.ERR_WISDOM_IO: WisdomIOError,
    Status.ERR_INVALID_WISDOM: InvalidWisdomError,
    Status.ERR_OVERLAPPING_BUFFERS: OverlappingBuffersError,
    Status.ERR_INVALID_PREFERENCE_OPTION: InvalidPreferenceOptionError,
    Status.ERR_INVALID_DISTILL_OPTION: InvalidDistillOptionError,
    Status.ERR_TEACHER_MISMATCH: TeacherMismatchError,
    Status.ERR_INVALID_LOGIT_SCALE: InvalidLogitScaleError,
    Status.ERR_INVALID_SUPPORT: InvalidSupportError,
    Status.ERR_INVALID_PARAM: InvalidParamError,
    Status.ERR_INVALID_PARAM_VALUE: InvalidParamValueError,
    Status.ERR_KERNELS_UNAVAILABLE: KernelsUnavailableError,
    Status.ERR_GEMM_FAILED: GemmFailedError,
    Status.ERR_MPI: MPIError,
    Status.ERR_MPI_LAYOUT: MPILayoutError,
    Status.ERR_MPI_MISMATCH: MPIMismatchError,
}


def error_for(status: int, status_string: str, message: str = "", function: Optional[str] = None) -> FusedheadError:
    cls = ERROR_CLASSES.get(int(status), FusedheadError)
    return cls(status, status_string, message, function)
