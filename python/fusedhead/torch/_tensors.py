"""The torch front ends' shared plumbing: argument checks, the library's views of tensors, the linear head with its
gradient buffers (and the dweight pool), token and sequence vectors.

Every function here reads tensors' metadata only, except where it hands the library an address: under
torch.compile the ops' fake implementations run the same code on fake tensors (no data, address 0, and the
library is not called: `TorchLinear.computes`), so a bad shape, dtype or device raises the same error while
tracing as it does eagerly.
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .._core import (View, LinearHead, Support, check_sizes, matrix_view_ok, padded_support_width, parse_layout,
                     rows_view_ok, vector_view_ok)
from .._lib import Dtype, Layout

_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def compiling() -> bool:
    """Whether torch.compile is tracing (then results stay tensors: nothing is read back into Python)."""
    return _compiling()


try:
    from torch._subclasses.fake_tensor import is_fake
except ImportError:  # torch 1.x: no fake tensors, nothing is traced
    def is_fake(t) -> bool:  # type: ignore[misc]
        return False


def check_tensor(t, name: str, dtype: torch.dtype, hint: str = "") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: fusedhead runs on the CPU; got a tensor on {t.device} (move it with .cpu())")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}{hint}")
    return t


FP32_HINT = "; fusedhead takes float32 here (use .float())"
INT64_HINT = " (use .long())"


def check_inputs(hidden, weight) -> torch.dtype:
    """The dtype of hidden and weight: both float32 or both bfloat16 (the library computes a bf16 x bf16 GEMM
    or an fp32 one, never a mixed one); returns it."""
    bf16 = isinstance(hidden, torch.Tensor) and hidden.dtype == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else torch.float32
    check_tensor(hidden, "hidden", dtype, " (fusedhead takes float32 or bfloat16; use .float())")
    check_tensor(weight, "weight", dtype, " (hidden and weight must have one dtype: both float32 or both bfloat16)")
    return dtype


def fp32_operand(t, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A float32 operand of the library (bias, class weights, GRPO's per-token and per-sequence values). With
    bfloat16 inputs a bfloat16 one is accepted too (what a bf16 model holds) and converted: a [V] or [B, T]
    copy, nothing next to the GEMMs."""
    if dtype == torch.bfloat16 and isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
        return check_tensor(t, name, torch.bfloat16).float()
    return check_tensor(t, name, torch.float32, FP32_HINT)


def address(t: torch.Tensor) -> int:
    """t's data address; a fake tensor (tracing) has none: 0, never passed to the library."""
    return 0 if is_fake(t) else t.data_ptr()


def view(t: torch.Tensor) -> View:
    return View(address(t), tuple(t.shape), tuple(t.stride()))


def opt_view(t: Optional[torch.Tensor]) -> Optional[View]:
    return None if t is None else view(t)


def contiguous_vector(t: torch.Tensor) -> torch.Tensor:
    return t if vector_view_ok(t.shape, t.stride()) else t.contiguous()

# ---------------------------------------------------------------------------------------------------------
# Weight-gradient buffers
# ---------------------------------------------------------------------------------------------------------
# dweight is V x H (128 MiB at V=32768 H=1024, 931 MB at V=151643 H=1536). A fresh torch.empty of that size
# is a new glibc mmap (above its 32 MiB mmap ceiling; M_MMAP_THRESHOLD is process-wide, not ours to set)
# whose every 4 KiB page faults on the library's first write: measured 60 ms and 400 ms, against 3-8 ms and
# 36-40 ms to write a recycled buffer; the binding's step took 1.05-1.12x and 1.16-1.27x the C train step
# (2 threads). Hence a pool (then 0.94-1.07x, the rest being autograd's add into a kept .grad, which torch
# pays for any loss, and machine noise). The alternatives:
#   - Accumulate into weight.grad in the library call (dweight_beta 1) and return None: the gradient is
#     computed in the forward (the single-call train step, 6 NHV flops instead of 8), when nothing says it
#     will reach .grad. The caller may zero_grad() between forward and backward, take torch.autograd.grad,
#     scale the loss (gradient accumulation's loss / k), hook the weight, backward twice or not at all.
#     Moving the call to backward (fh_ce_backward, beta 1) makes the step 8 NHV: +33% flops, worse than the
#     page faults.
#   - One cached buffer handed out every step: AccumulateGrad adopts a returned gradient as .grad when
#     .grad is None (no copy), so the next step would overwrite a .grad the caller still holds.
# The pool is an allocator that never unmaps: a buffer is handed out again only once no tensor refers to
# it. Each hand-out is a new NumPy view of the pooled memory, wrapped by torch.from_numpy; the tensor's
# storage holds that view until the storage is freed (whoever held it last: .grad after AccumulateGrad
# adopted it, a hook, autograd.grad's result, a retained graph's saved tensors), so a weak reference to the
# view says exactly when the memory is free. Autograd semantics are those of a fresh buffer: the library
# overwrites it (beta 0), autograd adopts or adds it as any gradient. NumPy also asks for transparent huge
# pages on large buffers (MADV_HUGEPAGE), which makes even the first use cheaper (15 ms instead of 60 ms at
# 128 MiB here).
DWEIGHT_SLOTS = 2  # the gradient, and the copy that backward scales when the upstream gradient is not 1


def storage_elements(shape: Sequence[int], strides: Sequence[int]) -> int:
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


class DweightPool:
    """The recycled dweight buffers of one weight, at most DWEIGHT_SLOTS; they live as long as the weight's
    Python object. Between steps the pool holds what the step's peak already needed: the gradient (besides
    .grad when zero_grad keeps it), and its scaled copy only where backward made one."""

    def __init__(self):
        self._lock = threading.Lock()  # calls on separate threads may share a weight
        self._slots = []  # [flat ndarray, weak reference to its latest hand-out]

    def take(self, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of this shape, strides and dtype (float32 or bfloat16) that no other tensor
        refers to."""
        size = storage_elements(shape, strides)
        # NumPy has no bfloat16 and torch 1.13 no uint16: bf16 bits live in int16 buffers
        np_dtype = np.dtype(np.float32 if dtype == torch.float32 else np.int16)
        with self._lock:
            free = [s for s in self._slots if s[1]() is None]
            slot = next((s for s in free if s[0].size == size and s[0].dtype == np_dtype), None)
            if slot is None:
                if len(self._slots) < DWEIGHT_SLOTS:
                    slot = [None, None]
                    self._slots.append(slot)
                elif free:  # the weight changed shape or dtype: this buffer replaces a stale one
                    slot = free[0]
                else:  # every buffer still in use (graphs retained, gradients kept): as torch would
                    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype)
            if slot[0] is None or slot[0].size != size or slot[0].dtype != np_dtype:
                slot[0] = np.empty(size, dtype=np_dtype)
            view = np.lib.stride_tricks.as_strided(slot[0], tuple(shape), tuple(np_dtype.itemsize * s for s in strides))
            slot[1] = weakref.ref(view)
            # the bf16 tensor is a view of the int16 one: one storage, which holds `view` until it is freed
            return torch.from_numpy(view) if dtype == torch.float32 else torch.from_numpy(view).view(dtype)


dweight_pools: Dict[int, DweightPool] = {}
dweight_pools_lock = threading.Lock()


def dweight_pool(weight: torch.Tensor) -> DweightPool:
    """The pool of this weight tensor (by identity: a Parameter is the same object every step)."""
    key = id(weight)
    with dweight_pools_lock:
        pool = dweight_pools.get(key)
        if pool is None:
            pool = dweight_pools[key] = DweightPool()
            # dropped when the weight dies, before its id can be reused; holds neither the weight nor the pool
            weakref.finalize(weight, dweight_pools.pop, key, None)
    return pool



class TorchLinear:
    """hidden [..., H], weight and bias as the library takes them (copies only where needed), and the
    gradient buffers for the inputs that need them. `computes`: whether a call goes to the library (tokens to
    compute, and real tensors rather than a trace's fake ones)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layout):
        self.dtype = check_inputs(hidden, weight)
        self.bias_dtype = None if bias is None else bias.dtype
        if bias is not None:
            bias = fp32_operand(bias, "bias", self.dtype)
        if hidden.dim() < 1:
            raise ValueError("hidden: expected [..., H], got a 0-d tensor")
        if weight.dim() != 2:
            raise ValueError(f"weight: expected a 2-D tensor ([V, H] for layout 'vh', [H, V] for 'hv'), got shape "
                             f"{list(weight.shape)}")
        self.layout = parse_layout(layout)
        check_sizes(hidden.shape[-1], weight.shape[0 if self.layout == Layout.VH else 1])
        self.hidden_shape = tuple(hidden.shape)
        self.owner = weight  # the caller's tensor (before any copy): its dweight pool outlives this call
        self.fake = is_fake(hidden)
        h = hidden.shape[-1]
        x = hidden.reshape(-1, h)  # a view when the leading dimensions collapse
        if not rows_view_ok(x.shape, x.stride()):
            x = x.contiguous()
        if not matrix_view_ok(weight.shape, weight.stride()):
            weight = weight.contiguous()
        if bias is not None:
            bias = contiguous_vector(bias)
        self.x, self.weight, self.bias = x, weight, bias
        self.n = x.shape[0]
        self.computes = self.n > 0 and not self.fake
        head_x = x if self.n > 0 else torch.zeros(1, h, dtype=self.dtype)  # N = 0: shapes checked, no call
        # bf16: the tensors' own bits and strides (torch.bfloat16 is the library's bf16), no copy
        self.head = LinearHead(view(head_x), view(weight), opt_view(bias), self.layout,
                               Dtype.BF16 if self.dtype == torch.bfloat16 else Dtype.F32)
        self.vocab = self.head.vocab

    def alloc_grads(self, need_x: bool, need_w: bool, need_b: bool):
        """Buffers the library overwrites (beta 0), in the dtypes autograd wants: dx with hidden's shape,
        contiguous, and dweight with the weight's strides (recycled through the weight's DweightPool) in the
        inputs' dtype, dbias [V] in the caller's bias dtype. Zero-filled when the library is not called."""
        alloc = torch.empty if self.computes else torch.zeros
        dx = alloc(self.hidden_shape, dtype=self.dtype) if need_x else None
        dw = None
        if need_w:
            if self.fake:
                dw = torch.empty_strided(self.weight.shape, self.weight.stride(), dtype=self.dtype)
            else:
                dw = dweight_pool(self.owner).take(self.weight.shape, self.weight.stride(), self.dtype)
                if not self.computes:
                    dw.zero_()
        db = alloc(self.bias.shape, dtype=self.bias_dtype) if need_b and self.bias is not None else None
        return dx, dw, db

    def grads_struct(self, dx, dw, db):
        """The library's fh_linear_grads for these buffers (dx as [N, H] rows)."""
        dtypes = tuple(Dtype.F32 if t is None or t.dtype == torch.float32 else Dtype.BF16 for t in (dx, dw, db))
        dx_rows = None if dx is None else dx.view(self.x.shape)
        return self.head.grads(opt_view(dx_rows), opt_view(dw), opt_view(db), dtypes=dtypes)


def support_of(ids, offsets, token_shape: Tuple[int, ...], n: int) -> Support:
    """The library's support of n tokens (token_shape) from support_ids padded (token_shape + [k], -1 padding) or CSR
    (1-D, with support_offsets [N + 1]), holding the tensors its views point into."""
    check_tensor(ids, "support_ids", torch.int64, INT64_HINT)
    if offsets is None:
        k = padded_support_width(ids.shape, token_shape, n)
        padded = ids.reshape(n, k).contiguous() if n > 0 else torch.zeros(1, max(k, 1), dtype=torch.int64)
        return Support(max(n, 1), view(padded), None, (padded,))  # n = 0: no call is made; the view needs a row
    check_tensor(offsets, "support_offsets", torch.int64, INT64_HINT)
    # an empty list still has an address for the library (its offsets say no row reads it)
    flat = ids.contiguous() if ids.numel() > 0 else torch.zeros(1, dtype=torch.int64)
    offsets = offsets.contiguous()
    return Support(n, view(flat), view(offsets), (flat, offsets))


def token_vector(t: torch.Tensor, name: str, token_shape: Tuple[int, ...], n: int, what: str) -> torch.Tensor:
    """A per-token tensor of token_shape (or [n]) as a contiguous [n] vector."""
    if tuple(t.shape) != token_shape and tuple(t.shape) != (n,):
        raise ValueError(f"{name}: expected shape {list(token_shape)} ({what}) or [{n}], got {list(t.shape)}")
    return contiguous_vector(t.reshape(n))


class SequenceRows(NamedTuple):
    """Where a sequence head's rows lie: [S, T] (cu_seqlens None), or packed end to end at cu_seqlens."""
    cu_seqlens: Optional[torch.Tensor]  # contiguous int64 [S + 1], or None
    token_shape: Tuple[int, ...]        # the per-token tensors' shape: hidden's leading dimensions
    sequences: int                      # S
    seq: int                            # T, or 0 when packed
    dims: str                           # the per-token shape's name in messages


def sequence_rows(hidden: torch.Tensor, cu_seqlens: Optional[torch.Tensor], sequences: str) -> SequenceRows:
    """hidden [S, T, H] (sequences: "B", "2B"), or packed sequences: cu_seqlens, int32 or int64 [S + 1] offsets (as
    flash-attention's cu_seqlens), with hidden [N, H] or [1, N, H] (a padding-free batch) and every per-token tensor
    of hidden's leading shape. The library checks the offsets (0 first, increasing, N last)."""
    if cu_seqlens is None:
        if hidden.dim() != 3:
            raise ValueError(f"hidden: expected [{sequences}, T, H] (or the packed rows [N, H] with cu_seqlens), got "
                             f"shape {list(hidden.shape)}")
        return SequenceRows(None, (int(hidden.shape[0]), int(hidden.shape[1])), int(hidden.shape[0]),
                            int(hidden.shape[1]), f"[{sequences}, T]")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected an int32 or int64 tensor, got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected [{sequences} + 1] offsets of at least one sequence, got shape "
                         f"{list(cu_seqlens.shape)}")
    if not (hidden.dim() == 2 or (hidden.dim() == 3 and hidden.shape[0] == 1)):
        raise ValueError(f"hidden: with cu_seqlens expected the packed rows [N, H] or [1, N, H], got shape "
                         f"{list(hidden.shape)}")
    check_tensor(cu_seqlens, "cu_seqlens", cu_seqlens.dtype)
    cu = cu_seqlens.detach().to(torch.int64).contiguous()
    return SequenceRows(cu, tuple(int(d) for d in hidden.shape[:-1]), int(cu.shape[0]) - 1, 0, "[N] (packed rows)")


def bt_tensor(t, name: str, dtype: torch.dtype, bt: Tuple[int, ...], n: int, hint: str = "",
              dims: str = "[B, T]", source: str = "hidden's leading dimensions") -> torch.Tensor:
    """A token tensor of the batch's shape bt, as a contiguous [n] vector (detached)."""
    check_tensor(t, name, dtype, hint)
    if tuple(t.shape) != bt:
        raise ValueError(f"{name}: expected shape {dims} = {list(bt)} ({source}), got {list(t.shape)}")
    return contiguous_vector(t.detach().reshape(n))


def mask_tensor(mask, name: str, bt: Tuple[int, ...], n: int, **dims) -> torch.Tensor:
    """A [B, T] mask of any real dtype (bool, integer, floating), as the float32 vector the library takes."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name}: expected a real (bool, integer or floating) tensor, got {mask.dtype}")
    return bt_tensor(mask.to(torch.float32), name, torch.float32, bt, n, **dims)


def fp32_vector(t, name: str, dtype: torch.dtype, length: int, dims: str) -> torch.Tensor:
    """A per-sequence float32 operand (bfloat16 too with bfloat16 inputs) of `length` values, contiguous, detached."""
    t = fp32_operand(t, name, dtype)
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name}: expected shape {dims} = [{length}], got {list(t.shape)}")
    return contiguous_vector(t.detach())


def scalar(value: Optional[float], dtype: torch.dtype) -> torch.Tensor:
    """A loss in the inputs' dtype, as F.cross_entropy on bf16 logits returns it: the library's double value
    rounded once (0 when there was no call)."""
    return torch.tensor(0.0 if value is None else value, dtype=dtype)


def metrics_tensors(metrics, keys) -> Tuple[torch.Tensor, torch.Tensor]:
    """A metrics struct as op outputs (tensors that compare equal when equal: no NaN): its values as float64 in its
    field order, 0 where the library reports none (NaN there: TRL logs nothing), and which ones it reports (bool).
    None (no call): none reported."""
    values = torch.tensor([float("nan") if metrics is None else getattr(metrics, f) for f, _ in keys],
                          dtype=torch.float64)
    present = ~torch.isnan(values)
    return torch.where(present, values, torch.zeros((), dtype=torch.float64)), present


def metrics_dict(keys, values: torch.Tensor, present: torch.Tensor) -> dict:
    """TRL's metric names -> values: floats, only those TRL logs; under torch.compile 0-d tensors for every key (NaN
    where TRL logs nothing), since which ones TRL logs is known only at run time."""
    if compiling():
        values = torch.where(present, values, torch.full((), float("nan"), dtype=values.dtype))
        return {key: values[i] for i, (_, key) in enumerate(keys)}
    return {key: v for (_, key), v, p in zip(keys, values.tolist(), present.tolist()) if p}
