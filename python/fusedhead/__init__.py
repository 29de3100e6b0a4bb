"""fusedhead: language-model head losses from hidden states and the lm_head weight, without the [N, V] logits.

Python bindings (ctypes) for libfusedhead.so:

    fusedhead.numpy   NumPy API (cross_entropy, forward, backward, forward_backward, grpo_loss,
                      preference_loss, distill_loss, distill_forward_backward); imported with fusedhead
    fusedhead.torch   torch.autograd.Function, nn.Module and functional forms of each loss; imported on first
                      access (importing fusedhead never imports torch)

The library is located on first use: $FUSEDHEAD_LIBRARY, then the copy `pip install .` put in the package, then
the build tree (build/, then build*/), then the system (see fusedhead._lib). fusedhead.library_path() tells which
one was loaded.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path

from . import errors
from ._core import (KernelInfo, Context, bf16_available, kernel_info, default_context, default_context_settings,
                    set_default_context_settings, status_string)
from ._lib import (Dtype, Layout, LibraryNotFoundError, MissingDependencyError, Param, Reduction, Status,
                   library_path, load_library)
from .errors import FusedheadError, FusedheadMemoryError, FusedheadValueError, TargetOutOfRangeError
from . import numpy  # noqa: E402  (NumPy only)


def _version() -> str:
    """The project version, project(fusedhead VERSION ...) in CMakeLists.txt: read there when the package runs from
    the repository checkout (whatever else is installed), else the installed distribution's, which pyproject.toml
    took from the same line; "unknown" for a copy of the package that is neither."""
    cmake = Path(__file__).resolve().parents[2] / "CMakeLists.txt"
    if cmake.is_file():
        m = re.search(r"project\(fusedhead VERSION ([0-9.]+)", cmake.read_text())
        if m:
            return m.group(1)
    try:
        return importlib.metadata.version("fusedhead")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__version__ = _version()

__all__ = ["__version__", "Context", "default_context", "set_default_context_settings",
           "default_context_settings", "kernel_info", "KernelInfo", "bf16_available", "status_string", "library_path",
           "load_library", "LibraryNotFoundError", "MissingDependencyError", "FusedheadError", "FusedheadValueError",
           "FusedheadMemoryError", "TargetOutOfRangeError", "errors", "Status", "Param", "Dtype", "Layout", "Reduction",
           "numpy", "torch"]


def __getattr__(name: str):
    if name == "torch":  # lazy: `import fusedhead` must not import torch
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'fusedhead' has no attribute {name!r}")
