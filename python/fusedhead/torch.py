"""PyTorch front end: fused linear cross-entropy as an autograd Function, a functional and an nn.Module.

    from fusedhead.torch import fused_linear_cross_entropy
    loss = fused_linear_cross_entropy(hidden, lm_head.weight, targets)   # == F.cross_entropy(F.linear(...))
    loss.backward()

Semantics: F.cross_entropy(F.linear(hidden, weight, bias).view(-1, V), targets.view(-1), weight=class_weights,
ignore_index=..., reduction=..., label_smoothing=...), plus a logit scale (m * u, before the softcap), Gemma-style
logit softcap (c * tanh(m u / c)), z-loss (z_loss * lse^2, averaged over non-ignored tokens for 'mean', never
class-weighted, added to the loss) and DFT's token scaling (each token's loss times its target's probability,
detached); return_entropy / return_correct add the per-token entropy and the correct count. causal_lm_loss is Hugging
Face's ForCausalLMLoss (labels shifted by one, sum over num_items_in_batch or mean) on the same call.
One documented difference: when every token is ignored (or every target has class weight 0), 'mean' gives
loss 0 and zero gradients where torch gives NaN. N = 0 tokens behaves the same way.

Inputs: CPU tensors; hidden and weight both float32 or both bfloat16 (mixed: TypeError); bias and
class_weights float32 (with bfloat16 inputs bfloat16 too, converted to float32: [V] copies); targets int64.
hidden is [..., H] (e.g. [B, T, H]) and targets hidden's leading shape (or flat [N]); weight is [V, H]
(layout="vh", nn.Linear.weight, the default) or [H, V] (layout="hv"). Anything else raises TypeError /
ValueError saying what was expected.

bfloat16: the library reads the tensors' own bf16 bits with their strides (no float32 copy of hidden or
weight), runs its GEMMs in bf16 with f32 accumulation and every statistic in fp32/double (docs/bf16.md).
Outputs follow F.cross_entropy(F.linear(hidden, weight), ...) on bf16 tensors: the loss (and z_loss, and
the per-token losses of 'none') in bfloat16, the library's value rounded once; the gradients of hidden,
weight and bias in their own dtypes, written by the library in that dtype (bf16: accumulated in f32 inside
the call, rounded once; no float32 gradient buffer exists). GRPO's and the preference heads' metrics are
Python floats, their per-token / per-sequence log-probs and rewards float32 whatever the dtype.

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
    upstream gradient. The library refuses a non-finite upstream value, so the binding passes 0 for it and makes
    that token's dx row and all of dweight and dbias NaN, as torch's NaN propagation does ('mean'/'sum' scale the
    saved gradients, so a NaN propagates there by itself).
  - Without grad (torch.no_grad, or nothing requires grad): forward only.
Double backward is not supported.

GRPO: fused_linear_grpo_loss / FusedLinearGRPOLoss / FusedLinearGRPOLossFunction compute TRL's
GRPOTrainer._compute_loss at huggingface/trl f2cd5771 (every loss_type, luspo and vespo included, token or sequence
importance sampling, KL and its bias correction, the entropy bonus, top_entropy_quantile, the off-policy mask, the
vLLM importance-sampling correction from sampling_per_token_logps) from hidden [B, T, H]; returns (loss, metrics
with TRL's keys). With grad enabled the forward calls
fh_grpo_forward_backward (upstream 1) and backward scales the saved gradients, as for 'mean'/'sum' above.

Preference: fused_linear_preference_loss / FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss,
FusedLinearCPOLoss / FusedLinearPreferenceLossFunction compute TRL's DPO, ORPO, SimPO and CPO losses from the
hidden states of 2B sequences, the chosen ones then the rejected ones (Liger's layout); they return (loss,
metrics with TRL's keys, sequence log-probs, rewards). Gradients as for GRPO (fh_preference_forward_backward).

KTO: fused_linear_kto_loss / FusedLinearKTOLoss / FusedLinearKTOLossFunction compute TRL's KTO loss (KTOTrainer,
loss types "kto" and "apo_zero_unpaired") from the hidden states of B sequences, each desirable or undesirable;
they return (loss, metrics with TRL's keys, sequence log-probs, rewards). Gradients as for GRPO
(fh_kto_forward_backward).

Distillation: fused_linear_distillation_loss / FusedLinearDistillationLoss, FusedLinearJSDLoss (Liger's
LigerFusedLinearJSD) / FusedLinearDistillationLossFunction compute forward KL, reverse KL or the generalized JSD
(TRL's GKD generalized_jsd_loss) between a student head and a teacher head over the same vocabulary, plus a
weighted hard-label cross-entropy, from both heads' hidden states and weights (the teacher's hidden size, layout
and dtype may differ). The teacher is detached: it never gets a gradient. 'mean'/'sum': gradients as for GRPO
(fh_distill_forward_backward, upstream 1, scaled in backward). 'none': the forward runs fh_distill_forward and
backward fh_distill_forward_backward with the per-token upstream gradient (the logits computed twice).
fused_linear_distillation_topk_loss / FusedLinearDistillationTopkLossFunction: the same towards a teacher given per
token as its top-k ids and log-probs (a vLLM server's answer; TRL's server distillation), no teacher head.

Log-probs: fused_linear_logprobs / FusedLinearLogprobsFunction give per-token log p(target) (and the entropy and
log-sum-exp) of softmax(softcap(logit_scale (x W + b)) / temperature), differentiable, so that any loss on [N]
vectors (a GRPO variant, a preference loss) backpropagates into hidden, weight and bias without [N, V] logits: the
forward runs fh_logprob_forward (saving lse and the entropy), backward fh_logprob_backward with the upstream
gradients of the outputs used (8 N H V flops in all). Outputs are float32 whatever the inputs' dtype.
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ._core import (GRPO_METRIC_KEYS, PREFERENCE_METRIC_KEYS, CEProblem, Context, DistillProblem, DistillTopkProblem,
                    GRPOProblem, KTO_METRIC_KEYS, KTOProblem, LogprobProblem, distill_topk_options, kto_metrics_dict,
                    kto_options,
                    LinearHead, PreferenceProblem, View, default_context, distill_options, grpo_metrics_dict,
                    grpo_option_dict, grpo_options, matrix_view_ok, prefixed_errors,
                    pairs_shape, parse_layout, parse_reduction,
                    preference_metrics_dict, preference_options, rows_view_ok, vector_view_ok)
from ._lib import Dtype, Reduction

__all__ = ["FusedLinearCrossEntropyFunction", "FusedLinearCrossEntropy", "fused_linear_cross_entropy",
           "CrossEntropyOutput", "causal_lm_loss",
           "FusedLinearGRPOLossFunction", "FusedLinearGRPOLoss", "fused_linear_grpo_loss",
           "FusedLinearPreferenceLossFunction", "fused_linear_preference_loss", "PreferenceLossOutput",
           "FusedLinearDPOLoss", "FusedLinearORPOLoss", "FusedLinearSimPOLoss", "FusedLinearCPOLoss",
           "FusedLinearDistillationLossFunction", "fused_linear_distillation_loss", "FusedLinearDistillationLoss",
           "FusedLinearJSDLoss", "FusedLinearLogprobsFunction", "fused_linear_logprobs",
           "FusedLinearKTOLossFunction", "fused_linear_kto_loss", "FusedLinearKTOLoss", "KTOLossOutput",
           "FusedLinearDistillationTopkLossFunction", "fused_linear_distillation_topk_loss"]


# ---------------------------------------------------------------------------------------------------------
# Shared tensor helpers (every loss)
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
    """Everything one cross-entropy call needs, checked and in library form. The losses come back in the inputs'
    dtype, or in float32 with float32_loss (as Hugging Face's loss, which upcasts the logits)."""

    def __init__(self, hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing,
                 softcap, z_loss, layout, logit_scale=None, token_scaling=False, float32_loss=False):
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        _check_tensor(targets, "targets", torch.int64, " (use .long())")
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = _token_vector(targets, "targets", self.token_shape, self.lin.n, "hidden's leading dimensions")
        if class_weights is not None:
            class_weights = _contiguous_vector(_fp32_operand(class_weights, "class_weights", self.lin.dtype).detach())
        self.class_weights = class_weights
        self.reduction = parse_reduction(reduction)
        self.ignore_index, self.z_loss, self.token_scaling = int(ignore_index), float(z_loss), bool(token_scaling)
        self.loss_dtype = torch.float32 if float32_loss else self.lin.dtype
        # N = 0: a placeholder of the 1-row head's size, for the shape checks only (the library is not called)
        targets_view = _view(self.targets) if self.lin.n > 0 else View(0, (1,), (1,))
        self.problem = CEProblem(self.lin.head, targets_view, ignore_index=ignore_index, reduction=self.reduction,
                                 label_smoothing=label_smoothing, class_weights=_opt_view(class_weights),
                                 softcap=softcap, z_loss=z_loss, logit_scale=logit_scale, token_scaling=token_scaling)

    @property
    def n(self) -> int:
        return self.lin.n

    def per_token_z(self, lse: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """z_loss * lse^2 per token (0 where ignored), times DFT's p_y = exp(logp) with token_scaling, from the
        forward's fp32 lse and log-probs."""
        zl = self.z_loss * lse * lse * (torch.exp(logp) if self.token_scaling else 1.0)
        return torch.where(self.targets != self.ignore_index, zl,
                           torch.zeros((), dtype=lse.dtype)).view(self.token_shape).to(self.loss_dtype)


class _Extras:
    """The optional outputs a call fills when asked for: the entropy (float32, the targets' shape, 0 where ignored) and
    the correct count (an int64 scalar); None where not asked for. No gradient flows through them."""

    def __init__(self, entropy: bool, correct: bool):
        self.want_entropy, self.want_correct = entropy, correct
        self.entropy: Optional[torch.Tensor] = None
        self.correct: Optional[torch.Tensor] = None

    def outputs(self, ce: _CE) -> dict:
        """Fresh (zeroed) tensors for ce's tokens; their addresses by the library's output names."""
        self.entropy = torch.zeros(ce.token_shape, dtype=torch.float32) if self.want_entropy else None
        self.correct = torch.zeros((), dtype=torch.int64) if self.want_correct else None
        return {name: t.data_ptr() for name, t in (("entropy", self.entropy), ("correct", self.correct))
                if t is not None}


def _extra_outputs(ce: _CE, extras: Optional[_Extras]) -> dict:
    return extras.outputs(ce) if extras is not None else {}


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


def _autograd_needed(*inputs) -> bool:
    """Whether a gradient can be asked for; otherwise the forward runs alone, outside autograd."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def _train_step(problem, lin: _TorchLinear, context: Optional[Context], need: Sequence[bool], **outputs):
    """(the problem's result, (dx, dw, db)): its forward_backward with upstream gradient 1 into new buffers for the
    inputs in need, or its forward alone when none is; the result is None for N = 0 (no call, zero gradients).
    outputs: the library's output addresses by name."""
    grads = lin.alloc_grads(*need)
    if lin.n == 0:
        return None, grads
    ctx = context or default_context()
    if any(need):
        one = torch.ones(1, dtype=torch.float32)
        return problem.forward_backward(ctx, one.data_ptr(), lin.grads_struct(*grads), **outputs), grads
    return problem.forward(ctx, **outputs), grads


def _metrics_tensor(metrics, keys) -> torch.Tensor:
    """A metrics struct as float64 in its field order (autograd.Function outputs are tensors); None: all NaN."""
    return torch.tensor([float("nan") if metrics is None else getattr(metrics, f) for f, _ in keys],
                        dtype=torch.float64)


def _forward_reduced(ce: _CE, context: Optional[Context], need: Sequence[bool], extras: Optional[_Extras] = None):
    """'mean'/'sum': (loss, z_loss, (dx, dw, db)); gradients of loss (upstream 1) for the inputs in need; extras
    filled."""
    result, grads = _train_step(ce.problem, ce.lin, context, need, **_extra_outputs(ce, extras))
    loss, z = result if result is not None else (0.0, 0.0)
    return _scalar(loss, ce.loss_dtype), _scalar(z, ce.loss_dtype), grads


def _forward_none(ce: _CE, context: Optional[Context], extras: Optional[_Extras] = None):
    """'none': (per-token loss, per-token z-loss, lse [N]); extras filled."""
    per_token, lse, logp = (torch.zeros(ce.n, dtype=torch.float32) for _ in range(3))
    outputs = _extra_outputs(ce, extras)
    if ce.n > 0:
        ce.problem.forward(context or default_context(), per_token_loss=per_token.data_ptr(), lse=lse.data_ptr(),
                           per_token_logp=logp.data_ptr(), **outputs)
    return per_token.view(ce.token_shape).to(ce.loss_dtype), ce.per_token_z(lse, logp), lse


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """apply(hidden, weight, targets, bias=None, class_weights=None, ignore_index=-100, reduction="mean",
    label_smoothing=0.0, softcap=0.0, z_loss=0.0, layout="vh", context=None, logit_scale=None, token_scaling=False,
    extras=None, float32_loss=False) -> (loss, z_loss)

    z_loss is the z-loss part of loss (reduced like it; per token for 'none'); it is not differentiable
    (its gradient flows through loss). extras: the entropy and correct-count outputs to fill (fused_linear_cross_entropy
    makes them); float32_loss: the losses in float32 whatever the inputs' dtype (causal_lm_loss). Positional arguments
    only (torch.autograd.Function.apply). Gradients are computed for the inputs whose ctx.needs_input_grad is set,
    which torch fills from requires_grad even under torch.no_grad(): prefer fused_linear_cross_entropy, which runs the
    forward alone when no gradient can be needed."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias=None, class_weights=None, ignore_index=-100, reduction="mean",
                label_smoothing=0.0, softcap=0.0, z_loss=0.0, layout="vh", context=None, logit_scale=None,
                token_scaling=False, extras=None, float32_loss=False):
        ce = _CE(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing, softcap,
                 z_loss, layout, logit_scale, token_scaling, float32_loss)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        ctx.reduction = ce.reduction
        ctx.fh_context = context
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        if ce.reduction != Reduction.NONE:
            loss, z, (dx, dw, db) = _forward_reduced(ce, context, need, extras)
            ctx.save_for_backward(ce.lin.hidden_grad(dx), dw, db)
        else:
            loss, z, lse = _forward_none(ce, context, extras)
            # What the library saw (views of the inputs, or the copies made for it), for fh_ce_backward.
            ctx.save_for_backward(ce.lin.x, ce.lin.weight, ce.targets, ce.lin.bias, ce.class_weights, lse)
            ctx.need = need
            ctx.options = (ignore_index, label_smoothing, softcap, z_loss, layout, logit_scale, token_scaling)
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
            ignore_index, label_smoothing, softcap, z_loss, layout, logit_scale, token_scaling = ctx.options
            ce = _CE(x, weight, targets, bias, class_weights, ignore_index, Reduction.NONE, label_smoothing, softcap,
                     z_loss, layout, logit_scale, token_scaling)
            ce.lin.bias_dtype = ctx.bias_dtype  # the caller's, for dbias: the saved bias is its fp32 form
            dx, dw, db = ce.lin.alloc_grads(*ctx.need)
            if ce.n > 0:
                g = _token_vector(grad_loss.to(torch.float32), "grad_output", tuple(ctx.hidden_shape[:-1]), ce.n,
                                  "per token")
                # A non-finite upstream value propagates, as with 'mean' and in torch (the library refuses it):
                # its token's dx row, and every dweight and dbias element (X^T dZ and the column sums of dZ mix
                # that row into all of them), become NaN; torch gives +-inf where dZ has one sign there.
                finite = torch.isfinite(g)
                poisoned = not bool(finite.all())
                if poisoned:
                    g = torch.where(finite, g, torch.zeros_like(g))
                ce.problem.backward(ctx.fh_context or default_context(), lse.data_ptr(), g.data_ptr(),
                                    ce.lin.grads_struct(dx, dw, db))
                if poisoned:
                    if dx is not None:
                        dx[~finite] = float("nan")
                    for t in (dw, db):
                        if t is not None:
                            t.fill_(float("nan"))
            dx = None if dx is None else dx.view(ctx.hidden_shape)
        return (dx, dw, None, db) + (None,) * 12


class CrossEntropyOutput(NamedTuple):
    """fused_linear_cross_entropy's result with return_entropy or return_correct: the loss, the z-loss part of it
    (detached), the per-token entropy of the softmax (float32, the targets' shape, 0 where ignored; None unless
    asked for) and the correct count (an int64 scalar: tokens, ignored ones aside, whose argmax is their target;
    None unless asked for). Neither has a gradient."""
    loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: Optional[torch.Tensor]
    correct: Optional[torch.Tensor]


def _cross_entropy(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing, softcap,
                   z_loss, layout, context, logit_scale, token_scaling, extras, float32_loss=False):
    """(loss, z_loss) through the autograd Function when a gradient can be needed, else the forward alone."""
    parse_reduction(reduction)
    if _autograd_needed(class_weights):
        raise ValueError("class_weights: gradients with respect to class weights are not supported "
                         "(torch's cross_entropy does not implement them either); pass class_weights.detach()")
    if _autograd_needed(hidden, weight, bias):
        return FusedLinearCrossEntropyFunction.apply(hidden, weight, targets, bias, class_weights, ignore_index,
                                                     reduction, label_smoothing, softcap, z_loss, layout, context,
                                                     logit_scale, token_scaling, extras, float32_loss)
    ce = _CE(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing, softcap, z_loss,
             layout, logit_scale, token_scaling, float32_loss)
    if ce.reduction != Reduction.NONE:
        loss, z, _ = _forward_reduced(ce, context, (False, False, False), extras)
    else:
        loss, z, _ = _forward_none(ce, context, extras)
    return loss, z


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               class_weights: Optional[torch.Tensor] = None, softcap: float = 0.0,
                               z_loss: float = 0.0, *, logit_scale: Optional[float] = None,
                               token_scaling: bool = False, weight_classes: Optional[torch.Tensor] = None,
                               layout: str = "vh", return_z_loss: bool = False, return_entropy: bool = False,
                               return_correct: bool = False, context: Optional[Context] = None):
    """F.cross_entropy(F.linear(hidden, weight, bias), targets, weight=class_weights, ...) without the logits.

    class_weights is torch's `weight=` (alias: weight_classes). logit_scale multiplies the logits before the softcap
    (Cohere's logit_scale, Granite's 1 / logits_scaling); token_scaling=True is DFT (Liger's use_token_scaling, TRL's
    SFT loss_type "dft"): each token's loss, its label-smoothing and z-loss terms included, times its target's
    probability, detached. Returns the loss (a scalar, or the targets' shape for 'none'), or (loss, z_loss) with
    return_z_loss=True (z_loss: the z-loss part, detached), or a CrossEntropyOutput (loss, z_loss, entropy, correct)
    with return_entropy or return_correct.
    """
    if weight_classes is not None:
        if class_weights is not None:
            raise ValueError("pass class_weights or weight_classes, not both")
        class_weights = weight_classes
    extras = _Extras(return_entropy, return_correct) if return_entropy or return_correct else None
    loss, z = _cross_entropy(hidden, weight, targets, bias, class_weights, ignore_index, reduction, label_smoothing,
                             softcap, z_loss, layout, context, logit_scale, token_scaling, extras)
    if extras is not None:
        return CrossEntropyOutput(loss, z, extras.entropy, extras.correct)
    return (loss, z) if return_z_loss else loss


# ---------------------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------------------
class _Logprobs:
    """Everything one log-prob call needs, checked and in library form."""

    def __init__(self, hidden, weight, targets, bias, ignore_index, temperature, softcap, logit_scale, layout):
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        _check_tensor(targets, "targets", torch.int64, " (use .long())")
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = _token_vector(targets, "targets", self.token_shape, self.lin.n, "hidden's leading dimensions")
        targets_view = _view(self.targets) if self.lin.n > 0 else View(0, (1,), (1,))
        self.problem = LogprobProblem(self.lin.head, targets_view, ignore_index=ignore_index,
                                      temperature=temperature, softcap=softcap, logit_scale=logit_scale)

    def vectors(self, count: int):
        return [torch.zeros(self.lin.n, dtype=torch.float32) for _ in range(count)]


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """apply(hidden, weight, targets, bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=None,
    layout="vh", context=None) -> (logp, entropy, lse), each float32 of the targets' shape. Positional arguments
    only; prefer fused_linear_logprobs."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias=None, ignore_index=-100, temperature=1.0, softcap=None,
                logit_scale=None, layout="vh", context=None):
        ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None, the library's NULL
        lp = _Logprobs(hidden, weight, targets, bias, ignore_index, temperature, softcap, logit_scale, layout)
        logp, entropy, lse = lp.vectors(3)
        if lp.lin.n > 0:
            lp.problem.forward(context or default_context(), logp=logp.data_ptr(), entropy=entropy.data_ptr(),
                               lse=lse.data_ptr())
        # What the library saw (views of the inputs, or the copies made for it), for fh_logprob_backward.
        ctx.save_for_backward(lp.lin.x, lp.lin.weight, lp.targets, lp.lin.bias, entropy, lse)
        ctx.need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        ctx.options = (ignore_index, temperature, softcap, logit_scale, layout)
        ctx.hidden_shape, ctx.bias_dtype, ctx.fh_context = lp.lin.hidden_shape, lp.lin.bias_dtype, context
        shape = lp.token_shape
        return logp.view(shape), entropy.view(shape), lse.view(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_lse):
        x, weight, targets, bias, entropy, lse = ctx.saved_tensors
        lp = _Logprobs(x, weight, targets, bias, *ctx.options)
        lp.lin.bias_dtype = ctx.bias_dtype  # the caller's, for dbias: the saved bias is its fp32 form
        dx, dw, db = lp.lin.alloc_grads(*ctx.need)
        if lp.lin.n > 0 and any(ctx.need):
            g = [None if t is None else _contiguous_vector(t.reshape(lp.lin.n).to(torch.float32))
                 for t in (grad_logp, grad_entropy, grad_lse)]
            lp.problem.backward(ctx.fh_context or default_context(), lse.data_ptr(),
                                entropy.data_ptr() if g[1] is not None else None,
                                *(None if t is None else t.data_ptr() for t in g), lp.lin.grads_struct(dx, dw, db))
        dx = None if dx is None else dx.view(ctx.hidden_shape)
        return (dx, dw, None, db) + (None,) * 6


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          return_entropy: bool = False, return_lse: bool = False, *,
                          bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                          softcap: Optional[float] = None, logit_scale: Optional[float] = None, layout: str = "vh",
                          context: Optional[Context] = None):
    """log_softmax(s).gather(-1, targets) with s = softcap(logit_scale F.linear(hidden, weight, bias)) / temperature,
    without the logits; differentiable with respect to hidden, weight and bias.

    Returns logp (float32, the targets' shape; 0 where the target is ignore_index), or a tuple (logp, entropy[,
    lse]) with return_entropy / return_lse: the entropy -sum p log p of softmax(s) and its log-sum-exp, also
    differentiable (0 and no gradient at ignored tokens). E.g. a GRPO-style loss:

        logp, entropy = fused_linear_logprobs(h, W, ids, temperature=0.9, return_entropy=True)
        ratio = torch.exp(logp - old_logp)
        loss = -(torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
        loss.backward()

    A non-finite upstream gradient raises InvalidGradOutputError (the library refuses it) instead of propagating.
    """
    if _autograd_needed(hidden, weight, bias):
        logp, entropy, lse = FusedLinearLogprobsFunction.apply(hidden, weight, targets, bias, ignore_index,
                                                               temperature, softcap, logit_scale, layout, context)
    else:
        lp = _Logprobs(hidden, weight, targets, bias, ignore_index, temperature, softcap, logit_scale, layout)
        logp, entropy, lse = lp.vectors(3)
        if lp.lin.n > 0:
            lp.problem.forward(context or default_context(), logp=logp.data_ptr(),
                               entropy=entropy.data_ptr() if return_entropy else None, lse=lse.data_ptr())
        logp, entropy, lse = (t.view(lp.token_shape) for t in (logp, entropy, lse))
    if not (return_entropy or return_lse):
        return logp
    return (logp, entropy, lse) if return_entropy and return_lse else (logp, entropy) if return_entropy else (logp, lse)


def causal_lm_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: Optional[torch.Tensor],
                   num_items_in_batch=None, ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                   final_logit_softcapping: Optional[float] = None, logit_scale: Optional[float] = None,
                   bias: Optional[torch.Tensor] = None, *, context: Optional[Context] = None) -> torch.Tensor:
    """Hugging Face transformers' causal-LM loss without the logits: ForCausalLMLoss and fixed_cross_entropy of
    src/transformers/loss/loss_utils.py (commit 0114da07ec0e101b420a923dedeb6032b6ac3a44) on
    logits = F.linear(hidden_states, lm_head_weight, bias), times logit_scale (Cohere) and softcapped by
    final_logit_softcapping (Gemma 2) as the models do before calling it.

    hidden_states [B, T, H] (or [..., H]) is viewed as [B*T, H], never copied or shifted; the shift is on the labels:
    labels [B, T] padded on the right with ignore_index and shifted by one (F.pad(labels, (0, 1),
    value=ignore_index)[..., 1:]), unless shift_labels (the labels' shape, already shifted) is given, when labels is
    not read (it may be None). Reduction "sum" divided by num_items_in_batch when it is given (a tensor or an int, as
    the Trainer passes it for gradient accumulation), else "mean" over the tokens that are not ignore_index. The
    loss is float32 whatever the inputs' dtype (the function upcasts the logits); bf16 hidden states and weight are
    read as they are, their gradients come back in bf16. One difference: when every token is ignored, "mean" gives 0
    (Hugging Face, through torch, gives NaN).
    """
    if shift_labels is None:
        if labels is None:
            raise TypeError("causal_lm_loss: labels is None and no shift_labels was given")
        _check_tensor(labels, "labels", torch.int64, " (use .long())")
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss, _ = _cross_entropy(hidden_states, lm_head_weight, shift_labels, bias, None, ignore_index, reduction, 0.0,
                             0.0 if final_logit_softcapping is None else final_logit_softcapping, 0.0, "vh", context,
                             logit_scale, False, None, float32_loss=True)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class FusedLinearCrossEntropy(torch.nn.Module):
    """nn.Module form (options fixed at construction; the lm_head weight is a forward argument, as in Liger's
    LigerFusedLinearCrossEntropyLoss):

        loss_fn = FusedLinearCrossEntropy(ignore_index=-100, label_smoothing=0.1)
        loss = loss_fn(hidden, model.lm_head.weight, targets)             # bias=model.lm_head.bias if any
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 class_weights: Optional[torch.Tensor] = None, softcap: float = 0.0, z_loss: float = 0.0,
                 layout: str = "vh", return_z_loss: bool = False, context: Optional[Context] = None, *,
                 logit_scale: Optional[float] = None, token_scaling: bool = False, return_entropy: bool = False,
                 return_correct: bool = False):
        super().__init__()
        parse_reduction(reduction)
        parse_layout(layout)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.z_loss, self.layout, self.return_z_loss = softcap, z_loss, layout, return_z_loss
        self.logit_scale, self.token_scaling = logit_scale, token_scaling
        self.return_entropy, self.return_correct = return_entropy, return_correct
        self.context = context
        self.register_buffer("class_weights", class_weights)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor] = None):
        return fused_linear_cross_entropy(hidden, weight, targets, bias, self.ignore_index, self.reduction,
                                          self.label_smoothing, self.class_weights, self.softcap, self.z_loss,
                                          logit_scale=self.logit_scale, token_scaling=self.token_scaling,
                                          layout=self.layout, return_z_loss=self.return_z_loss,
                                          return_entropy=self.return_entropy, return_correct=self.return_correct,
                                          context=self.context)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, z_loss={self.z_loss}, "
                f"logit_scale={self.logit_scale}, token_scaling={self.token_scaling}, layout={self.layout!r}, "
                f"return_z_loss={self.return_z_loss}, return_entropy={self.return_entropy}, "
                f"return_correct={self.return_correct}")


# ---------------------------------------------------------------------------------------------------------
# GRPO (TRL GRPOTrainer._compute_loss semantics)
# ---------------------------------------------------------------------------------------------------------
def _bt_tensor(t, name: str, dtype: torch.dtype, bt: Tuple[int, int], n: int, hint: str = "",
               dims: str = "[B, T]", source: str = "hidden's leading dimensions") -> torch.Tensor:
    """A token tensor of the batch's shape bt, as a contiguous [n] vector (detached)."""
    _check_tensor(t, name, dtype, hint)
    if tuple(t.shape) != bt:
        raise ValueError(f"{name}: expected shape {dims} = {list(bt)} ({source}), got {list(t.shape)}")
    return _contiguous_vector(t.detach().reshape(n))


def _mask_tensor(mask, name: str, bt: Tuple[int, int], n: int, **dims) -> torch.Tensor:
    """A [B, T] mask of any real dtype (bool, integer, floating), as the float32 vector the library takes."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name}: expected a real (bool, integer or floating) tensor, got {mask.dtype}")
    return _bt_tensor(mask.to(torch.float32), name, torch.float32, bt, n, **dims)


def _fp32_vector(t, name: str, dtype: torch.dtype, length: int, dims: str) -> torch.Tensor:
    """A per-sequence float32 operand (bfloat16 too with bfloat16 inputs) of `length` values, contiguous, detached."""
    t = _fp32_operand(t, name, dtype)
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name}: expected shape {dims} = [{length}], got {list(t.shape)}")
    return _contiguous_vector(t.detach())


class _GRPO:
    """Everything one GRPO call needs, checked and in library form. hidden [B, T, H]; completion_ids int64
    [B, T]; completion_mask [B, T] (bool, integer or floating: converted to float32); advantages float32 [B];
    old / ref / sampling per-token log-probs float32 [B, T] or None (advantages and the log-probs may be bfloat16
    with bfloat16 inputs: converted). options: TRL-named (grpo_option_dict)."""

    def __init__(self, hidden, weight, completion_ids, completion_mask, advantages, bias, old, ref, options: dict,
                 layout, sampling=None):
        dtype = _check_inputs(hidden, weight)
        if hidden.dim() != 3:
            raise ValueError(f"hidden: expected [B, T, H] (the hidden states of the completion tokens), got shape "
                             f"{list(hidden.shape)}")
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        b, t = int(hidden.shape[0]), int(hidden.shape[1])
        self.bt, n = (b, t), b * t
        self.completion_ids = _bt_tensor(completion_ids, "completion_ids", torch.int64, self.bt, n, " (use .long())")
        self.completion_mask = _mask_tensor(completion_mask, "completion_mask", self.bt, n)
        self.advantages = _fp32_vector(advantages, "advantages", dtype, b, "[B]")
        logps = lambda v, name: None if v is None else _bt_tensor(  # noqa: E731
            _fp32_operand(v, name, dtype), name, torch.float32, self.bt, n)
        self.old = logps(old, "old_per_token_logps")
        self.ref = logps(ref, "ref_per_token_logps")
        self.sampling = logps(sampling, "sampling_per_token_logps")
        self.options = grpo_options(**options)
        self.problem = None
        if n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = GRPOProblem(self.lin.head, b, t, _view(self.completion_ids), _view(self.completion_mask),
                                       _view(self.advantages), _opt_view(self.old), _opt_view(self.ref),
                                       self.options, _opt_view(self.sampling))

    @property
    def n(self) -> int:
        return self.lin.n


def _grpo_run(g: _GRPO, context: Optional[Context], need: Sequence[bool]):
    """(loss, metrics float64 [16] in fh_grpo_metrics order, per-token logp [B, T], (dx, dw, db)); gradients of
    the loss (upstream 1) for the inputs in need."""
    logp = torch.zeros(g.n, dtype=torch.float32)
    result, grads = _train_step(g.problem, g.lin, context, need, per_token_logp=logp.data_ptr())
    loss, m = result if result is not None else (0.0, None)
    return _scalar(loss, g.lin.dtype), _metrics_tensor(m, GRPO_METRIC_KEYS), logp.view(g.bt), grads


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    """apply(hidden, weight, completion_ids, completion_mask, advantages, bias=None, old_per_token_logps=None,
    ref_per_token_logps=None, options=None, layout="vh", context=None, sampling_per_token_logps=None)
    -> (loss, metrics, per_token_logps)

    options: a dict of GRPO options by TRL name (fusedhead._core.GRPO_OPTION_NAMES; missing: TRL's defaults,
    GRPO_OPTION_DEFAULTS). metrics: float64 [16] in fh_grpo_metrics order (GRPO_METRIC_KEYS; NaN where TRL logs
    nothing); per_token_logps: float32 [B, T] under the current policy (0 at out-of-range ids of masked padding).
    Both non-differentiable. sampling_per_token_logps (the sampler's log-probs, TRL's input of that name) comes
    last, as the field it fills does in fh_grpo_batch. The forward runs fh_grpo_forward_backward with upstream
    gradient 1 for the inputs whose ctx.needs_input_grad is set; backward scales the saved gradients by the
    incoming scalar. advantages and the old / reference / sampling log-probs are constants (as in TRL): they get
    no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, completion_ids, completion_mask, advantages, bias=None, old_per_token_logps=None,
                ref_per_token_logps=None, options=None, layout="vh", context=None, sampling_per_token_logps=None):
        g = _GRPO(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                  ref_per_token_logps, grpo_option_dict(**dict(options or {})), layout, sampling_per_token_logps)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[5])
        loss, metrics, logp, (dx, dw, db) = _grpo_run(g, context, need)
        ctx.save_for_backward(g.lin.hidden_grad(dx), dw, db)
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        ctx.mark_non_differentiable(metrics, logp)
        return loss, metrics, logp

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics, _grad_logp):
        dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        return (dx, dw, None, None, None, db) + (None,) * 6


def fused_linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor, advantages: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, old_per_token_logps: Optional[torch.Tensor] = None,
                           ref_per_token_logps: Optional[torch.Tensor] = None,
                           sampling_per_token_logps: Optional[torch.Tensor] = None, *, loss_type: str = "dapo",
                           importance_sampling_level: str = "token", temperature: float = 1.0,
                           epsilon_low: Optional[float] = None, epsilon: Optional[float] = None,
                           epsilon_high: Optional[float] = None, delta: Optional[float] = None, beta: float = 0.0,
                           sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                           num_items_in_batch=None, max_completion_length: Optional[int] = None,
                           entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0,
                           off_policy_mask_threshold: Optional[float] = None, use_bias_correction_kl: bool = False,
                           vllm_importance_sampling_correction: bool = True,
                           vllm_importance_sampling_mode: str = "sequence_mask",
                           vllm_importance_sampling_clip_min: Optional[float] = None,
                           vllm_importance_sampling_clip_max: Optional[float] = 3.0,
                           vllm_importance_sampling_cap: Optional[float] = None, vespo_k_pos: float = 2.0,
                           vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                           layout: str = "vh", return_per_token_logps: bool = False,
                           context: Optional[Context] = None):
    """TRL GRPOTrainer._compute_loss (huggingface/trl f2cd5771) from hidden [B, T, H] (position t predicts
    completion_ids[b, t]) and the lm_head weight, without the [B*T, V] logits.

    Options use TRL's GRPOConfig names and defaults (include/fusedhead.h has the formulas):
      loss_type "dapo" (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo); importance_sampling_level "token"
      or "sequence" (GSPO); temperature; epsilon (alias epsilon_low, 0.2) and epsilon_high (None: = epsilon_low;
      cispo's absolute cap); delta (None: off); beta (KL, ref_per_token_logps required when != 0);
      sapo_temperature_pos/neg; num_items_in_batch (dapo, cispo and vespo's normaliser, an int, float or tensor;
      None: the mask's sum); max_completion_length (dr_grpo; None: T); entropy_coef (the entropy bonus,
      normalised per loss type as TRL does); top_entropy_quantile (< 1: only the tokens whose entropy is in that
      top quantile of the batch carry the policy term); off_policy_mask_threshold (None: off);
      use_bias_correction_kl; vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg.
      vLLM importance sampling (TRL's use_vllm is "sampling_per_token_logps was given"):
      vllm_importance_sampling_correction (True), vllm_importance_sampling_mode ("sequence_mask";
      "token_truncate", "token_mask", "sequence_truncate"), vllm_importance_sampling_clip_min (None) and
      vllm_importance_sampling_clip_max (3.0) (None: no bound); vllm_importance_sampling_cap is TRL's deprecated
      alias of clip_max (FutureWarning).
    Inputs: old_per_token_logps None: on-policy (old = logp detached); sampling_per_token_logps: the sampler's
    per-token log-probs [B, T] or None (then no importance-sampling correction, and the off-policy mask compares
    with old).
    Returns (loss, metrics) where metrics has TRL's keys, only those TRL logs for these options: "kl", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss" and "entropy_coef" (with an
    entropy bonus), "sampling/sampling_logp_difference/mean" and "/max", "sampling/importance_sampling_ratio/min",
    "/mean" and "/max" (with the importance-sampling correction); or (loss, metrics, per_token_logps) with
    return_per_token_logps=True (detached float32 [B, T]).
    """
    options = grpo_option_dict(
        loss_type=loss_type, importance_sampling_level=importance_sampling_level, temperature=temperature,
        epsilon_low=epsilon_low, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, beta=beta,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        num_items_in_batch=num_items_in_batch, max_completion_length=max_completion_length,
        entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold, use_bias_correction_kl=use_bias_correction_kl,
        vllm_importance_sampling_correction=vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=vllm_importance_sampling_clip_max,
        vllm_importance_sampling_cap=vllm_importance_sampling_cap, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
    return _grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                      ref_per_token_logps, sampling_per_token_logps, options, layout, return_per_token_logps, context)


def _grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias, old, ref, sampling, options: dict,
               layout, return_per_token_logps, context):
    if _autograd_needed(hidden, weight, bias):
        loss, metrics, logp = FusedLinearGRPOLossFunction.apply(hidden, weight, completion_ids, completion_mask,
                                                                advantages, bias, old, ref, options, layout, context,
                                                                sampling)
    else:
        g = _GRPO(hidden, weight, completion_ids, completion_mask, advantages, bias, old, ref, options, layout,
                  sampling)
        loss, metrics, logp, _ = _grpo_run(g, context, (False, False, False))
    metrics = grpo_metrics_dict(metrics.tolist())
    return (loss, metrics, logp) if return_per_token_logps else (loss, metrics)


class FusedLinearGRPOLoss(torch.nn.Module):
    """nn.Module form (options fixed at construction, TRL GRPOConfig names and defaults as
    fused_linear_grpo_loss's; num_items_in_batch may also be given per call, as TRL does):

        loss_fn = FusedLinearGRPOLoss(loss_type="dapo", beta=0.04, temperature=0.7)
        loss, metrics = loss_fn(hidden, model.lm_head.weight, completion_ids, completion_mask, advantages,
                                old_per_token_logps=old, ref_per_token_logps=ref,
                                sampling_per_token_logps=vllm_logps, num_items_in_batch=num_items)
    """

    def __init__(self, loss_type: str = "dapo", importance_sampling_level: str = "token", temperature: float = 1.0,
                 epsilon_low: Optional[float] = None, epsilon: Optional[float] = None,
                 epsilon_high: Optional[float] = None, delta: Optional[float] = None, beta: float = 0.0,
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                 num_items_in_batch=None, max_completion_length: Optional[int] = None, entropy_coef: float = 0.0,
                 layout: str = "vh", return_per_token_logps: bool = False, context: Optional[Context] = None, *,
                 top_entropy_quantile: float = 1.0, off_policy_mask_threshold: Optional[float] = None,
                 use_bias_correction_kl: bool = False, vllm_importance_sampling_correction: bool = True,
                 vllm_importance_sampling_mode: str = "sequence_mask",
                 vllm_importance_sampling_clip_min: Optional[float] = None,
                 vllm_importance_sampling_clip_max: Optional[float] = 3.0,
                 vllm_importance_sampling_cap: Optional[float] = None, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        parse_layout(layout)
        self.options = grpo_option_dict(
            loss_type=loss_type, importance_sampling_level=importance_sampling_level, temperature=temperature,
            epsilon_low=epsilon_low, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, beta=beta,
            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
            num_items_in_batch=num_items_in_batch, max_completion_length=max_completion_length,
            entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile,
            off_policy_mask_threshold=off_policy_mask_threshold, use_bias_correction_kl=use_bias_correction_kl,
            vllm_importance_sampling_correction=vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=vllm_importance_sampling_mode,
            vllm_importance_sampling_clip_min=vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=vllm_importance_sampling_clip_max,
            vllm_importance_sampling_cap=vllm_importance_sampling_cap, vespo_k_pos=vespo_k_pos,
            vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
        self.layout, self.return_per_token_logps, self.context = layout, return_per_token_logps, context

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, advantages: torch.Tensor, bias: Optional[torch.Tensor] = None,
                old_per_token_logps: Optional[torch.Tensor] = None,
                ref_per_token_logps: Optional[torch.Tensor] = None, num_items_in_batch=None,
                sampling_per_token_logps: Optional[torch.Tensor] = None):
        opts = dict(self.options)
        if num_items_in_batch is not None:
            opts = grpo_option_dict(**dict(opts, num_items_in_batch=num_items_in_batch))
        return _grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                          ref_per_token_logps, sampling_per_token_logps, opts, self.layout,
                          self.return_per_token_logps, self.context)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"


# ---------------------------------------------------------------------------------------------------------
# Preference heads: DPO, ORPO, SimPO, CPO (TRL DPOTrainer, ORPOTrainer, CPOTrainer semantics)
# ---------------------------------------------------------------------------------------------------------
class _Preference:
    """Everything one preference call needs, checked and in library form. targets int64 [2B, T], the chosen
    sequences then the rejected ones; hidden [2B, T, H] or [2B*T, H]; mask [2B, T] (bool, integer or floating:
    converted to float32); dpo's reference log-probs ref_logps [2B] or ref_per_token_logps [2B, T], float32
    (bfloat16 too with bfloat16 inputs: converted)."""

    def __init__(self, hidden, weight, targets, mask, bias, ref_logps, ref_per_token_logps, options: dict, layout):
        dtype = _check_inputs(hidden, weight)
        _check_tensor(targets, "targets", torch.int64, " (use .long())")
        rows, t = pairs_shape(tuple(targets.shape))
        if tuple(hidden.shape[:-1]) not in ((rows, t), (rows * t,)):
            raise ValueError(f"hidden: expected [2B, T, H] = [{rows}, {t}, H] or [2B*T, H] = [{rows * t}, H] "
                             f"(targets are [2B, T] = {[rows, t]}), got shape {list(hidden.shape)}")
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        self.pairs, self.bt = rows // 2, (rows, t)
        n, dims = rows * t, dict(dims="[2B, T]", source="the targets' shape")
        self.targets = _bt_tensor(targets, "targets", torch.int64, self.bt, n, **dims)
        self.mask = _mask_tensor(mask, "mask", self.bt, n, **dims)
        self.ref_logps = None if ref_logps is None else _fp32_vector(ref_logps, "ref_logps", dtype, rows, "[2B]")
        self.ref_per_token_logps = None if ref_per_token_logps is None else _bt_tensor(
            _fp32_operand(ref_per_token_logps, "ref_per_token_logps", dtype), "ref_per_token_logps", torch.float32,
            self.bt, n, **dims)
        self.problem = PreferenceProblem(self.lin.head, self.pairs, t, _view(self.targets), _view(self.mask),
                                         _opt_view(self.ref_logps), _opt_view(self.ref_per_token_logps),
                                         preference_options(**options))


def _preference_run(p: _Preference, context: Optional[Context], need: Sequence[bool]):
    """(loss, metrics float64 [13] in fh_preference_metrics order, sequence log-probs [2B], rewards [2B],
    (dx, dw, db)); gradients of the loss (upstream 1) for the inputs in need."""
    logps = torch.empty(2 * p.pairs, dtype=torch.float32)
    rewards = torch.empty(2 * p.pairs, dtype=torch.float32)
    (loss, m), grads = _train_step(p.problem, p.lin, context, need, sequence_logps=logps.data_ptr(),
                                   rewards=rewards.data_ptr())
    return _scalar(loss, p.lin.dtype), _metrics_tensor(m, PREFERENCE_METRIC_KEYS), logps, rewards, grads


class FusedLinearPreferenceLossFunction(torch.autograd.Function):
    """apply(hidden, weight, targets, mask, bias=None, ref_logps=None, ref_per_token_logps=None, options=None,
    layout="vh", context=None) -> (loss, metrics, logps, rewards)

    options: a dict of preference_options values (loss and TRL's names; missing: TRL defaults). metrics: float64
    [13] in fh_preference_metrics order (NaN where TRL logs nothing); logps, rewards: float32 [2B], the chosen
    sequences' then the rejected ones'. All three non-differentiable. The forward runs
    fh_preference_forward_backward with upstream gradient 1 for the inputs whose ctx.needs_input_grad is set;
    backward scales the saved gradients by the incoming scalar. The reference log-probs are constants (as in
    TRL): they get no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, bias=None, ref_logps=None, ref_per_token_logps=None,
                options=None, layout="vh", context=None):
        p = _Preference(hidden, weight, targets, mask, bias, ref_logps, ref_per_token_logps, dict(options or {}),
                        layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[4])
        loss, metrics, logps, rewards, (dx, dw, db) = _preference_run(p, context, need)
        ctx.save_for_backward(p.lin.hidden_grad(dx), dw, db)
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        ctx.mark_non_differentiable(metrics, logps, rewards)
        return loss, metrics, logps, rewards

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics, _grad_logps, _grad_rewards):
        dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        return (dx, dw, None, None, db) + (None,) * 5


class PreferenceLossOutput(NamedTuple):
    """loss: a scalar in the inputs' dtype, differentiable; metrics: TRL's logged keys -> floats, only those TRL
    logs for the options; logps, rewards: float32 [2B] (chosen sequences, then rejected), detached: the sequence
    log-probs l and TRL's rewards."""
    loss: torch.Tensor
    metrics: dict
    logps: torch.Tensor
    rewards: torch.Tensor


def fused_linear_preference_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 mask: torch.Tensor, *, loss: str = "dpo", loss_type: str = "sigmoid",
                                 beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                                 rpo_alpha: Optional[float] = 0.0, cpo_alpha: float = 1.0,
                                 loss_weights: Optional[Sequence[float]] = None, dpo_semantics: str = "current",
                                 discopop_tau: float = 0.05, use_weighting: bool = False,
                                 ref_logps: Optional[torch.Tensor] = None,
                                 ref_per_token_logps: Optional[torch.Tensor] = None,
                                 bias: Optional[torch.Tensor] = None, layout: str = "vh",
                                 context: Optional[Context] = None) -> PreferenceLossOutput:
    """TRL's DPO (DPOTrainer), ORPO (ORPOTrainer), SimPO or CPO (CPOTrainer) loss from the hidden states of a
    batch of 2B sequences, the chosen ones then the rejected ones (pair b: sequences b and B + b, Liger's layout),
    and the lm_head weight, without the [2B*T, V] logits.

    hidden [2B, T, H] or [2B*T, H] (position t predicts targets[s, t]); targets int64 [2B, T]; mask [2B, T], the
    loss mask (TRL's labels != -100; targets where it is 0 may be anything). loss: "dpo", "orpo", "simpo", "cpo";
    options by TRL's names. dpo follows TRL's current DPOTrainer (dpo_semantics "current": loss_type a name or a
    list of them among "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", with loss_weights; discopop_tau;
    rpo_alpha must be None or 0, the "sft" type replaces it; use_weighting is refused) or v0.28.0's ("trl_0_28":
    "sigmoid", "hinge", "ipo", "robust" and rpo_alpha); cpo and simpo take "sigmoid", "hinge", "ipo" as CPOTrainer
    does. dpo's reference log-probs: ref_logps [2B] (the reference model's sequence log-probs, aggregated as the
    loss aggregates: sums, or at v0.28 averages for ipo) or ref_per_token_logps [2B, T], at most one; neither: 0.
    include/fusedhead.h has the formulas. Returns (loss, metrics, logps, rewards), a PreferenceLossOutput: metrics
    with TRL's keys "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen",
    "entropy", "mean_token_accuracy" (those TRL logs for the options).
    """
    options = dict(loss=loss, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                   simpo_gamma=simpo_gamma, rpo_alpha=rpo_alpha, cpo_alpha=cpo_alpha, loss_weights=loss_weights,
                   dpo_semantics=dpo_semantics, discopop_tau=discopop_tau, use_weighting=use_weighting)
    if _autograd_needed(hidden, weight, bias):
        value, metrics, logps, rewards = FusedLinearPreferenceLossFunction.apply(
            hidden, weight, targets, mask, bias, ref_logps, ref_per_token_logps, options, layout, context)
    else:
        p = _Preference(hidden, weight, targets, mask, bias, ref_logps, ref_per_token_logps, options, layout)
        value, metrics, logps, rewards, _ = _preference_run(p, context, (False, False, False))
    return PreferenceLossOutput(value, preference_metrics_dict(metrics.tolist()), logps, rewards)


class _FusedLinearPreferenceLoss(torch.nn.Module):
    """The preference modules' shared body: the loss and its options (TRL's names) fixed at construction; the
    lm_head weight is a forward argument, as in the other modules. Returns fused_linear_preference_loss's
    PreferenceLossOutput."""
    _loss = ""  # "dpo", "orpo", "simpo", "cpo"

    def __init__(self, layout: str, context: Optional[Context], **options):
        super().__init__()
        parse_layout(layout)
        preference_options(loss=self._loss, **options)  # bad names and choices fail here; values in the library
        self.options, self.layout, self.context = options, layout, context

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> PreferenceLossOutput:
        return self._compute(hidden, weight, targets, mask, bias)

    def _compute(self, hidden, weight, targets, mask, bias, **references) -> PreferenceLossOutput:
        return fused_linear_preference_loss(hidden, weight, targets, mask, loss=self._loss, bias=bias,
                                            layout=self.layout, context=self.context, **self.options, **references)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"


class FusedLinearDPOLoss(_FusedLinearPreferenceLoss):
    """TRL DPOTrainer's loss (DPOConfig names):

        loss_fn = FusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
        loss, metrics, logps, rewards = loss_fn(hidden, model.lm_head.weight, targets, mask, ref_logps=ref)
    """
    _loss = "dpo"

    def __init__(self, beta: float = 0.1, loss_type="sigmoid", label_smoothing: float = 0.0,
                 rpo_alpha: Optional[float] = None, layout: str = "vh", context: Optional[Context] = None,
                 loss_weights: Optional[Sequence[float]] = None, dpo_semantics: str = "current",
                 discopop_tau: float = 0.05, use_weighting: bool = False):
        super().__init__(layout, context, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                         rpo_alpha=rpo_alpha, loss_weights=loss_weights, dpo_semantics=dpo_semantics,
                         discopop_tau=discopop_tau, use_weighting=use_weighting)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                bias: Optional[torch.Tensor] = None, ref_logps: Optional[torch.Tensor] = None,
                ref_per_token_logps: Optional[torch.Tensor] = None) -> PreferenceLossOutput:
        return self._compute(hidden, weight, targets, mask, bias, ref_logps=ref_logps,
                             ref_per_token_logps=ref_per_token_logps)


class FusedLinearORPOLoss(_FusedLinearPreferenceLoss):
    """TRL ORPOTrainer's loss (ORPOConfig's beta, the paper's lambda): NLL of the chosen sequences minus beta times
    the mean log-sigmoid of the log odds ratio."""
    _loss = "orpo"

    def __init__(self, beta: float = 0.1, layout: str = "vh", context: Optional[Context] = None):
        super().__init__(layout, context, beta=beta)


class FusedLinearSimPOLoss(_FusedLinearPreferenceLoss):
    """TRL CPOTrainer's loss_type="simpo" (CPOConfig names; cpo_alpha=0 gives the SimPO paper's loss)."""
    _loss = "simpo"

    def __init__(self, beta: float = 0.1, simpo_gamma: float = 0.5, label_smoothing: float = 0.0,
                 cpo_alpha: float = 1.0, layout: str = "vh", context: Optional[Context] = None):
        super().__init__(layout, context, beta=beta, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing,
                         cpo_alpha=cpo_alpha)


class FusedLinearCPOLoss(_FusedLinearPreferenceLoss):
    """TRL CPOTrainer's loss (CPOConfig names; loss_type "sigmoid", "hinge" or "ipo"; TRL's loss_type="simpo" is
    FusedLinearSimPOLoss)."""
    _loss = "cpo"

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 cpo_alpha: float = 1.0, layout: str = "vh", context: Optional[Context] = None):
        super().__init__(layout, context, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                         cpo_alpha=cpo_alpha)


# ---------------------------------------------------------------------------------------------------------
# KTO (TRL KTOTrainer semantics: loss types kto and apo_zero_unpaired)
# ---------------------------------------------------------------------------------------------------------
class _KTO:
    """Everything one KTO call needs, checked and in library form. targets int64 [B, T]; hidden [B, T, H] or
    [B*T, H]; mask [B, T] (bool, integer or floating: converted to float32); labels [B] (bool or integer 0 / 1:
    converted to uint8); the reference ref_logps [B] or ref_per_token_logps [B, T]; kto's KL term kl (a number or
    a one-element tensor) or kl_logratios [B]; float32 values (bfloat16 too with bfloat16 inputs: converted)."""

    def __init__(self, hidden, weight, targets, mask, labels, bias, ref_logps, ref_per_token_logps, kl, kl_logratios,
                 options: dict, layout):
        dtype = _check_inputs(hidden, weight)
        _check_tensor(targets, "targets", torch.int64, " (use .long())")
        if targets.dim() != 2 or 0 in targets.shape:
            raise ValueError(f"targets: expected [B, T] with B, T >= 1, got shape {list(targets.shape)}")
        b, t = int(targets.shape[0]), int(targets.shape[1])
        if tuple(hidden.shape[:-1]) not in ((b, t), (b * t,)):
            raise ValueError(f"hidden: expected [B, T, H] = [{b}, {t}, H] or [B*T, H] = [{b * t}, H] (targets are "
                             f"[B, T] = {[b, t]}), got shape {list(hidden.shape)}")
        self.lin = _TorchLinear(hidden, weight, bias, layout)
        self.batch, n, dims = b, b * t, dict(dims="[B, T]", source="the targets' shape")
        self.targets = _bt_tensor(targets, "targets", torch.int64, (b, t), n, **dims)
        self.mask = _mask_tensor(mask, "mask", (b, t), n, **dims)
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"labels: expected a bool or integer torch.Tensor, got "
                            f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if tuple(labels.shape) != (b,):
            raise ValueError(f"labels: expected shape [B] = [{b}], got {list(labels.shape)}")
        if labels.dtype != torch.bool and bool(((labels != 0) & (labels != 1)).any()):
            raise ValueError("labels: expected 0 (undesirable) or 1 (desirable) in every entry")
        self.labels = _contiguous_vector(labels.detach().to(torch.uint8))
        self.ref_logps = None if ref_logps is None else _fp32_vector(ref_logps, "ref_logps", dtype, b, "[B]")
        self.ref_per_token_logps = None if ref_per_token_logps is None else _bt_tensor(
            _fp32_operand(ref_per_token_logps, "ref_per_token_logps", dtype), "ref_per_token_logps", torch.float32,
            (b, t), n, **dims)
        self.kl = None if kl is None else torch.tensor([float(kl)], dtype=torch.float32)
        self.kl_logratios = None if kl_logratios is None else _fp32_vector(kl_logratios, "kl_logratios", dtype, b,
                                                                           "[B]")
        self.problem = KTOProblem(self.lin.head, b, t, _view(self.targets), _view(self.mask), _view(self.labels),
                                  _opt_view(self.ref_logps), _opt_view(self.ref_per_token_logps),
                                  _opt_view(self.kl), _opt_view(self.kl_logratios), kto_options(**options))


def _kto_run(k: _KTO, context: Optional[Context], need: Sequence[bool]):
    """(loss, metrics float64 [9] in fh_kto_metrics order, sequence log-probs [B], rewards [B], (dx, dw, db));
    gradients of the loss (upstream 1) for the inputs in need."""
    logps = torch.empty(k.batch, dtype=torch.float32)
    rewards = torch.empty(k.batch, dtype=torch.float32)
    (loss, m), grads = _train_step(k.problem, k.lin, context, need, sequence_logps=logps.data_ptr(),
                                   rewards=rewards.data_ptr())
    return _scalar(loss, k.lin.dtype), _metrics_tensor(m, KTO_METRIC_KEYS), logps, rewards, grads


class FusedLinearKTOLossFunction(torch.autograd.Function):
    """apply(hidden, weight, targets, mask, labels, bias=None, ref_logps=None, ref_per_token_logps=None, kl=None,
    kl_logratios=None, options=None, layout="vh", context=None) -> (loss, metrics, logps, rewards)

    options: a dict of kto_options values (TRL KTOConfig's names; missing: TRL defaults). metrics: float64 [9] in
    fh_kto_metrics order (NaN where TRL logs nothing); logps, rewards: float32 [B]. All three non-differentiable.
    The forward runs fh_kto_forward_backward with upstream gradient 1 for the inputs whose ctx.needs_input_grad is
    set; backward scales the saved gradients by the incoming scalar. The reference log-probs and the KL term are
    constants (as in TRL): they get no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, labels, bias=None, ref_logps=None, ref_per_token_logps=None,
                kl=None, kl_logratios=None, options=None, layout="vh", context=None):
        k = _KTO(hidden, weight, targets, mask, labels, bias, ref_logps, ref_per_token_logps, kl, kl_logratios,
                 dict(options or {}), layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[5])
        loss, metrics, logps, rewards, (dx, dw, db) = _kto_run(k, context, need)
        ctx.save_for_backward(k.lin.hidden_grad(dx), dw, db)
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        ctx.mark_non_differentiable(metrics, logps, rewards)
        return loss, metrics, logps, rewards

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics, _grad_logps, _grad_rewards):
        dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        return (dx, dw, None, None, None, db) + (None,) * 7


class KTOLossOutput(NamedTuple):
    """loss: a scalar in the inputs' dtype, differentiable; metrics: TRL's logged keys -> floats, only those TRL
    logs for the batch; logps, rewards: float32 [B], detached: the sequence log-probs l and TRL's rewards."""
    loss: torch.Tensor
    metrics: dict
    logps: torch.Tensor
    rewards: torch.Tensor


def fused_linear_kto_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                          labels: torch.Tensor, *, loss_type: str = "kto", beta: float = 0.1,
                          desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                          ref_logps: Optional[torch.Tensor] = None,
                          ref_per_token_logps: Optional[torch.Tensor] = None, kl=None,
                          kl_logratios: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                          layout: str = "vh", context: Optional[Context] = None) -> KTOLossOutput:
    """TRL's KTO loss (KTOTrainer, loss_type "kto" or "apo_zero_unpaired") from the hidden states of B sequences
    and the lm_head weight, without the [B*T, V] logits.

    hidden [B, T, H] or [B*T, H] (position t predicts targets[b, t]); targets int64 [B, T]; mask [B, T], the
    completion mask (targets where it is 0 may be anything); labels [B], True / 1 for a desirable sequence. The
    reference model's log-probs: ref_logps [B] (summed over the completion) or ref_per_token_logps [B, T], exactly
    one. kto's KL term (TRL computes it from mismatched completions, without gradient): kl, the value as TRL uses
    it (already clamped at 0), or kl_logratios [B], each sequence's KL completion log-prob under the policy minus
    the reference's (e.g. from fused_linear_logprobs under torch.no_grad()), of which the head takes
    max(mean, 0); apo_zero_unpaired takes neither. include/fusedhead.h has the formulas. Returns (loss, metrics,
    logps, rewards), a KTOLossOutput: metrics with TRL's keys "kl", "rewards/chosen", "rewards/rejected",
    "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy" (those
    TRL logs for the batch).
    """
    options = dict(loss_type=loss_type, beta=beta, desirable_weight=desirable_weight,
                   undesirable_weight=undesirable_weight)
    if isinstance(kl, torch.Tensor):
        kl = float(kl.detach().reshape(-1)[0]) if kl.numel() == 1 else kl
    if _autograd_needed(hidden, weight, bias):
        value, metrics, logps, rewards = FusedLinearKTOLossFunction.apply(
            hidden, weight, targets, mask, labels, bias, ref_logps, ref_per_token_logps, kl, kl_logratios, options,
            layout, context)
    else:
        k = _KTO(hidden, weight, targets, mask, labels, bias, ref_logps, ref_per_token_logps, kl, kl_logratios,
                 options, layout)
        value, metrics, logps, rewards, _ = _kto_run(k, context, (False, False, False))
    return KTOLossOutput(value, kto_metrics_dict(metrics.tolist()), logps, rewards)


class FusedLinearKTOLoss(torch.nn.Module):
    """TRL KTOTrainer's loss (KTOConfig names), the lm_head weight a forward argument as in the other modules:

        loss_fn = FusedLinearKTOLoss(beta=0.1)
        loss, metrics, logps, rewards = loss_fn(hidden, model.lm_head.weight, targets, mask, labels,
                                                ref_logps=ref, kl_logratios=kl_logratios)
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "kto", desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, layout: str = "vh", context: Optional[Context] = None):
        super().__init__()
        parse_layout(layout)
        self.options = dict(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight,
                            undesirable_weight=undesirable_weight)
        kto_options(**self.options)  # bad names and choices fail here; values in the library
        self.layout, self.context = layout, context

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                labels: torch.Tensor, bias: Optional[torch.Tensor] = None, ref_logps: Optional[torch.Tensor] = None,
                ref_per_token_logps: Optional[torch.Tensor] = None, kl=None,
                kl_logratios: Optional[torch.Tensor] = None) -> KTOLossOutput:
        return fused_linear_kto_loss(hidden, weight, targets, mask, labels, bias=bias, ref_logps=ref_logps,
                                     ref_per_token_logps=ref_per_token_logps, kl=kl, kl_logratios=kl_logratios,
                                     layout=self.layout, context=self.context, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"


# ---------------------------------------------------------------------------------------------------------
# Distillation: forward KL, reverse KL, generalized JSD plus a hard-label cross-entropy (TRL's GKD
# generalized_jsd_loss, Liger's LigerFusedLinearJSD and chunked distillation losses)
# ---------------------------------------------------------------------------------------------------------
DISTILL_OPTION_NAMES = ("divergence", "beta", "temperature", "weight_soft_loss", "weight_hard_loss", "ignore_index",
                        "reduction")


class _Distill:
    """Everything one distillation call needs, checked and in library form: the student's and the teacher's
    _TorchLinear (each float32 or bfloat16, hidden [..., H] with the same number of tokens; the teacher detached),
    targets (int64, the student hidden's leading shape or [N]; None: every token counts) and the options."""

    def __init__(self, student_input, student_weight, teacher_input, teacher_weight, targets, student_bias,
                 teacher_bias, options: dict, student_layout, teacher_layout):
        self.options = distill_options(**options)
        self.reduction = Reduction(self.options.reduction)
        self.lin = prefixed_errors("student", _TorchLinear, student_input, student_weight, student_bias,
                                   student_layout)
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        self.teacher = prefixed_errors("teacher", _TorchLinear, detach(teacher_input), detach(teacher_weight),
                                       detach(teacher_bias), teacher_layout)
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = None
        if targets is not None:
            _check_tensor(targets, "targets", torch.int64, " (use .long())")
            self.targets = _token_vector(targets.detach(), "targets", self.token_shape, self.lin.n,
                                         "the student input's leading dimensions")
        if (self.lin.n == 0) != (self.teacher.n == 0):
            raise ValueError(f"teacher_input: expected as many tokens as the student's ({self.lin.n}), got "
                             f"{self.teacher.n}")
        self.problem = None
        if self.lin.n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = DistillProblem(self.lin.head, self.teacher.head, _opt_view(self.targets), self.options)

    @property
    def n(self) -> int:
        return self.lin.n

    def run(self, context: Optional[Context], need: Sequence[bool]):
        """'mean'/'sum': (loss, soft_loss, hard_loss, (dx, dw, db)): the loss and its gradients (upstream 1) for
        the inputs in need (fh_distill_forward_backward), or the loss alone (fh_distill_forward)."""
        result, grads = _train_step(self.problem, self.lin, context, need)
        loss, soft, hard = result if result is not None else (0.0, 0.0, 0.0)
        dtype = self.lin.dtype
        return _scalar(loss, dtype), _scalar(soft, dtype), _scalar(hard, dtype), grads

    def run_none(self, context: Optional[Context], grad_output: Optional[torch.Tensor] = None, grads=None):
        """'none': (per-token loss in the student's dtype, soft_loss, hard_loss): fh_distill_forward, or with a
        per-token grad_output fh_distill_forward_backward into grads (the library's fh_linear_grads)."""
        per_token = torch.zeros(self.n, dtype=torch.float32)
        loss = soft = hard = 0.0
        if self.n > 0:
            ctx = context or default_context()
            if grad_output is None:
                loss, soft, hard = self.problem.forward(ctx, per_token.data_ptr())
            else:
                loss, soft, hard = self.problem.forward_backward(ctx, grad_output.data_ptr(), grads,
                                                                 per_token.data_ptr())
        dtype = self.lin.dtype
        return per_token.view(self.token_shape).to(dtype), _scalar(soft, dtype), _scalar(hard, dtype)


class FusedLinearDistillationLossFunction(torch.autograd.Function):
    """apply(student_input, student_weight, teacher_input, teacher_weight, targets=None, student_bias=None,
    teacher_bias=None, options=None, student_layout="vh", teacher_layout="vh", context=None)
    -> (loss, soft_loss, hard_loss)

    options: a dict of distill_options values (DISTILL_OPTION_NAMES; missing: the defaults, Liger's and TRL's).
    soft_loss, hard_loss: the divergence and cross-entropy parts, reduced like the loss (summed for 'none'),
    before their weights; non-differentiable. 'mean'/'sum': the forward runs fh_distill_forward_backward with
    upstream gradient 1 for the student inputs whose ctx.needs_input_grad is set and backward scales the saved
    gradients by the incoming scalar. 'none': the forward runs fh_distill_forward and backward
    fh_distill_forward_backward with the per-token upstream gradient (the logits are recomputed: the library has
    no separate distillation backward). The teacher is a constant: it gets no gradient (None)."""

    @staticmethod
    def forward(ctx, student_input, student_weight, teacher_input, teacher_weight, targets=None, student_bias=None,
                teacher_bias=None, options=None, student_layout="vh", teacher_layout="vh", context=None):
        d = _Distill(student_input, student_weight, teacher_input, teacher_weight, targets, student_bias,
                     teacher_bias, dict(options or {}), student_layout, teacher_layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                student_bias is not None and ctx.needs_input_grad[5])
        ctx.reduction = d.reduction
        ctx.dweight_pool = _dweight_pool(student_weight) if need[1] else None
        if d.reduction != Reduction.NONE:
            loss, soft, hard, (dx, dw, db) = d.run(context, need)
            ctx.save_for_backward(d.lin.hidden_grad(dx), dw, db)
        else:
            loss, soft, hard = d.run_none(context)
            # What the library saw (views of the inputs, or the copies made for it), for the backward's call.
            ctx.save_for_backward(d.lin.x, d.lin.weight, d.lin.bias, d.teacher.x, d.teacher.weight, d.teacher.bias,
                                  d.targets)
            ctx.need = need
            ctx.call = (dict(options or {}), student_layout, teacher_layout, context)
            ctx.hidden_shape = d.lin.hidden_shape
            ctx.bias_dtype = d.lin.bias_dtype  # the caller's: the saved bias is its fp32 form
            ctx.weight_owner = student_weight  # the dweight pool of the caller's weight
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx, grad_loss, _grad_soft, _grad_hard):
        if ctx.reduction != Reduction.NONE:
            dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        else:
            xs, ws, bs, xt, wt, bt, targets = ctx.saved_tensors  # version-checked
            options, student_layout, teacher_layout, context = ctx.call
            d = _Distill(xs, ws, xt, wt, targets, bs, bt, options, student_layout, teacher_layout)
            d.lin.bias_dtype = ctx.bias_dtype
            d.lin.owner = ctx.weight_owner
            dx, dw, db = d.lin.alloc_grads(*ctx.need)
            if d.n > 0:
                g = _token_vector(grad_loss.to(torch.float32), "grad_output", tuple(ctx.hidden_shape[:-1]), d.n,
                                  "per token")
                d.run_none(context, g, d.lin.grads_struct(dx, dw, db))
            dx = None if dx is None else dx.view(ctx.hidden_shape)
        return (dx, dw, None, None, None, db) + (None,) * 5


def _distill_option_dict(divergence, beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index,
                         reduction) -> dict:
    options = dict(divergence=divergence, beta=beta, temperature=temperature, weight_soft_loss=weight_soft_loss,
                   weight_hard_loss=weight_hard_loss, ignore_index=ignore_index, reduction=reduction)
    distill_options(**options)  # bad names, choices and types fail here; values in the library
    return options


def fused_linear_distillation_loss(student_input: torch.Tensor, student_weight: torch.Tensor,
                                   teacher_input: torch.Tensor, teacher_weight: torch.Tensor,
                                   targets: Optional[torch.Tensor] = None, *,
                                   student_bias: Optional[torch.Tensor] = None,
                                   teacher_bias: Optional[torch.Tensor] = None, divergence: str = "jsd",
                                   beta: float = 0.5, temperature: float = 1.0, weight_soft_loss: float = 1.0,
                                   weight_hard_loss: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
                                   student_layout: str = "vh", teacher_layout: str = "vh",
                                   return_soft_hard_loss: bool = False, context: Optional[Context] = None):
    """Distillation of a student lm_head towards a teacher's over the same vocabulary, without either's [N, V]
    logits (TRL's GKD generalized_jsd_loss, Liger's fused linear JSD / distillation losses; include/fusedhead.h,
    "Distillation", has the formulas).

    s, t: the student's and teacher's logits (F.linear(input, weight, bias)) over temperature; p, q their
    softmaxes. divergence "forward_kl": KL(q || p); "reverse_kl": KL(p || q); "jsd": beta KL(q || m) +
    (1 - beta) KL(p || m) with m = beta q + (1 - beta) p (beta 0 is forward_kl, 1 reverse_kl, as TRL and Liger
    define them). Per token l = weight_soft_loss D + weight_hard_loss CE(student's untempered logits, target),
    over the tokens whose target is not ignore_index; 'mean' divides by their count (0 when there is none, with
    zero gradients), 'sum' adds them, 'none' returns them per token (0 where ignored). No temperature^2 factor.

    student_input [..., H_s] and teacher_input [..., H_t] hold the same N tokens; weights [V, H] (layout "vh",
    nn.Linear.weight) or [H, V] ("hv"), each its own layout; biases [V]. targets int64 with the student input's
    leading shape (or [N]); optional when weight_hard_loss is 0 (every token counts). The teacher gets no
    gradient: its tensors are detached (as TRL and Liger run the teacher under torch.no_grad()). Each head is
    float32 or bfloat16 (its input and weight alike); the loss comes back in the student's dtype, the student's
    gradients in its tensors' dtypes. Returns the loss, or (loss, soft_loss, hard_loss) with
    return_soft_hard_loss=True (the unweighted divergence and cross-entropy parts, reduced like the loss, summed
    over tokens for 'none'; detached; hard_loss is the cross-entropy also when weight_hard_loss is 0, and 0
    without targets).
    """
    options = _distill_option_dict(divergence, beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index,
                                   reduction)
    teacher = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in (teacher_input, teacher_weight,
                                                                               teacher_bias))
    if _autograd_needed(student_input, student_weight, student_bias):
        loss, soft, hard = FusedLinearDistillationLossFunction.apply(
            student_input, student_weight, teacher[0], teacher[1], targets, student_bias, teacher[2], options,
            student_layout, teacher_layout, context)
    else:
        d = _Distill(student_input, student_weight, teacher[0], teacher[1], targets, student_bias, teacher[2],
                     options, student_layout, teacher_layout)
        if d.reduction != Reduction.NONE:
            loss, soft, hard, _ = d.run(context, (False, False, False))
        else:
            loss, soft, hard = d.run_none(context)
    return (loss, soft, hard) if return_soft_hard_loss else loss


class FusedLinearDistillationLoss(torch.nn.Module):
    """nn.Module form of fused_linear_distillation_loss (options fixed at construction; the weights are forward
    arguments, as in the other modules):

        loss_fn = FusedLinearDistillationLoss(divergence="jsd", beta=0.5, temperature=2.0, weight_hard_loss=0.5)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)
    """

    def __init__(self, divergence: str = "jsd", beta: float = 0.5, temperature: float = 1.0,
                 weight_soft_loss: float = 1.0, weight_hard_loss: float = 0.0, ignore_index: int = -100,
                 reduction: str = "mean", student_layout: str = "vh", teacher_layout: str = "vh",
                 return_soft_hard_loss: bool = False, context: Optional[Context] = None):
        super().__init__()
        parse_layout(student_layout)
        parse_layout(teacher_layout)
        self.options = _distill_option_dict(divergence, beta, temperature, weight_soft_loss, weight_hard_loss,
                                            ignore_index, reduction)
        self.student_layout, self.teacher_layout = student_layout, teacher_layout
        self.return_soft_hard_loss, self.context = return_soft_hard_loss, context

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, targets: Optional[torch.Tensor] = None,
                student_bias: Optional[torch.Tensor] = None, teacher_bias: Optional[torch.Tensor] = None):
        return fused_linear_distillation_loss(student_input, student_weight, teacher_input, teacher_weight, targets,
                                              student_bias=student_bias, teacher_bias=teacher_bias,
                                              student_layout=self.student_layout, teacher_layout=self.teacher_layout,
                                              return_soft_hard_loss=self.return_soft_hard_loss, context=self.context,
                                              **self.options)

    def extra_repr(self) -> str:
        return (", ".join(f"{k}={v!r}" for k, v in self.options.items()) +
                f", student_layout={self.student_layout!r}, teacher_layout={self.teacher_layout!r}")


class FusedLinearJSDLoss(torch.nn.Module):
    """Liger's LigerFusedLinearJSD: the generalized JSD between the student's and the teacher's tempered
    distributions (jsd_beta 0 is forward KL, 1 reverse KL), the mean over the tokens whose shift_labels are not
    ignore_index (every token without shift_labels); no hard-label term.

        loss_fn = FusedLinearJSDLoss(jsd_beta=0.5, temperature=2.0)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)
    """

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 student_layout: str = "vh", teacher_layout: str = "vh", context: Optional[Context] = None):
        super().__init__()
        parse_layout(student_layout)
        parse_layout(teacher_layout)
        self.options = _distill_option_dict("jsd", jsd_beta, temperature, 1.0, 0.0, ignore_index, "mean")
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        self.student_layout, self.teacher_layout, self.context = student_layout, teacher_layout, context

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fused_linear_distillation_loss(student_input, student_weight, teacher_input, teacher_weight,
                                              shift_labels, student_layout=self.student_layout,
                                              teacher_layout=self.teacher_layout, context=self.context,
                                              **self.options)

    def extra_repr(self) -> str:
        return (f"jsd_beta={self.jsd_beta!r}, ignore_index={self.ignore_index!r}, temperature={self.temperature!r}, "
                f"student_layout={self.student_layout!r}, teacher_layout={self.teacher_layout!r}")


# ---------------------------------------------------------------------------------------------------------
# Top-k teacher distillation: the teacher as k token ids and log-probs per token (TRL's server distillation,
# forward KL on the teacher's support)
# ---------------------------------------------------------------------------------------------------------
DISTILL_TOPK_OPTION_NAMES = ("add_tail", "temperature", "weight_soft_loss", "weight_hard_loss", "ignore_index",
                             "reduction")


class _DistillTopk(_Distill):
    """One top-k distillation call, checked and in library form: the student's _TorchLinear, the teacher's ids
    (int64) and log-probs (float32), both [..., k] with the input's leading shape or [N, k] (contiguous copies only
    where needed), targets and the options. run and run_none are _Distill's."""

    def __init__(self, input, weight, teacher_ids, teacher_logprobs, targets, bias, options: dict, layout):
        self.options = distill_topk_options(**options)
        self.reduction = Reduction(self.options.reduction)
        self.lin = _TorchLinear(input, weight, bias, layout)
        self.token_shape = self.lin.hidden_shape[:-1]
        n = self.lin.n
        _check_tensor(teacher_ids, "teacher_ids", torch.int64, " (use .long())")
        _check_tensor(teacher_logprobs, "teacher_logprobs", torch.float32, _FP32_HINT)
        shape = tuple(teacher_ids.shape)
        if shape != tuple(teacher_logprobs.shape) or len(shape) < 1 or shape[:-1] not in (self.token_shape, (n,)):
            raise ValueError(f"teacher_ids {list(teacher_ids.shape)} and teacher_logprobs "
                             f"{list(teacher_logprobs.shape)}: expected both {list(self.token_shape) + ['k']} (the "
                             f"input's leading dimensions) or [{n}, k]")
        k = shape[-1]
        self.ids = teacher_ids.detach().reshape(n, k).contiguous()
        self.logprobs = teacher_logprobs.detach().reshape(n, k).contiguous()
        self.targets = None
        if targets is not None:
            _check_tensor(targets, "targets", torch.int64, " (use .long())")
            self.targets = _token_vector(targets.detach(), "targets", self.token_shape, n,
                                         "the input's leading dimensions")
        self.problem = None
        if n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = DistillTopkProblem(self.lin.head, _view(self.ids), _view(self.logprobs),
                                              _opt_view(self.targets), self.options)


class FusedLinearDistillationTopkLossFunction(torch.autograd.Function):
    """apply(input, weight, teacher_ids, teacher_logprobs, targets=None, bias=None, options=None, layout="vh",
    context=None) -> (loss, soft_loss, hard_loss)

    options: a dict of distill_topk_options values (DISTILL_TOPK_OPTION_NAMES; missing: the defaults, TRL's).
    Gradients as FusedLinearDistillationLossFunction's: 'mean'/'sum' run fh_distill_topk_forward_backward in the
    forward and scale in backward; 'none' runs fh_distill_topk_forward, then fh_distill_topk_forward_backward with
    the per-token upstream gradient in backward. The teacher's ids and log-probs get no gradient."""

    @staticmethod
    def forward(ctx, input, weight, teacher_ids, teacher_logprobs, targets=None, bias=None, options=None,
                layout="vh", context=None):
        d = _DistillTopk(input, weight, teacher_ids, teacher_logprobs, targets, bias, dict(options or {}), layout)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[5])
        ctx.reduction = d.reduction
        ctx.dweight_pool = _dweight_pool(weight) if need[1] else None
        if d.reduction != Reduction.NONE:
            loss, soft, hard, (dx, dw, db) = d.run(context, need)
            ctx.save_for_backward(d.lin.hidden_grad(dx), dw, db)
        else:
            loss, soft, hard = d.run_none(context)
            ctx.save_for_backward(d.lin.x, d.lin.weight, d.lin.bias, d.ids, d.logprobs, d.targets)
            ctx.need = need
            ctx.call = (dict(options or {}), layout, context)
            ctx.hidden_shape = d.lin.hidden_shape
            ctx.bias_dtype = d.lin.bias_dtype
            ctx.weight_owner = weight
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx, grad_loss, _grad_soft, _grad_hard):
        if ctx.reduction != Reduction.NONE:
            dx, dw, db = _scaled(ctx.saved_tensors, grad_loss, ctx.dweight_pool)
        else:
            x, w, b, ids, logprobs, targets = ctx.saved_tensors  # version-checked
            options, layout, context = ctx.call
            d = _DistillTopk(x, w, ids, logprobs, targets, b, options, layout)
            d.lin.bias_dtype = ctx.bias_dtype
            d.lin.owner = ctx.weight_owner
            dx, dw, db = d.lin.alloc_grads(*ctx.need)
            if d.n > 0:
                g = _token_vector(grad_loss.to(torch.float32), "grad_output", tuple(ctx.hidden_shape[:-1]), d.n,
                                  "per token")
                d.run_none(context, g, d.lin.grads_struct(dx, dw, db))
            dx = None if dx is None else dx.view(ctx.hidden_shape)
        return (dx, dw, None, None, None, db) + (None,) * 3


def fused_linear_distillation_topk_loss(input: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                                        teacher_logprobs: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                                        bias: Optional[torch.Tensor] = None, add_tail: bool = True,
                                        temperature: float = 1.0, weight_soft_loss: float = 1.0,
                                        weight_hard_loss: float = 0.0, ignore_index: int = -100,
                                        reduction: str = "mean", layout: str = "vh",
                                        return_soft_hard_loss: bool = False, context: Optional[Context] = None):
    """Forward KL of a student lm_head towards a teacher given per token as its top-k token ids and log-probs (a
    vLLM server's top_logprobs; TRL's ServerDistillationTrainer with loss_top_k = k, loss_add_tail = add_tail,
    beta 0; include/fusedhead.h, "Top-k teacher distillation", has the formulas), without the [N, V] logits.

    The student's log-probs are log_softmax(F.linear(input, weight, bias) / temperature); the teacher's are taken
    as given (the server applied its temperature). With add_tail both sides get a (k+1)-th entry for the mass
    outside the support, log(1 - exp(min(logsumexp, -1e-7))); without it both renormalise over the support (k = 1
    is then 0). A log-prob of -inf marks a padded entry (its id is not read); a token with none left adds 0 and is
    counted. Per token l = weight_soft_loss D + weight_hard_loss CE(untempered logits, target), over the tokens
    whose target is not ignore_index; 'mean' divides by their count (TRL's batchmean), 'sum' adds, 'none' returns
    them per token. input [..., H]; weight [V, H] ("vh") or [H, V] ("hv"); teacher_ids int64 and teacher_logprobs
    float32 [..., k] (or [N, k]); targets int64 with the input's leading shape (or [N]), optional when
    weight_hard_loss is 0. Returns the loss, or (loss, soft_loss, hard_loss) with return_soft_hard_loss=True.
    """
    options = dict(add_tail=add_tail, temperature=temperature, weight_soft_loss=weight_soft_loss,
                   weight_hard_loss=weight_hard_loss, ignore_index=ignore_index, reduction=reduction)
    distill_topk_options(**options)  # bad names, choices and types fail here; values in the library
    if _autograd_needed(input, weight, bias):
        loss, soft, hard = FusedLinearDistillationTopkLossFunction.apply(
            input, weight, teacher_ids, teacher_logprobs, targets, bias, options, layout, context)
    else:
        d = _DistillTopk(input, weight, teacher_ids, teacher_logprobs, targets, bias, options, layout)
        if d.reduction != Reduction.NONE:
            loss, soft, hard, _ = d.run(context, (False, False, False))
        else:
            loss, soft, hard = d.run_none(context)
    return (loss, soft, hard) if return_soft_hard_loss else loss
