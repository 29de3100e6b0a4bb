"""fusedhead's heads across ranks (include/fusedhead_parallel.h): the layout and the context that fusedhead.distributed
(torch.distributed process groups) and fusedhead.mpi (mpi4py communicators) make.

A `Context` made on a layout runs every call of the torch and NumPy front ends through the layout's parallel entry
point (fh_ce_forward becomes fh_parallel_ce_forward on the same arguments): cross-entropy, per-token log-probs (over
the vocabulary or over a support), GRPO and KTO (forward, backward and the single-call train step). Each call is collective: every rank of the layout's grid
makes it, with the same options. What a rank passes and gets, as include/fusedhead_parallel.h says:
  - vocab-parallel (the vocab group): the ranks hold the same tokens and each its contiguous shard of the weight's
    vocabulary, in rank order (`Layout.info.vocab_offset`); targets are global vocabulary ids; class_weights the
    shard's; the loss, per-token outputs and hidden's gradient are the whole vocabulary's on every rank, the weight's
    and bias's gradients the shard's.
  - data-parallel (the data group): the ranks hold different tokens (GRPO and KTO: whole sequences) and the same
    shard; the loss and metrics are those of every rank's tokens together, and the weight's and bias's gradients are
    summed over the ranks: each rank gets the whole batch's gradient of that loss. Do not let a data-parallel wrapper
    (DistributedDataParallel, FSDP) reduce the head's weight gradient again.
  - both: a grid, every data group made of one rank of each vocab group.
The heads without a parallel entry point (preference, distillation) and the workspace queries raise
NotImplementedError naming the function; nothing falls back to a single-process call.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator, NamedTuple, Optional

from . import _core, _lib
from ._core import check_status


class fh_parallel_layout_info(ctypes.Structure):
    _fields_ = [("vocab_rank", ctypes.c_int), ("vocab_ranks", ctypes.c_int), ("data_rank", ctypes.c_int),
                ("data_ranks", ctypes.c_int), ("vocab_offset", ctypes.c_int64), ("local_vocab", ctypes.c_int64),
                ("total_vocab", ctypes.c_int64)]


# fh_collectives' functions (include/fusedhead_parallel.h)
ALLREDUCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_int)
ALLGATHER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
REDUCE_SCATTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
DESCRIBE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# fh_collective_type and fh_collective_op
FLOAT, DOUBLE, INT64 = 0, 1, 2
SUM, MAX, MIN = 0, 1, 2


class fh_collectives(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_void_p), ("rank", ctypes.c_int), ("size", ctypes.c_int),
                ("allreduce", ALLREDUCE), ("allgather", ALLGATHER), ("reduce_scatter", REDUCE_SCATTER),
                ("describe", DESCRIBE), ("release", RELEASE)]


_LAYOUT_PROTOTYPES = {
    "fh_parallel_layout_create": [ctypes.POINTER(fh_collectives), ctypes.POINTER(fh_collectives), ctypes.c_int64,
                                  ctypes.POINTER(ctypes.c_void_p)],
    "fh_parallel_layout_destroy": [ctypes.c_void_p],
    "fh_parallel_layout_query": [ctypes.c_void_p, ctypes.POINTER(fh_parallel_layout_info)],
}


def layout_function(name: str) -> Any:
    """libfusedhead's fh_parallel_layout_* function `name`, bound (LibraryNotFoundError: a library without them)."""
    cdll = _lib.load_library()
    fn = getattr(cdll, name, None)
    if fn is None:
        raise _lib.LibraryNotFoundError(f"{_lib.library_path()} has no {name}: a libfusedhead built before the "
                                        "parallel heads (include/fusedhead_parallel.h)")
    if fn.argtypes is None:
        fn.restype, fn.argtypes = ctypes.c_int, _LAYOUT_PROTOTYPES[name]
    return fn


class LayoutInfo(NamedTuple):
    vocab_rank: int
    vocab_ranks: int
    data_rank: int
    data_ranks: int
    vocab_offset: int  # the first global vocabulary id of this rank's shard
    local_vocab: int
    total_vocab: int


class Layout:
    """An fh_parallel_layout: the vocab and data groups and this rank's shard of the vocabulary. Made by
    fusedhead.distributed.Layout and fusedhead.mpi.Layout; closing it is collective when its groups' release is."""

    _what = "fusedhead.parallel.Layout"

    def __init__(self, handle: ctypes.c_void_p):
        self._handle: Optional[ctypes.c_void_p] = handle
        info = fh_parallel_layout_info()
        check_status(layout_function("fh_parallel_layout_query")(handle, ctypes.byref(info)),
                     "fh_parallel_layout_query")
        self.info = LayoutInfo(*(getattr(info, f) for f, _ in fh_parallel_layout_info._fields_))

    def close(self) -> None:
        """Frees the layout (and what its groups release); idempotent."""
        if self._handle is not None:
            layout_function("fh_parallel_layout_destroy")(self._handle)
            self._handle = None

    def __enter__(self) -> "Layout":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def vocab_shard(self, name: str, tensor: Any) -> Optional[Any]:
        """The local shard of a DTensor argument that this layout takes as its vocabulary shard, else None (the front
        end then refuses it). Only fusedhead.distributed's layouts know the process groups a DTensor lives on."""
        return None

    def handle(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise ValueError(f"the {self._what} is closed")
        return self._handle

    def __repr__(self) -> str:
        i = self.info
        return (f"{self._what}(vocab rank {i.vocab_rank}/{i.vocab_ranks}, data rank {i.data_rank}/"
                f"{i.data_ranks}, columns [{i.vocab_offset}, {i.vocab_offset + i.local_vocab}) of {i.total_vocab})")


def parallel_function(function: str) -> Any:
    """fh_X's parallel entry point fh_parallel_X, bound with the layout after the context; NotImplementedError when
    the header has none."""
    cdll = _lib.load_library()
    name = "fh_parallel_" + function[len("fh_"):]
    prototype = _lib._REQUIRED.get(function) or _lib._OPTIONAL.get(function)
    fn = getattr(cdll, name, None) if prototype is not None else None
    if fn is None:
        raise NotImplementedError(f"fusedhead: {function} has no parallel version (include/fusedhead_parallel.h has "
                                  "the cross-entropy, log-prob (also over a support), GRPO and KTO calls): it cannot "
                                  "run across ranks")
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
        fn = parallel_function(function)
        with self._lock:
            self._calls += 1
            status = fn(self._require_open(), self.layout.handle(), *args)
            if status != 0:
                check_status(status, "fh_parallel_" + function[len("fh_"):], self)

    def keeps_logits(self, n: int, vocab: int) -> bool:
        """Never: the parallel heads have no log-prob pair that keeps the logits (each backward recomputes them)."""
        return False

    def vocab_shard(self, name: str, tensor: Any) -> Optional[Any]:
        """fusedhead.torch's question about a DTensor argument: its local shard when the layout takes it as this
        rank's vocabulary shard (Layout.vocab_shard), else None."""
        return self.layout.vocab_shard(name, tensor)

    @contextlib.contextmanager
    def collective(self, function: str) -> Iterator[None]:
        """A check that fails on this rank before it calls fh_parallel_<function> (a bad argument, caught in Python)
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
            fn = parallel_function(function)
        except NotImplementedError:
            return  # no parallel call to join: the other ranks raise the same
        with self._lock:
            self._calls += 1
            fn(self._require_open(), self.layout.handle(), *([None] * (len(fn.argtypes) - 2)))

    def __repr__(self) -> str:
        return f"{type(self).__module__}.Context(key={self.key}, {self.layout!r})"
