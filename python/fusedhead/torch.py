"""PyTorch front end: fused linear cross-entropy as an autograd Function, a functional and an nn.Module.

    from fusedhead.torch import fused_linear_cross_entropy
    loss = fused_linear_cross_entropy(hidden, lm_head.weight, targets)   # == F.cross_entropy(F.linear(...))
    loss.backward()

Semantics: F.cross_entropy(F.linear(hidden, weight, bias).view(-1, V), targets.view(-1), weight=class_weights,
ignore_index=..., reduction=..., label_smoothing=...), plus Gemma-style logit softcap (c * tanh(u / c)) and
z-loss (z_loss * lse^2, averaged over non-ignored tokens for 'mean', never class-weighted, added to the loss).
One documented difference: when every token is ignored (or every target has class weight 0), 'mean' gives
loss 0 and zero gradients where torch gives NaN. N = 0 tokens behaves the same way.

Inputs: CPU tensors; hidden and weight both float32 or both bfloat16 (mixed: TypeError); bias and
class_weights float32 (with bfloat16 inputs bfloat16 too, converted to float32: [V] copies); targets int64.
hidden is [..., H] (e.g. [B, T, H]) and targets hidden's leading shape (or flat [N]); weight is [V, H]
(layout="vh", nn.Linear.weight, the default) or [H, V] (layout="hv"). Anything else raises TypeError /
ValueError saying what was expected.

bfloat16: the library reads the tensors' own bf16 bits with their strides (no float32 copy of hidden or
weight), runs its GEMMs in bf16 with f32 accumulation and every statistic in fp32/double (README "### bf16").
Outputs follow F.cross_entropy(F.linear(hidden, weight), ...) on bf16 tensors: the loss (and z_loss, and
the per-token losses of 'none') in bfloat16, the library's value rounded once; the gradients of hidden,
weight and bias in their own dtypes, written by the library in that dtype (bf16: accumulated in f32 inside
the call, rounded once; no float32 gradient buffer exists). GRPO's metrics are Python floats and its
per-token log-probs float32 whatever the dtype.

Copies (only where the library cannot take the tensor as it is):
  - hidden: none when its rows have unit element stride (contiguous, or row-padded 2-D slices); [B, T, H]
    is flattened with reshape (a view when possible); otherwise one contiguous copy.
  - weight: none for any positive non-overlapping strides (contiguous, transposed, sliced); else a copy.
  - targets, bias, class_weights: a copy only when not contiguous ([N] / [V] vectors, cheap).
  - the per-token upstream gradient of reduction='none': made contiguous (autograd often passes an
    expanded, zero-stride tensor).

Gradients: only for inputs that require grad (the library is handed NULL for the others).
  - 'mean'/'sum' with grad enabled: the forward calls fh_ce_forward_backward with upstream gradient 1
    (6 NHV flops instead of 8 for forward + backward, as Liger does); backward scales the saved gradients by
    the incoming scalar (no work when it is 1; otherwise into new tensors, the saved ones untouched). The
    gradients (dweight is V x H) are held from forward to backward.
  - dweight buffers (in the weight's dtype) are recycled per weight (at most two, freed with the weight): one
    is handed out again only when no tensor refers to it any more, so .grad, hooks and torch.autograd.grad see
    what a fresh tensor would give them, without a fresh tensor's page faults (see _DweightPool).
  - 'none': the forward (fh_ce_forward) saves lse [N]; backward calls fh_ce_backward with the per-token
    upstream gradient. The library rejects a non-finite upstream gradient (InvalidGradOutputError) where torch
    would propagate NaN.
  - Without grad (torch.no_grad, or nothing requires grad): forward only.
Double backward is not supported.

GRPO: fused_linear_grpo_loss / FusedLinearGRPOLoss / FusedLinearGRPOLossFunction compute TRL's
GRPOTrainer._compute_loss (every loss_type, token or sequence importance sampling, KL, entropy bonus) from
hidden [B, T, H]; returns (loss, metrics with TRL's keys). With grad enabled the forward calls
fh_grpo_forward_backward (upstream 1) and backward scales the saved gradients, as for 'mean'/'sum' above.
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from ._core import (GRPO_METRIC_KEYS, CEProblem, Context, GRPOProblem, LinearHead, View, default_context,
                    grpo_metrics_dict, grpo_options, matrix_view_ok, parse_grpo_is_level, parse_grpo_loss_type,
                    parse_layout, parse_reduction, rows_view_ok, vector_view_ok)
from ._lib import Dtype, Reduction

__all__ = ["FusedLinearCrossEntropyFunction", "FusedLinearCrossEntropy", "fused_linear_cross_entropy",
           "FusedLinearGRPOLossFunction", "FusedLinearGRPOLoss", "fused_linear_grpo_loss"]


# ---------------------------------------------------------------------------------------------------------
# Shared tensor helpers (for every loss: cross-entropy now, GRPO later)
# ---------------------------------------------------------------------------------------------------------
def _check_tensor(t, name: str, dtype: torch.dtype, hint: str = "") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: fusedhead runs on the CPU; got a tensor on {t.device} (move it with .cpu())")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}{hint}")
    return t


_FP32_HINT = "; fusedhead takes float32 here (use .float())"


def _check_inputs(hidden, weight) -> torch.dtype:
    """The dtype of hidden and weight: both float32 or both bfloat16 (the library computes a bf16 x bf16 GEMM
    or an fp32 one, never a mixed one); returns it."""
    bf16 = isinstance(hidden, torch.Tensor) and hidden.dtype == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else torch.float32
    _check_tensor(hidden, "hidden", dtype, " (fusedhead takes float32 or bfloat16; use .float())")
    _check_tensor(weight, "weight", dtype, " (hidden and weight must have one dtype: both float32 or both bfloat16)")
    return dtype


def _fp32_operand(t, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A float32 operand of the library (bias, class weights, GRPO's per-token and per-sequence values). With
    bfloat16 inputs a bfloat16 one is accepted too (what a bf16 model holds) and converted: a [V] or [B, T]
    copy, nothing next to the GEMMs."""
    if dtype == torch.bfloat16 and isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
        return _check_tensor(t, name, torch.bfloat16).float()
    return _check_tensor(t, name, torch.float32, _FP32_HINT)


def _view(t: torch.Tensor) -> View:
    return View(t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def _opt_view(t: Optional[torch.Tensor]) -> Optional[View]:
    return None if t is None else _view(t)


def _contiguous_vector(t: torch.Tensor) -> torch.Tensor:
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
_DWEIGHT_SLOTS = 2  # the gradient, and the copy that backward scales when the upstream gradient is not 1


def _storage_elements(shape: Sequence[int], strides: Sequence[int]) -> int:
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


class _DweightPool:
    """The recycled dweight buffers of one weight, at most _DWEIGHT_SLOTS; they live as long as the weight's
    Python object. Between steps the pool holds what the step's peak already needed: the gradient (besides
    .grad when zero_grad keeps it), and its scaled copy only where backward made one."""

    def __init__(self):
        self._lock = threading.Lock()  # calls on separate threads may share a weight
        self._slots = []  # [flat ndarray, weak reference to its latest hand-out]

    def take(self, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of this shape, strides and dtype (float32 or bfloat16) that no other tensor
        refers to."""
        size = _storage_elements(shape, strides)
        # NumPy has no bfloat16 and torch 1.13 no uint16: bf16 bits live in int16 buffers
        np_dtype = np.dtype(np.float32 if dtype == torch.float32 else np.int16)
        with self._lock:
            free = [s for s in self._slots if s[1]() is None]
            slot = next((s for s in free if s[0].size == size and s[0].dtype == np_dtype), None)
            if slot is None:
                if len(self._slots) < _DWEIGHT_SLOTS:
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


_dweight_pools: Dict[int, _DweightPool] = {}
_dweight_pools_lock = threading.Lock()


def _dweight_pool(weight: torch.Tensor) -> _DweightPool:
    """The pool of this weight tensor (by identity: a Parameter is the same object every step)."""
    key = id(weight)
    with _dweight_pools_lock:
        pool = _dweight_pools.get(key)
        if pool is None:
            pool = _dweight_pools[key] = _DweightPool()
            # dropped when the weight dies, before its id can be reused; holds neither the weight nor the pool
            weakref.finalize(weight, _dweight_pools.pop, key, None)
    return pool


class _TorchLinear:
    """hidden [..., H], weight and bias as the library takes them (copies only where needed), and the
    gradient buffers for the inputs that need them."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layout):
        self.dtype = _check_inputs(hidden, weight)
        self.bias_dtype = None if bias is None else bias.dtype
        if bias is not None:
            bias = _fp32_operand(bias, "bias", self.dtype)
        if hidden.dim() < 1:
            raise ValueError("hidden: expected [..., H], got a 0-d tensor")
        if weight.dim() != 2:
            raise ValueError(f"weight: expected a 2-D tensor ([V, H] for layout 'vh', [H, V] for 'hv'), got shape "
                             f"{list(weight.shape)}")
        self.layout = parse_layout(layout)
        self.hidden_shape = tuple(hidden.shape)
        self.owner = weight  # the caller's tensor (before any copy): its dweight pool outlives this call
        h = hidden.shape[-1]
        x = hidden.reshape(-1, h)  # a view when the leading dimensions collapse
        if not rows_view_ok(x.shape, x.stride()):
            x = x.contiguous()
        if not matrix_view_ok(weight.shape, weight.stride()):
            weight = weight.contiguous()
        if bias is not None:
            bias = _contiguous_vector(bias)
        self.x, self.weight, self.bias = x, weight, bias
        self.n = x.shape[0]
        head_x = x if self.n > 0 else torch.zeros(1, h, dtype=self.dtype)  # N = 0: shapes checked, no call
        # bf16: the tensors' own bits and strides (torch.bfloat16 is the library's bf16), no copy
        self.head = LinearHead(_view(head_x), _view(weight), _opt_view(bias), self.layout,
                               Dtype.BF16 if self.dtype == torch.bfloat16 else Dtype.F32)
        self.vocab = self.head.vocab

    def alloc_grads(self, need_x: bool, need_w: bool, need_b: bool):
        """Buffers the library overwrites (beta 0), in the dtypes autograd wants: dx [N, H] contiguous and
        dweight with the weight's strides (recycled through the weight's _DweightPool) in the inputs' dtype,
        dbias [V] in the caller's bias dtype. Zero-filled when N = 0 (the library is not called)."""
        alloc = torch.zeros if self.n == 0 else torch.empty
        dx = alloc(self.x.shape, dtype=self.dtype) if need_x else None
        dw = None
        if need_w:
            dw = _dweight_pool(self.owner).take(self.weight.shape, self.weight.stride(), self.dtype)
            if self.n == 0:
                dw.zero_()
        db = alloc(self.bias.shape, dtype=self.bias_dtype) if need_b and self.bias is not None else None
        return dx, dw, db

    def grads_struct(self, dx, dw, db):
        dtypes = tuple(Dtype.F32 if t is None or t.dtype == torch.float32 else Dtype.BF16 for t in (dx, dw, db))
        return self.head.grads(_opt_view(dx), _opt_view(dw), _opt_view(db), dtypes=dtypes)

    def hidden_grad(self, dx: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if dx is None else dx.view(self.hidden_shape)


def _token_vector(t: torch.Tensor, name: str, token_shape: Tuple[int, ...], n: int, what: str) -> torch.Tensor:
    if tuple(t.shape) != token_shape and tuple(t.shape) != (n,):
        raise ValueError(f"{name}: expected shape {list(token_shape)} ({what}) or [{n}], got {list(t.shape)}")
    return _contiguous_vector(t.reshape(n))


# ---------------------------------------------------------------------------------------------------------
# Cross-entropy
# ---------------------------------------------------------------------------------------------------------
class _CE:
    """Everything one cross-entropy call needs, checked and in library form."""

    def __init__(self, hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing,
                 softcap, z_loss, layout):
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        _check_tensor(targets, "targets", torch.int64, " (use .long())")
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = _token_vector(targets, "targets", self.token_shape, self.lin.n, "hidden's leading dimensions")
        if class_weights is not None:
            class_weights = _contiguous_vector(_fp32_operand(class_weights, "class_weights", self.lin.dtype).detach())
        self.class_weights = class_weights
        self.reduction = parse_reduction(reduction)
        self.ignore_index, self.z_loss = int(ignore_index), float(z_loss)
        # N = 0: a placeholder of the 1-row head's size, for the shape checks only (the library is not called)
        targets_view = _view(self.targets) if self.lin.n > 0 else View(0, (1,), (1,))
        self.problem = CEProblem(self.lin.head, targets_view, ignore_index=ignore_index, reduction=self.reduction,
                                 label_smoothing=label_smoothing, class_weights=_opt_view(class_weights),
                                 softcap=softcap, z_loss=z_loss)

    @property
    def n(self) -> int:
        return self.lin.n

    def per_token_z(self, lse: torch.Tensor) -> torch.Tensor:
        """z_loss * lse^2 per token (0 where ignored), from the forward's fp32 lse."""
        return torch.where(self.targets != self.ignore_index, self.z_loss * lse * lse,
                           torch.zeros((), dtype=lse.dtype)).view(self.token_shape).to(self.lin.dtype)


def _scaled(saved, grad_loss: torch.Tensor, pool: Optional[_DweightPool]):
    """The train step's saved gradients (of the loss, upstream 1) times d(objective)/d(loss). Not in place: a
    retained graph's next backward needs them as they are. dweight's product goes to a pooled buffer. bf16
    gradients were rounded in the forward, so their product is a second rounding (exact for a power of two, as
    loss scaling and averaging over 2^k micro-batches use)."""
    dx, dw, db = saved
    if bool(grad_loss == 1):
        return dx, dw, db
    dx, db = (None if t is None else t * grad_loss for t in (dx, db))  # NaN propagates, as in torch
    if dw is not None:
        dw = torch.mul(dw, grad_loss.to(dw.dtype), out=pool.take(dw.shape, dw.stride(), dw.dtype))
    return dx, dw, db


def _scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A loss in the inputs' dtype, as F.cross_entropy on bf16 logits returns it: the library's double value
    rounded once."""
    return torch.tensor(value, dtype=dtype)


def _forward_reduced(ce: _CE, context: Optional[Context], need: Sequence[bool]):
    """'mean'/'sum': (loss, z_loss, (dx, dw, db)); gradients of loss (upstream 1) for the inputs in need."""
    dx, dw, db = ce.lin.alloc_grads(*need)
    dtype = ce.lin.dtype
    if ce.n == 0:
        return _scalar(0.0, dtype), _scalar(0.0, dtype), (dx, dw, db)
    ctx = context or default_context()
    if any(need):
        one = torch.ones(1, dtype=torch.float32)
        loss, z = ce.problem.forward_backward(ctx, one.data_ptr(), ce.lin.grads_struct(dx, dw, db))
    else:
        loss, z = ce.problem.forward(ctx)
    return _scalar(loss, dtype), _scalar(z, dtype), (dx, dw, db)


def _forward_none(ce: _CE, context: Optional[Context]):
    """'none': (per-token loss, per-token z-loss, lse [N])."""
    per_token = torch.zeros(ce.n, dtype=torch.float32)
    lse = torch.zeros(ce.n, dtype=torch.float32)
    if ce.n > 0:
        ce.problem.forward(context or default_context(), per_token_loss=per_token.data_ptr(), lse=lse.data_ptr())
    return per_token.view(ce.token_shape).to(ce.lin.dtype), ce.per_token_z(lse), lse


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """apply(hidden, weight, targets, bias=None, class_weights=None, ignore_index=-100, reduction="mean",
    label_smoothing=0.0, softcap=0.0, z_loss=0.0, layout="vh", context=None) -> (loss, z_loss)

    z_loss is the z-loss part of loss (reduced like it; per token for 'none'); it is not differentiable
    (its gradient flows through loss). Positional arguments only (torch.autograd.Function.apply).
    Gradients are computed for the inputs whose ctx.needs_input_grad is set, which torch fills from
    requires_grad even under torch.no_grad(): prefer fused_linear_cross_entropy, which runs the forward
    alone when no gradient can be needed."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias=None, class_weights=None, ignore_index=-100, reduction="mean",
                label_smoothing=0.0, softcap=0.0, z_loss=0.0, layout="vh", context=None):
        ce = _CE(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing, softcap,
                 z_loss, layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        ctx.reduction = ce.reduction
        ctx.fh_context = context
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        if ce.reduction != Reduction.NONE:
            loss, z, (dx, dw, db) = _forward_reduced(ce, context, need)
            ctx.save_for_backward(ce.lin.hidden_grad(dx), dw, db)
        else:
            loss, z, lse = _forward_none(ce, context)
            # What the library saw (views of the inputs, or the copies made for it), for fh_ce_backward.
            ctx.save_for_backward(ce.lin.x, ce.lin.weight, ce.targets, ce.lin.bias, ce.class_weights, lse)
            ctx.need = need
            ctx.options = (ignore_index, label_smoothing, softcap, z_loss, layout)
            ctx.hidden_shape = ce.lin.hidden_shape
            ctx.bias_dtype = ce.lin.bias_dtype  # the caller's: the saved bias is its fp32 form
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_z):
        if ctx.reduction != Reduction.NONE:
            dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        else:
            x, weight, targets, bias, class_weights, lse = ctx.saved_tensors  # version-checked
            ignore_index, label_smoothing, softcap, z_loss, layout = ctx.options
            ce = _CE(x, weight, targets, bias, class_weights, ignore_index, Reduction.NONE, label_smoothing, softcap,
                     z_loss, layout)
            ce.lin.bias_dtype = ctx.bias_dtype  # the caller's, for dbias: the saved bias is its fp32 form
            dx, dw, db = ce.lin.alloc_grads(*ctx.need)
            if ce.n > 0:
                g = _token_vector(grad_loss.to(torch.float32), "grad_output", tuple(ctx.hidden_shape[:-1]), ce.n,
                                  "per token")
                ce.problem.backward(ctx.fh_context or default_context(), lse.data_ptr(), g.data_ptr(),
                                    ce.lin.grads_struct(dx, dw, db))
            dx = None if dx is None else dx.view(ctx.hidden_shape)
        return (dx, dw, None, db) + (None,) * 8


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               class_weights: Optional[torch.Tensor] = None, softcap: float = 0.0,
                               z_loss: float = 0.0, *, weight_classes: Optional[torch.Tensor] = None,
                               layout: str = "vh", return_z_loss: bool = False, context: Optional[Context] = None):
    """F.cross_entropy(F.linear(hidden, weight, bias), targets, weight=class_weights, ...) without the logits.

    class_weights is torch's `weight=` (alias: weight_classes). Returns the loss (a scalar, or the targets'
    shape for 'none'), or (loss, z_loss) with return_z_loss=True (z_loss: the z-loss part, detached).
    """
    if weight_classes is not None:
        if class_weights is not None:
            raise ValueError("pass class_weights or weight_classes, not both")
        class_weights = weight_classes
    parse_reduction(reduction)
    grad_on = torch.is_grad_enabled()
    if grad_on and class_weights is not None and isinstance(class_weights, torch.Tensor) and \
            class_weights.requires_grad:
        raise ValueError("class_weights: gradients with respect to class weights are not supported "
                         "(torch's cross_entropy does not implement them either); pass class_weights.detach()")
    tracked = [t for t in (hidden, weight, bias) if isinstance(t, torch.Tensor)]
    if grad_on and any(t.requires_grad for t in tracked):
        loss, z = FusedLinearCrossEntropyFunction.apply(hidden, weight, targets, bias, class_weights, ignore_index,
                                                        reduction, label_smoothing, softcap, z_loss, layout,
                                                        context)
    else:
        ce = _CE(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing, softcap,
                 z_loss, layout)
        if ce.reduction != Reduction.NONE:
            loss, z, _ = _forward_reduced(ce, context, (False, False, False))
        else:
            loss, z, _ = _forward_none(ce, context)
    return (loss, z) if return_z_loss else loss


class FusedLinearCrossEntropy(torch.nn.Module):
    """nn.Module form (options fixed at construction; the lm_head weight is a forward argument, as in Liger's
    LigerFusedLinearCrossEntropyLoss):

        loss_fn = FusedLinearCrossEntropy(ignore_index=-100, label_smoothing=0.1)
        loss = loss_fn(hidden, model.lm_head.weight, targets)             # bias=model.lm_head.bias if any
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 class_weights: Optional[torch.Tensor] = None, softcap: float = 0.0, z_loss: float = 0.0,
                 layout: str = "vh", return_z_loss: bool = False, context: Optional[Context] = None):
        super().__init__()
        parse_reduction(reduction)
        parse_layout(layout)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.z_loss, self.layout, self.return_z_loss = softcap, z_loss, layout, return_z_loss
        self.context = context
        self.register_buffer("class_weights", class_weights)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor] = None):
        return fused_linear_cross_entropy(hidden, weight, targets, bias, self.ignore_index, self.reduction,
                                          self.label_smoothing, self.class_weights, self.softcap, self.z_loss,
                                          layout=self.layout, return_z_loss=self.return_z_loss,
                                          context=self.context)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, z_loss={self.z_loss}, "
                f"layout={self.layout!r}, return_z_loss={self.return_z_loss}")


# ---------------------------------------------------------------------------------------------------------
# GRPO (TRL GRPOTrainer._compute_loss semantics)
# ---------------------------------------------------------------------------------------------------------
GRPO_OPTION_NAMES = ("loss_type", "importance_sampling_level", "temperature", "epsilon_low", "epsilon_high",
                     "delta", "beta", "sapo_temperature_pos", "sapo_temperature_neg", "num_items_in_batch",
                     "max_completion_length", "entropy_coef")


def _bt_tensor(t, name: str, dtype: torch.dtype, bt: Tuple[int, int], n: int, hint: str = "") -> torch.Tensor:
    _check_tensor(t, name, dtype, hint)
    if tuple(t.shape) != bt:
        raise ValueError(f"{name}: expected shape [B, T] = {list(bt)} (hidden's leading dimensions), got "
                         f"{list(t.shape)}")
    return _contiguous_vector(t.detach().reshape(n))


class _GRPO:
    """Everything one GRPO call needs, checked and in library form. hidden [B, T, H]; completion_ids int64
    [B, T]; completion_mask [B, T] (bool, integer or floating: converted to float32); advantages float32 [B];
    old/ref per-token log-probs float32 [B, T] or None (advantages and old/ref may be bfloat16 with bfloat16
    inputs: converted)."""

    def __init__(self, hidden, weight, completion_ids, completion_mask, advantages, bias, old, ref, options: dict,
                 layout):
        dtype = _check_inputs(hidden, weight)
        if hidden.dim() != 3:
            raise ValueError(f"hidden: expected [B, T, H] (the hidden states of the completion tokens), got shape "
                             f"{list(hidden.shape)}")
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        b, t = int(hidden.shape[0]), int(hidden.shape[1])
        self.bt, n = (b, t), b * t
        self.completion_ids = _bt_tensor(completion_ids, "completion_ids", torch.int64, self.bt, n, " (use .long())")
        if not isinstance(completion_mask, torch.Tensor):
            raise TypeError(f"completion_mask: expected a torch.Tensor, got {type(completion_mask).__name__}")
        if completion_mask.is_complex():
            raise TypeError(f"completion_mask: expected a real (bool, integer or floating) tensor, got "
                            f"{completion_mask.dtype}")
        self.completion_mask = _bt_tensor(completion_mask.to(torch.float32), "completion_mask", torch.float32,
                                          self.bt, n)
        advantages = _fp32_operand(advantages, "advantages", dtype)
        if tuple(advantages.shape) != (b,):
            raise ValueError(f"advantages: expected shape [B] = [{b}], got {list(advantages.shape)}")
        self.advantages = _contiguous_vector(advantages.detach())
        self.old = None if old is None else _bt_tensor(_fp32_operand(old, "old_per_token_logps", dtype),
                                                       "old_per_token_logps", torch.float32, self.bt, n)
        self.ref = None if ref is None else _bt_tensor(_fp32_operand(ref, "ref_per_token_logps", dtype),
                                                       "ref_per_token_logps", torch.float32, self.bt, n)
        self.options = grpo_options(**options)
        self.problem = None
        if n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = GRPOProblem(self.lin.head, b, t, _view(self.completion_ids), _view(self.completion_mask),
                                       _view(self.advantages), _opt_view(self.old), _opt_view(self.ref),
                                       self.options)

    @property
    def n(self) -> int:
        return self.lin.n


def _grpo_run(g: _GRPO, context: Optional[Context], need: Sequence[bool]):
    """(loss, metrics float64 [6] in fh_grpo_metrics order, per-token logp [B, T], (dx, dw, db)); gradients of
    the loss (upstream 1) for the inputs in need."""
    dx, dw, db = g.lin.alloc_grads(*need)
    logp = torch.zeros(g.n, dtype=torch.float32)
    if g.problem is None:
        return _scalar(0.0, g.lin.dtype), torch.full((len(GRPO_METRIC_KEYS),), float("nan"), dtype=torch.float64), \
            logp.view(g.bt), (dx, dw, db)
    ctx = context or default_context()
    if any(need):
        one = torch.ones(1, dtype=torch.float32)
        loss, m = g.problem.forward_backward(ctx, one.data_ptr(), g.lin.grads_struct(dx, dw, db),
                                             per_token_logp=logp.data_ptr())
    else:
        loss, m = g.problem.forward(ctx, per_token_logp=logp.data_ptr())
    metrics = torch.tensor([getattr(m, f) for f, _ in GRPO_METRIC_KEYS], dtype=torch.float64)
    return _scalar(loss, g.lin.dtype), metrics, logp.view(g.bt), (dx, dw, db)


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    """apply(hidden, weight, completion_ids, completion_mask, advantages, bias=None, old_per_token_logps=None,
    ref_per_token_logps=None, options=None, layout="vh", context=None) -> (loss, metrics, per_token_logps)

    options: a dict of fh_grpo_options values by TRL name (GRPO_OPTION_NAMES; missing: TRL defaults).
    metrics: float64 [6] in fh_grpo_metrics order (NaN where TRL logs nothing); per_token_logps: float32 [B, T]
    under the current policy (0 at out-of-range ids of masked padding). Both non-differentiable.
    The forward runs fh_grpo_forward_backward with upstream gradient 1 for the inputs whose
    ctx.needs_input_grad is set; backward scales the saved gradients by the incoming scalar. advantages and
    the old/reference log-probs are constants (as in TRL): they get no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, completion_ids, completion_mask, advantages, bias=None, old_per_token_logps=None,
                ref_per_token_logps=None, options=None, layout="vh", context=None):
        g = _GRPO(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                  ref_per_token_logps, dict(options or {}), layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[5])
        loss, metrics, logp, (dx, dw, db) = _grpo_run(g, context, need)
        ctx.save_for_backward(g.lin.hidden_grad(dx), dw, db)
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        ctx.mark_non_differentiable(metrics, logp)
        return loss, metrics, logp

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics, _grad_logp):
        dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        return (dx, dw, None, None, None, db) + (None,) * 5


def _grpo_option_dict(loss_type, importance_sampling_level, temperature, epsilon_low, epsilon_high, delta, beta,
                      sapo_temperature_pos, sapo_temperature_neg, num_items_in_batch, max_completion_length,
                      entropy_coef) -> dict:
    if isinstance(num_items_in_batch, torch.Tensor):  # TRL passes a tensor
        num_items_in_batch = float(num_items_in_batch.item())
    parse_grpo_loss_type(loss_type)
    parse_grpo_is_level(importance_sampling_level)
    return dict(loss_type=loss_type, importance_sampling_level=importance_sampling_level, temperature=temperature,
                epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
                sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                num_items_in_batch=num_items_in_batch, max_completion_length=max_completion_length,
                entropy_coef=entropy_coef)


def fused_linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor, advantages: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, old_per_token_logps: Optional[torch.Tensor] = None,
                           ref_per_token_logps: Optional[torch.Tensor] = None, *, loss_type: str = "grpo",
                           importance_sampling_level: str = "token", temperature: float = 1.0,
                           epsilon_low: Optional[float] = None, epsilon: Optional[float] = None,
                           epsilon_high: Optional[float] = None, delta: Optional[float] = None, beta: float = 0.0,
                           sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                           num_items_in_batch=None, max_completion_length: Optional[int] = None,
                           entropy_coef: float = 0.0, layout: str = "vh", return_per_token_logps: bool = False,
                           context: Optional[Context] = None):
    """TRL GRPOTrainer._compute_loss from hidden [B, T, H] (position t predicts completion_ids[b, t]) and the
    lm_head weight, without the [B*T, V] logits.

    Options use TRL's GRPOConfig names (epsilon is an alias of epsilon_low, default 0.2; epsilon_high None:
    = epsilon_low; delta None: off). old_per_token_logps None: on-policy (old = logp detached);
    ref_per_token_logps is required when beta != 0. Returns (loss, metrics) where metrics has TRL's keys
    "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "cispo_clip_ratio" (only those TRL logs for these options), or (loss, metrics, per_token_logps) with
    return_per_token_logps=True (detached float32 [B, T]).
    """
    if epsilon is not None and epsilon_low is not None and float(epsilon) != float(epsilon_low):
        raise ValueError("pass epsilon or epsilon_low (its alias), not both")
    eps_low = epsilon_low if epsilon_low is not None else (epsilon if epsilon is not None else 0.2)
    options = _grpo_option_dict(loss_type, importance_sampling_level, temperature, eps_low, epsilon_high, delta,
                                beta, sapo_temperature_pos, sapo_temperature_neg, num_items_in_batch,
                                max_completion_length, entropy_coef)
    tracked = [t for t in (hidden, weight, bias) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
        loss, metrics, logp = FusedLinearGRPOLossFunction.apply(hidden, weight, completion_ids, completion_mask,
                                                                advantages, bias, old_per_token_logps,
                                                                ref_per_token_logps, options, layout, context)
    else:
        g = _GRPO(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                  ref_per_token_logps, options, layout)
        loss, metrics, logp, _ = _grpo_run(g, context, (False, False, False))
    metrics = grpo_metrics_dict(metrics.tolist())
    return (loss, metrics, logp) if return_per_token_logps else (loss, metrics)


class FusedLinearGRPOLoss(torch.nn.Module):
    """nn.Module form (options fixed at construction, TRL GRPOConfig names; num_items_in_batch may also be
    given per call, as TRL does):

        loss_fn = FusedLinearGRPOLoss(loss_type="dapo", beta=0.04, temperature=0.7)
        loss, metrics = loss_fn(hidden, model.lm_head.weight, completion_ids, completion_mask, advantages,
                                old_per_token_logps=old, ref_per_token_logps=ref)
    """

    def __init__(self, loss_type: str = "grpo", importance_sampling_level: str = "token", temperature: float = 1.0,
                 epsilon_low: Optional[float] = None, epsilon: Optional[float] = None,
                 epsilon_high: Optional[float] = None, delta: Optional[float] = None, beta: float = 0.0,
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                 num_items_in_batch=None, max_completion_length: Optional[int] = None, entropy_coef: float = 0.0,
                 layout: str = "vh", return_per_token_logps: bool = False, context: Optional[Context] = None):
        super().__init__()
        if epsilon is not None and epsilon_low is not None and float(epsilon) != float(epsilon_low):
            raise ValueError("pass epsilon or epsilon_low (its alias), not both")
        eps_low = epsilon_low if epsilon_low is not None else (epsilon if epsilon is not None else 0.2)
        parse_layout(layout)
        self.options = _grpo_option_dict(loss_type, importance_sampling_level, temperature, eps_low, epsilon_high,
                                         delta, beta, sapo_temperature_pos, sapo_temperature_neg,
                                         num_items_in_batch, max_completion_length, entropy_coef)
        self.layout, self.return_per_token_logps, self.context = layout, return_per_token_logps, context

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, advantages: torch.Tensor, bias: Optional[torch.Tensor] = None,
                old_per_token_logps: Optional[torch.Tensor] = None,
                ref_per_token_logps: Optional[torch.Tensor] = None, num_items_in_batch=None):
        opts = dict(self.options)
        if num_items_in_batch is not None:
            opts["num_items_in_batch"] = num_items_in_batch
        return fused_linear_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias,
                                      old_per_token_logps, ref_per_token_logps, layout=self.layout,
                                      return_per_token_logps=self.return_per_token_logps, context=self.context,
                                      **opts)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"
