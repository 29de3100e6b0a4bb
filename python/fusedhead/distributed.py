"""fusedhead's heads across torch.distributed ranks (include/fusedhead_parallel.h, with torch.distributed's
collectives): for runs launched with torchrun, on the gloo backend or any other that has all_reduce and all_gather
on CPU tensors.

    import torch.distributed as dist
    import fusedhead.distributed, fusedhead.torch

    dist.init_process_group("gloo")
    layout = fusedhead.distributed.Layout(local_vocab=w_shard.shape[0], vocab_group=dist.group.WORLD)
    context = fusedhead.distributed.Context(layout)
    loss = fusedhead.torch.fused_linear_cross_entropy(hidden, w_shard, targets, context=context)
    loss.backward()

The layout's groups are process groups (None: no parallelism of that kind); each rank's weight is its contiguous
shard of the vocabulary in the vocab group's rank order, and targets stay global ids. fusedhead.parallel says what
each rank passes and gets, and which reductions fusedhead makes (so that DDP or FSDP does not make them again).
The records and the rules that combine them are libfusedhead's; torch.distributed only moves the bytes and sums
(all_reduce, all_gather; the reduce-scatter of FH_PARALLEL_REDUCE_SCATTER is an all_reduce and a copy here).

A collective that raises (a timeout, a rank gone) fails the call on this rank with MPIError (status 60) naming the
exception; the process group's own timeout bounds a wait for a rank that never calls.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Any, Dict, List, Optional

from . import _core, _lib, parallel
from ._core import check_status
from .errors import error_for
from .parallel import Context, LayoutInfo

__all__ = ["Layout", "Context", "LayoutInfo"]


class _Group:
    """fh_collectives over one torch.distributed process group: the callbacks and the state they need, kept alive
    by the layout that holds them."""

    def __init__(self, group: Any, name: str):
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fusedhead.distributed.Layout: torch.distributed is not initialised "
                               "(dist.init_process_group first)")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{name}: expected a torch.distributed ProcessGroup (dist.new_group, dist.group.WORLD) "
                            f"or None, got {type(group).__name__}")
        self._torch, self._dist, self._group = torch, dist, group
        self._types = {parallel.FLOAT: (ctypes.c_float, torch.float32),
                       parallel.DOUBLE: (ctypes.c_double, torch.float64),
                       parallel.INT64: (ctypes.c_int64, torch.int64)}
        self._ops = {parallel.SUM: dist.ReduceOp.SUM, parallel.MAX: dist.ReduceOp.MAX,
                     parallel.MIN: dist.ReduceOp.MIN}
        self._errors: Dict[int, str] = {}
        self.last_error = ""  # the last collective's failure, for a layout's creation (which has no context)
        self._codes = itertools.count(1)
        # The callbacks: C keeps only their addresses, so this object must outlive the layout.
        self._callbacks = (parallel.ALLREDUCE(self._allreduce), parallel.ALLGATHER(self._allgather),
                           parallel.DESCRIBE(self._describe))
        self.table = parallel.fh_collectives(
            None, dist.get_rank(group), dist.get_world_size(group), self._callbacks[0], self._callbacks[1],
            parallel.REDUCE_SCATTER(), self._callbacks[2], parallel.RELEASE())

    def _tensor(self, address: int, count: int, ctype: Any, dtype: Any) -> Any:
        """count elements of C memory at address as a tensor (no copy)."""
        return self._torch.frombuffer((ctype * count).from_address(address), dtype=dtype)

    def _failed(self, e: BaseException) -> int:
        code = next(self._codes)
        self._errors[code] = self.last_error = f"torch.distributed: {type(e).__name__}: {e}"
        return code

    def _allreduce(self, handle: Any, buffer: int, count: int, type_: int, op: int) -> int:
        try:
            if count > 0:
                ctype, dtype = self._types[type_]
                self._dist.all_reduce(self._tensor(buffer, count, ctype, dtype), op=self._ops[op], group=self._group)
            return 0
        except BaseException as e:  # an exception must not cross the C frames: it becomes the call's status
            return self._failed(e)

    def _allgather(self, handle: Any, send: int, receive: int, nbytes: int) -> int:
        try:
            size = self.table.size
            # whole 8-byte words where they fit (every record and value fusedhead gathers), else bytes
            ctype, dtype, count = ((ctypes.c_int64, self._torch.int64, nbytes // 8) if nbytes % 8 == 0
                                   else (ctypes.c_uint8, self._torch.uint8, nbytes))
            if count > 0:
                mine = self._tensor(send, count, ctype, dtype).clone()  # send may be read-only or inside receive
                out: List[Any] = list(self._tensor(receive, count * size, ctype, dtype).view(size, count).unbind(0))
                self._dist.all_gather(out, mine, group=self._group)
            return 0
        except BaseException as e:
            return self._failed(e)

    def _describe(self, handle: Any, code: int, text: int, size: int) -> None:
        message = self._errors.pop(code, f"collective error {code}").encode("utf-8", "replace")[:max(size - 1, 0)]
        if size > 0:
            ctypes.memmove(text, message + b"\0", len(message) + 1)


class Layout(parallel.Layout):
    """A layout over torch.distributed: the vocab and data process groups (None: no parallelism of that kind) and
    this rank's shard of the vocabulary (local_vocab >= 1 columns; its offset is the sum of the lower vocab ranks'
    shards). Creating it is collective over both groups; a failure on any rank raises on every rank. The groups
    stay the caller's: closing the layout releases nothing of theirs."""

    _what = "fusedhead.distributed.Layout"

    def __init__(self, local_vocab: int, *, vocab_group: Any = None, data_group: Any = None):
        self._groups = [None if g is None else _Group(g, name)
                        for g, name in ((vocab_group, "vocab_group"), (data_group, "data_group"))]
        tables = [None if g is None else ctypes.byref(g.table) for g in self._groups]
        handle = ctypes.c_void_p()
        status = parallel.layout_function("fh_parallel_layout_create")(
            tables[0], tables[1], _core.int64("local_vocab", local_vocab), ctypes.byref(handle))
        if status == _lib.Status.ERR_MPI:  # the C call has no context for the message: the collectives' own
            why = "; ".join(g.last_error for g in self._groups if g is not None and g.last_error)
            raise error_for(status, _core.status_string(status), why, "fh_parallel_layout_create")
        check_status(status, "fh_parallel_layout_create")
        super().__init__(handle)
        self._vocab_group = vocab_group

    def vocab_shard(self, name: str, tensor: Any) -> Optional[Any]:
        """A weight or bias DTensor sharded on the vocabulary (Shard(0) on a 1-D mesh) over this layout's vocab group:
        its local shard, which must have the layout's local_vocab rows (ValueError otherwise); None for any other
        DTensor, which the front end refuses. The ranks of the vocab group hold the same tokens: tensor parallelism's
        sharded lm_head, not FSDP2's (whose ranks hold different tokens; pass weight.full_tensor() there)."""
        import torch.distributed as dist
        placements = tuple(getattr(tensor, "placements", ()))
        if name not in ("weight", "bias") or self._vocab_group is None or len(placements) != 1 \
                or not placements[0].is_shard(0) or tensor.device_mesh.ndim != 1:
            return None
        ranks = dist.get_process_group_ranks
        if ranks(tensor.device_mesh.get_group()) != ranks(self._vocab_group):
            return None
        local = tensor.to_local()
        if local.shape[0] != self.info.local_vocab:
            raise ValueError(f"{name}: this rank's shard of the DTensor has {local.shape[0]} rows, the layout's "
                             f"local_vocab is {self.info.local_vocab}")
        return local

