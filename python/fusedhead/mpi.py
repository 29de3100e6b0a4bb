"""fusedhead's heads across MPI ranks from Python: mpi4py communicators and libfusedhead_mpi (include/fusedhead_mpi.h).

    from mpi4py import MPI                       # initialises MPI
    import fusedhead.mpi, fusedhead.torch

    layout = fusedhead.mpi.Layout(local_vocab=w_shard.shape[0], vocab_comm=MPI.COMM_WORLD)
    context = fusedhead.mpi.Context(layout)
    loss = fusedhead.torch.fused_linear_cross_entropy(hidden, w_shard, targets, context=context)
    loss.backward()

A `Context` made on a layout runs every call of the torch and NumPy front ends through the layout's MPI entry point
(fh_ce_forward becomes fh_mpi_ce_forward on the same arguments): cross-entropy, per-token log-probs, GRPO and KTO
(forward, backward and the single-call train step). Each call is collective: every rank of the layout's grid makes
it, with the same options. What a rank passes and gets, as include/fusedhead_mpi.h says:
  - vocab-parallel (vocab_comm): the ranks hold the same tokens and each its contiguous shard of the weight's
    vocabulary, in rank order (`Layout.info.vocab_offset`); targets are global vocabulary ids; class_weights the
    shard's; the loss, per-token outputs and hidden's gradient are the whole vocabulary's on every rank, the weight's
    and bias's gradients the shard's.
  - data-parallel (data_comm): the ranks hold different tokens (GRPO and KTO: whole sequences) and the same shard;
    the loss and metrics are those of every rank's tokens together, and the weight's and bias's gradients are summed
    over the ranks: each rank gets the whole batch's gradient of that loss. Do not let a data-parallel wrapper
    (DistributedDataParallel) reduce the head's weight gradient again.
  - both: a grid, every data communicator made of one rank of each vocab communicator.
The heads without an MPI entry point (preference, distillation) and the workspace queries raise
NotImplementedError naming the function; nothing falls back to a single-process call.

MPI must be initialised (importing mpi4py.MPI does it) with MPI_THREAD_FUNNELED or more when the context runs more
than one thread. libfusedhead_mpi is looked for beside the loaded libfusedhead, or at FUSEDHEAD_MPI_LIBRARY.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

from . import _core, _lib
from ._core import check_status


MPI_ENV_VAR = "FUSEDHEAD_MPI_LIBRARY"

_mpi_lock = threading.Lock()
_mpi_lib: Optional[ctypes.CDLL] = None


class fh_mpi_layout_info(ctypes.Structure):
    _fields_ = [("vocab_rank", ctypes.c_int), ("vocab_ranks", ctypes.c_int), ("data_rank", ctypes.c_int),
                ("data_ranks", ctypes.c_int), ("vocab_offset", ctypes.c_int64), ("local_vocab", ctypes.c_int64),
                ("total_vocab", ctypes.c_int64)]


_LAYOUT_PROTOTYPES = {
    "fh_mpi_layout_create_fortran": [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)],
    "fh_mpi_layout_destroy": [ctypes.c_void_p],
    "fh_mpi_layout_query": [ctypes.c_void_p, ctypes.POINTER(fh_mpi_layout_info)],
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
    """libfusedhead_mpi, loaded once per process, its layout functions bound; the heads' are bound on first use."""
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


class LayoutInfo(NamedTuple):
    vocab_rank: int
    vocab_ranks: int
    data_rank: int
    data_ranks: int
    vocab_offset: int  # the first global vocabulary id of this rank's shard
    local_vocab: int
    total_vocab: int


class Layout:
    """An fh_mpi_layout: the vocab and data communicators (mpi4py; None: no parallelism of that kind) and this rank's
    shard of the vocabulary (local_vocab >= 1 columns; its offset is the sum of the lower vocab ranks' shards).
    Creating and closing it are collective over both communicators; a failure on any rank raises on every rank."""

    def __init__(self, local_vocab: int, *, vocab_comm: Any = None, data_comm: Any = None):
        vocab, data = _fortran_handle(vocab_comm, "vocab_comm"), _fortran_handle(data_comm, "data_comm")
        self._lib = load_mpi_library()
        handle = ctypes.c_void_p()
        status = self._lib.fh_mpi_layout_create_fortran(vocab, data, _core.int64("local_vocab", local_vocab),
                                                        ctypes.byref(handle))
        if status == _lib.Status.ERR_MPI and not _mpi_initialized():
            raise RuntimeError("fusedhead.mpi.Layout: MPI is not initialised (import mpi4py.MPI first)")
        check_status(status, "fh_mpi_layout_create_fortran")
        self._handle: Optional[ctypes.c_void_p] = handle
        info = fh_mpi_layout_info()
        check_status(self._lib.fh_mpi_layout_query(handle, ctypes.byref(info)), "fh_mpi_layout_query")
        self.info = LayoutInfo(*(getattr(info, f) for f, _ in fh_mpi_layout_info._fields_))

    def close(self) -> None:
        """Frees the layout and its duplicated communicators (collective); idempotent."""
        if self._handle is not None:
            self._lib.fh_mpi_layout_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "Layout":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def handle(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise ValueError("the fusedhead.mpi.Layout is closed")
        return self._handle

    def __repr__(self) -> str:
        i = self.info
        return (f"fusedhead.mpi.Layout(vocab rank {i.vocab_rank}/{i.vocab_ranks}, data rank {i.data_rank}/"
                f"{i.data_ranks}, columns [{i.vocab_offset}, {i.vocab_offset + i.local_vocab}) of {i.total_vocab})")


def _mpi_initialized() -> bool:
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return bool(MPI.Is_initialized()) and not MPI.Is_finalized()


def _mpi_function(function: str) -> Any:
    """fh_X's MPI entry point fh_mpi_X, bound with the layout after the context; NotImplementedError when the header
    has none."""
    cdll = load_mpi_library()
    name = "fh_mpi_" + function[len("fh_"):]
    prototype = _lib._REQUIRED.get(function) or _lib._OPTIONAL.get(function)
    fn = getattr(cdll, name, None) if prototype is not None else None
    if fn is None:
        raise NotImplementedError(f"fusedhead.mpi: {function} has no MPI version (include/fusedhead_mpi.h has the "
                                  f"cross-entropy, log-prob, GRPO and KTO calls): it cannot run across ranks")
    if fn.argtypes is None:
        restype, argtypes = prototype
        fn.restype, fn.argtypes = restype, [argtypes[0], ctypes.c_void_p, *argtypes[1:]]
    return fn


class Context(_core.Context):
    """A fusedhead Context whose calls run across `layout` (its settings as fusedhead.Context's). Keep the layout
    open while the context is used."""

    def __init__(self, layout: Layout, **settings):
        super().__init__(**settings)
        self.layout = layout
        self._calls = 0  # the heads' calls made, for collective()

    def call(self, function: str, *args, pure: bool = False) -> None:
        if function.startswith("fh_context_"):  # the context's own settings and state: not a head's call
            super().call(function, *args, pure=pure)
            return
        fn = _mpi_function(function)
        with self._lock:
            self._calls += 1
            status = fn(self._require_open(), self.layout.handle(), *args)
            if status != 0:
                check_status(status, "fh_mpi_" + function[len("fh_"):], self)

    @contextlib.contextmanager
    def collective(self, function: str) -> Iterator[None]:
        """A check that fails on this rank before it calls fh_mpi_<function> (a bad argument, caught in Python)
        would leave the other ranks waiting in that call's collectives: the rank then makes the call with no
        arguments, which joins their agreement and fails on every rank (the others learn that a rank failed), and
        raises its own error."""
        made = self._calls
        try:
            yield
        except BaseException:
            if self._calls == made:
                self._join_failed(function)
            raise

    def _join_failed(self, function: str) -> None:
        try:
            fn = _mpi_function(function)
        except NotImplementedError:
            return  # no MPI call to join: the other ranks raise the same
        with self._lock:
            self._calls += 1
            fn(self._require_open(), self.layout.handle(), *([None] * (len(fn.argtypes) - 2)))

    def __repr__(self) -> str:
        return f"fusedhead.mpi.Context(key={self.key}, {self.layout!r})"
