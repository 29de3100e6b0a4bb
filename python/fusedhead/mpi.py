"""fusedhead's heads across MPI ranks from Python: mpi4py communicators and libfusedhead_mpi (include/fusedhead_mpi.h).

    from mpi4py import MPI                       # initialises MPI
    import fusedhead.mpi, fusedhead.torch

    layout = fusedhead.mpi.Layout(local_vocab=w_shard.shape[0], vocab_comm=MPI.COMM_WORLD)
    context = fusedhead.mpi.Context(layout)
    loss = fusedhead.torch.fused_linear_cross_entropy(hidden, w_shard, targets, context=context)
    loss.backward()

A `Context` made on a layout runs the torch and NumPy front ends' cross-entropy, log-prob (also over a support), GRPO
and KTO calls across the layout's ranks (fusedhead.parallel says what each rank passes and gets); a head without a
parallel entry point raises NotImplementedError. libfusedhead_mpi only makes the layout: its collectives are MPI's, over duplicates of
the communicators; the heads are libfusedhead's (include/fusedhead_parallel.h).

MPI must be initialised (importing mpi4py.MPI does it) with MPI_THREAD_FUNNELED or more when the context runs more
than one thread. libfusedhead_mpi is looked for beside the loaded libfusedhead, or at FUSEDHEAD_MPI_LIBRARY.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Optional

from . import _core, _lib, parallel
from ._core import check_status
from .parallel import Context, LayoutInfo

__all__ = ["Layout", "Context", "LayoutInfo", "load_mpi_library"]


MPI_ENV_VAR = "FUSEDHEAD_MPI_LIBRARY"

_mpi_lock = threading.Lock()
_mpi_lib: Optional[ctypes.CDLL] = None


_LAYOUT_PROTOTYPES = {
    "fh_mpi_layout_create_fortran": [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)],
}


def _mpi_library_path() -> str:
    explicit = os.environ.get(MPI_ENV_VAR)
    if explicit:
        return explicit
    core = Path(_lib.library_path())
    if core.parent != Path("."):
        for name in ("libfusedhead_mpi.so", "libfusedhead_mpi.so.0"):
            if (core.parent / name).exists():
                return str(core.parent / name)
    return "libfusedhead_mpi.so.0"


def load_mpi_library() -> ctypes.CDLL:
    """libfusedhead_mpi, loaded once per process, its layout constructor bound."""
    global _mpi_lib
    with _mpi_lock:
        if _mpi_lib is None:
            path = _mpi_library_path()
            try:
                cdll = ctypes.CDLL(path)
            except OSError as e:
                raise _lib.LibraryNotFoundError(
                    f"libfusedhead_mpi could not be loaded from {path!r}: {e}. It is built beside libfusedhead when "
                    f"CMake finds MPI (Debian: libopenmpi-dev); {MPI_ENV_VAR} names it explicitly") from None
            for name, argtypes in _LAYOUT_PROTOTYPES.items():
                fn = getattr(cdll, name)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
            _mpi_lib = cdll
        return _mpi_lib


def _fortran_handle(comm: Any, name: str) -> int:
    """The Fortran handle of an mpi4py communicator (None: MPI_COMM_NULL, no parallelism of that kind)."""
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_NULL
    try:
        return int(comm.py2f())
    except AttributeError:
        raise TypeError(f"{name}: expected an mpi4py communicator or None, got {type(comm).__name__}") from None


class Layout(parallel.Layout):
    """A layout over MPI: the vocab and data communicators (mpi4py; None: no parallelism of that kind) and this
    rank's shard of the vocabulary (local_vocab >= 1 columns; its offset is the sum of the lower vocab ranks'
    shards). Creating and closing it are collective over both communicators (the layout holds duplicates of them); a
    failure on any rank raises on every rank."""

    _what = "fusedhead.mpi.Layout"

    def __init__(self, local_vocab: int, *, vocab_comm: Any = None, data_comm: Any = None):
        vocab, data = _fortran_handle(vocab_comm, "vocab_comm"), _fortran_handle(data_comm, "data_comm")
        handle = ctypes.c_void_p()
        status = load_mpi_library().fh_mpi_layout_create_fortran(vocab, data, _core.int64("local_vocab", local_vocab),
                                                                 ctypes.byref(handle))
        if status == _lib.Status.ERR_MPI and not _mpi_initialized():
            raise RuntimeError("fusedhead.mpi.Layout: MPI is not initialised (import mpi4py.MPI first)")
        check_status(status, "fh_mpi_layout_create_fortran")
        super().__init__(handle)


def _mpi_initialized() -> bool:
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return bool(MPI.Is_initialized()) and not MPI.Is_finalized()
