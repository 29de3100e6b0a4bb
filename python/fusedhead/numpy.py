"""NumPy front end: fused linear cross-entropy, per-token log-probs (logprobs), GRPO (grpo_loss), preference losses
(preference_loss: DPO, ORPO, SimPO, CPO; kto_loss: KTO, APO-zero unpaired) and distillation (distill_loss,
distill_forward_backward: forward KL, reverse KL, JSD) on float32 (or bf16) arrays, zero-copy.

    import fusedhead.numpy as fhnp
    r = fhnp.cross_entropy(hidden, weight, targets, return_grads=True)   # weight [V, H] (layout="vh")
    r.loss, r.dhidden, r.dweight

Arrays are never copied or converted. Expected:
  hidden   float32 [..., H]; rows must have unit element stride (C-contiguous rows; a padded row stride, e.g.
           a slice x[:, :H] of a wider array, is fine for 2-D input); leading dimensions are flattened to N
  weight   float32 [V, H] (layout "vh", torch nn.Linear.weight) or [H, V] (layout "hv", flax kernel), any
           positive non-overlapping strides (C- or Fortran-ordered, sliced)
  targets  int64, shaped like hidden's leading dimensions (or flat [N]), C-contiguous
  bias, class_weights  float32 [V], contiguous
dtype="bf16" (every function): hidden and weight hold raw bfloat16 bits as uint16 arrays (NumPy has no
bfloat16; e.g. torch_bf16_tensor.view(torch.int16).numpy().view(np.uint16)), same shapes and strides rules.
The rest stays float32. Gradients are float32 unless grad_dtype="bf16" (with dtype="bf16" only): then dhidden,
dweight and dbias are uint16 arrays of bf16 bits, accumulated in f32 inside the call and rounded once
(docs/bf16.md for the errors of each choice).
Anything else raises TypeError (dtype, byte order, not an ndarray) or ValueError (shape, strides) saying what
was expected. Library errors raise fusedhead.FusedheadError subclasses with the library's message.

Per-token outputs (per_token_loss, per_token_logp, lse, argmax, entropy) have the targets' shape; gradients have
their input's shape (dweight also its strides: the library writes dweight with the weight's strides).
Cross-entropy options beyond torch's: softcap (Gemma), logit_scale (multiplies the logits before the softcap: Cohere's
logit_scale, Granite's 1 / logits_scaling), z_loss, token_scaling (DFT: each token's loss times its detached target
probability, Liger's use_token_scaling / TRL's SFT loss_type "dft"); return_entropy=True adds the per-token entropy
of the softmax, and every result carries the correct count (tokens whose argmax is their target).
Calls with N = 0 tokens return loss 0 and zero gradients without calling the library (as when every token is
ignored); preference_loss, a mean over pairs, needs at least one pair and one token (ValueError).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, TypeVar, Union

import numpy as np

from ._core import (CEProblem, Context, DistillProblem, DistillTopkProblem, GRPOProblem, KTOProblem, LinearHead,
                    LogprobProblem, PreferenceProblem, Support, padded_support_width, kto_metrics_dict, kto_options,
                    View, collective, default_context, distill_options, grpo_metrics_dict, grpo_options, pairs_shape, parse_reduction,
                    prefixed_errors, preference_metrics_dict, preference_options, status_string, distill_topk_options)
from ._lib import Dtype, Reduction, Status
from .errors import error_for

__all__ = ["cross_entropy", "forward", "backward", "forward_backward", "CrossEntropyResult", "Gradients",
           "workspace_size", "grpo_loss", "GRPOResult", "preference_loss", "PreferenceResult", "distill_loss",
           "distill_forward_backward", "DistillResult", "logprobs", "LogprobsResult", "kto_loss", "KTOResult",
           "distill_topk_loss"]

_FP32_HINT = "; fusedhead computes in fp32: use .astype(np.float32)"
_INPUT_DTYPES = {"fp32": (np.float32, Dtype.F32, _FP32_HINT + " (dtype='bf16' takes bfloat16 bits as uint16)"),
                 "bf16": (np.uint16, Dtype.BF16, " (dtype='bf16': raw bfloat16 bits in uint16 arrays)")}


_GRAD_DTYPES = {"fp32": (np.float32, Dtype.F32), "bf16": (np.uint16, Dtype.BF16)}


def _grad_dtype(grad_dtype: Optional[str], input_dtype: Dtype):
    """(NumPy dtype, fh_dtype) of the gradients: float32 (None, "fp32") or bf16 bits in uint16 ("bf16", which
    needs dtype="bf16")."""
    if grad_dtype is None:
        grad_dtype = "fp32"
    if grad_dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be 'fp32' or 'bf16', got {grad_dtype!r}")
    if grad_dtype == "bf16" and input_dtype != Dtype.BF16:
        raise ValueError("grad_dtype='bf16' needs dtype='bf16' (bf16 hidden and weight)")
    return _GRAD_DTYPES[grad_dtype]


def _input_dtype(dtype: str):
    """(NumPy dtype of hidden and weight, fh_dtype, hint for a wrong dtype) for dtype="fp32" or "bf16"."""
    if dtype not in _INPUT_DTYPES:
        raise ValueError(f"dtype must be 'fp32' or 'bf16' (hidden and weight as bfloat16 bits in uint16 arrays), "
                         f"got {dtype!r}")
    return _INPUT_DTYPES[dtype]

_GRAD_NAMES = ("hidden", "weight", "bias")


# ---------------------------------------------------------------------------------------------------------
# Arrays -> views
# ---------------------------------------------------------------------------------------------------------
def _check_array(a, name: str, dtype, hint: str = "") -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of {np.dtype(dtype).name}, got {type(a).__name__}"
                        + (" (for torch tensors use fusedhead.torch)" if type(a).__module__.startswith("torch")
                           else ""))
    if a.dtype != np.dtype(dtype):  # also rejects non-native byte order ('>f4' != float32)
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype).name} in native byte order, got {a.dtype.str} "
                        f"({a.dtype.name}){hint}")
    if not a.flags.aligned:
        raise ValueError(f"{name}: expected an aligned array")
    return a


def _view(a: np.ndarray, name: str) -> View:
    item = a.itemsize
    if any(s % item for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} bytes are not multiples of the item size {item}")
    return View(int(a.ctypes.data), tuple(int(s) for s in a.shape), tuple(int(s) // item for s in a.strides))


def _flatten_rows(a: np.ndarray, name: str) -> np.ndarray:
    """[..., H] -> [N, H] without copying."""
    if a.ndim == 0:
        raise ValueError(f"{name}: expected [..., H], got a 0-d array")
    if a.ndim == 2:
        return a
    n = int(np.prod(a.shape[:-1], dtype=np.int64))
    flat = a.view()
    try:
        flat.shape = (n, a.shape[-1])
    except AttributeError:
        raise ValueError(f"{name}: its leading dimensions {a.shape[:-1]} cannot be flattened to N without a copy "
                         f"(strides {a.strides}); expected C-contiguous, e.g. np.ascontiguousarray({name})") from None
    return flat


def _flatten_vector(a: np.ndarray, name: str, shape: Tuple[int, ...], n: int, what: str) -> np.ndarray:
    if a.shape != shape and a.shape != (n,):
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}) or [{n}], got {list(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (np.ascontiguousarray({name}))")
    return a.reshape(n)


def _empty_with_strides(like: np.ndarray, dtype=np.float32) -> np.ndarray:
    """An uninitialised array of dtype with `like`'s shape and element strides (dweight must mirror the weight,
    and either may be bf16: strides in elements, not bytes)."""
    if like.flags.c_contiguous:
        return np.empty(like.shape, dtype)
    if like.flags.f_contiguous:
        return np.empty(like.shape, dtype, order="F")
    elements = [s // like.itemsize for s in like.strides]
    extent = 1 + sum((d - 1) * s for d, s in zip(like.shape, elements))
    base = np.empty(max(extent, 1), dtype)
    return np.lib.stride_tricks.as_strided(base, like.shape, tuple(base.itemsize * s for s in elements),
                                           writeable=True)


class _Prepared:
    """Checked arrays and the CEProblem describing them (keeps every array alive while the library runs)."""

    def __init__(self, hidden, weight, targets, bias, layout, ignore_index, reduction, label_smoothing,
                 class_weights, softcap, z_loss, dtype="fp32", grad_dtype=None, *, logit_scale=None,
                 token_scaling=False):
        fp32_hint = "; fusedhead computes in fp32: use .astype(np.float32)"
        input_dtype, self.dtype, hint = _input_dtype(dtype)
        self.grad_np, self.grad_fh = _grad_dtype(grad_dtype, self.dtype)
        hidden = _check_array(hidden, "hidden", input_dtype, hint)
        weight = _check_array(weight, "weight", input_dtype, hint)
        targets = _check_array(targets, "targets", np.int64, "; use .astype(np.int64)")
        if bias is not None:
            bias = _check_array(bias, "bias", np.float32, fp32_hint)
        if class_weights is not None:
            class_weights = _check_array(class_weights, "class_weights", np.float32, fp32_hint)
        self.hidden, self.weight, self.bias, self.class_weights = hidden, weight, bias, class_weights
        self.x = _flatten_rows(hidden, "hidden")
        self.n = self.x.shape[0]
        self.token_shape = tuple(hidden.shape[:-1])
        self.targets = _flatten_vector(targets, "targets", self.token_shape, self.n, "hidden's leading dimensions")
        self.reduction = parse_reduction(reduction)
        self.head = None
        self.problem = None
        if self.n == 0:
            self._check_empty(layout)
            return
        self.head = LinearHead(_view(self.x, "hidden"), _view(weight, "weight"),
                               _view(bias, "bias") if bias is not None else None, layout, self.dtype)
        self.problem = CEProblem(self.head, _view(self.targets, "targets"), ignore_index=ignore_index,
                                 reduction=self.reduction, label_smoothing=label_smoothing,
                                 class_weights=_view(class_weights, "class_weights")
                                 if class_weights is not None else None, softcap=softcap, z_loss=z_loss,
                                 logit_scale=logit_scale, token_scaling=token_scaling)

    def _check_empty(self, layout):
        # Shape checks for N = 0 (the library is not called): a dummy 1-row head checks weight and bias.
        dummy = np.zeros((1, self.x.shape[1]), self.x.dtype)
        LinearHead(_view(dummy, "hidden"), _view(self.weight, "weight"),
                   _view(self.bias, "bias") if self.bias is not None else None, layout)

    def tokens(self, dtype) -> np.ndarray:
        return np.empty(self.n, dtype)

    def shaped(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.token_shape)

    # -- gradients --
    def grad_output(self, grad_output) -> np.ndarray:
        count = self.n if self.reduction == Reduction.NONE else 1
        if grad_output is None:
            return np.ones(count, np.float32)
        if isinstance(grad_output, (int, float, np.floating, np.integer)) and not isinstance(grad_output, bool):
            if self.reduction == Reduction.NONE:
                return np.full(count, grad_output, np.float32)
            return np.array([grad_output], np.float32)
        g = _check_array(grad_output, "grad_output", np.float32)
        if self.reduction == Reduction.NONE:
            return _flatten_vector(g, "grad_output", self.token_shape, self.n, "one value per token")
        if g.size != 1:
            raise ValueError(f"grad_output: expected a scalar for reduction '{self.reduction.name.lower()}', "
                             f"got shape {list(g.shape)}")
        return g.reshape(1) if g.flags.c_contiguous else np.ascontiguousarray(g).reshape(1)

    def wanted(self, wrt, dhidden, dweight, dbias) -> Tuple[bool, bool, bool]:
        available = {"hidden", "weight"} | ({"bias"} if self.bias is not None else set())
        given = {n for n, buf in zip(_GRAD_NAMES, (dhidden, dweight, dbias)) if buf is not None}
        if wrt is None or wrt is True:
            names = given if (given and wrt is None) else set(available)
        else:
            names = {wrt} if isinstance(wrt, str) else set(wrt)
            unknown = names - set(_GRAD_NAMES)
            if unknown:
                raise ValueError(f"wrt: unknown names {sorted(unknown)}; expected a subset of {list(_GRAD_NAMES)}")
            if "bias" in names and self.bias is None:
                raise ValueError("wrt: 'bias' requested but bias is None")
            for name, buf in zip(_GRAD_NAMES, (dhidden, dweight, dbias)):
                if buf is not None and name not in names:
                    raise ValueError(f"d{name} was given but '{name}' is not in wrt")
        return tuple((n in names) or buf is not None for n, buf in zip(_GRAD_NAMES, (dhidden, dweight, dbias)))

    def grad_buffers(self, want, dhidden, dweight, dbias, accumulate):
        """(dx [N, H] view, dweight, dbias) arrays: the caller's (checked) or fresh ones."""
        inputs = [a for a in (self.hidden, self.weight, self.bias, self.targets, self.class_weights) if a is not None]
        out = []
        for name, need, buf in zip(_GRAD_NAMES, want, (dhidden, dweight, dbias)):
            if not need:
                out.append(None)
                continue
            if buf is None:
                if accumulate:
                    raise ValueError(f"accumulate=True needs the d{name} array to accumulate into")
                if name == "hidden":
                    buf = np.empty((self.n, self.x.shape[1]), self.grad_np)
                elif name == "weight":
                    buf = _empty_with_strides(self.weight, self.grad_np)
                else:
                    buf = np.empty(self.bias.shape, self.grad_np)
            else:
                buf = _check_array(buf, f"d{name}", self.grad_np,
                                   " (grad_dtype='bf16': bf16 bits in uint16)" if self.grad_fh == Dtype.BF16 else "")
                if not buf.flags.writeable:
                    raise ValueError(f"d{name}: expected a writeable array")
                if any(np.may_share_memory(buf, a) for a in inputs):  # the library's status, before it is called
                    raise error_for(Status.ERR_OVERLAPPING_BUFFERS, status_string(Status.ERR_OVERLAPPING_BUFFERS),
                                    f"d{name} overlaps an input array", "fusedhead.numpy")
                if name == "hidden":
                    if buf.shape != self.hidden.shape and buf.shape != (self.n, self.x.shape[1]):
                        raise ValueError(f"dhidden: expected hidden's shape {list(self.hidden.shape)}, got "
                                         f"{list(buf.shape)}")
                    buf = _flatten_rows(buf, "dhidden")
            out.append(buf)
        return out

    def grads_struct(self, bufs, accumulate):
        dx, dw, db = bufs
        return self.head.grads(_view(dx, "dhidden") if dx is not None else None,
                               _view(dw, "dweight") if dw is not None else None,
                               _view(db, "dbias") if db is not None else None, accumulate, (self.grad_fh,) * 3)

    def shaped_grads(self, bufs, dhidden_given) -> "Gradients":
        dx, dw, db = bufs
        if dx is not None:  # the caller's array as given, or ours in hidden's shape
            dx = dhidden_given if dhidden_given is not None else dx.reshape(self.hidden.shape)
        return Gradients(dx, dw, db)

    def zero_grads(self, bufs, accumulate):
        if not accumulate:
            for b in bufs:
                if b is not None:
                    b[...] = 0  # +0.0 in fp32 and in bf16 bits


@dataclass
class Gradients:
    dhidden: Optional[np.ndarray] = None  # hidden's shape
    dweight: Optional[np.ndarray] = None  # weight's shape and strides
    dbias: Optional[np.ndarray] = None


@dataclass
class CrossEntropyResult:
    """loss: a float for 'mean'/'sum', the per-token losses (targets' shape) for 'none'.
    z_loss: the z-loss part of the loss, reduced like it (summed over tokens for 'none').
    per_token_loss: CE + z-loss per token, 0 where ignored; per_token_logp: log p(target), 0 where ignored;
    lse: log-sum-exp of the (scaled, softcapped) logits, what backward() needs; argmax: lowest index of the largest
    logit; correct: how many tokens, ignored ones aside, have their target as argmax (token accuracy = correct /
    their count); entropy: of the softmax per token, 0 where ignored (with return_entropy=True, else None).
    Gradients are None unless requested."""
    loss: Union[float, np.ndarray]
    z_loss: float
    per_token_loss: np.ndarray
    per_token_logp: np.ndarray
    lse: np.ndarray
    argmax: np.ndarray
    correct: int = 0
    entropy: Optional[np.ndarray] = None
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None

    @property
    def grads(self) -> Gradients:
        return Gradients(self.dhidden, self.dweight, self.dbias)


F = TypeVar("F", bound=Callable[..., Any])


def _joined(entry: Callable[[Dict[str, Any]], str]) -> Callable[[F], F]:
    """A public function that calls the library's entry(its keyword arguments) once: on a collective context
    (fusedhead.mpi.Context) a failure of its checks still joins the other ranks' call (_core.collective). context and
    what entry reads are keyword-only arguments, absent when left at their defaults."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            context = kwargs.get("context")
            if context is None:
                return fn(*args, **kwargs)
            with collective(context, entry(kwargs)):
                return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def _run_forward(p: _Prepared, ctx: Optional[Context], grad=None, grad_struct=None,
                 return_entropy: bool = False) -> CrossEntropyResult:
    ptl, logp, lse, am = (p.tokens(np.float32), p.tokens(np.float32), p.tokens(np.float32), p.tokens(np.int64))
    correct = np.zeros(1, np.int64)
    entropy = np.zeros(p.n, np.float32) if return_entropy else None  # the entropy's statistic only when asked for
    if p.n == 0:
        loss, z = 0.0, 0.0
    else:
        ctx = ctx or default_context()
        outs = dict(per_token_loss=ptl.ctypes.data, per_token_logp=logp.ctypes.data, lse=lse.ctypes.data,
                    argmax=am.ctypes.data, correct=correct.ctypes.data,
                    entropy=entropy.ctypes.data if entropy is not None else None)
        if grad_struct is None:
            loss, z = p.problem.forward(ctx, **outs)
        else:
            loss, z = p.problem.forward_backward(ctx, grad.ctypes.data, grad_struct, **outs)
    ptl, logp, lse, am = (p.shaped(a) for a in (ptl, logp, lse, am))
    return CrossEntropyResult(ptl if p.reduction == Reduction.NONE else loss, z, ptl, logp, lse, am, int(correct[0]),
                              p.shaped(entropy) if entropy is not None else None)


# ---------------------------------------------------------------------------------------------------------
# Public API (mirrors fh_ce_forward, fh_ce_backward, fh_ce_forward_backward)
# ---------------------------------------------------------------------------------------------------------
@_joined(lambda a: "fh_ce_forward")
def forward(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, bias: Optional[np.ndarray] = None, *,
            layout: str = "vh", ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
            class_weights: Optional[np.ndarray] = None, softcap: float = 0.0, z_loss: float = 0.0,
            logit_scale: Optional[float] = None, token_scaling: bool = False, return_entropy: bool = False,
            context: Optional[Context] = None, dtype: str = "fp32") -> CrossEntropyResult:
    """fh_ce_forward: loss and per-token outputs (keep .lse for backward())."""
    p = _Prepared(hidden, weight, targets, bias, layout, ignore_index, reduction, label_smoothing, class_weights,
                  softcap, z_loss, dtype, logit_scale=logit_scale, token_scaling=token_scaling)
    return _run_forward(p, context, return_entropy=return_entropy)


@_joined(lambda a: "fh_ce_backward")
def backward(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, bias: Optional[np.ndarray] = None, *,
             lse: np.ndarray, grad_output=None, layout: str = "vh", ignore_index: int = -100,
             reduction: str = "mean", label_smoothing: float = 0.0, class_weights: Optional[np.ndarray] = None,
             softcap: float = 0.0, z_loss: float = 0.0, logit_scale: Optional[float] = None,
             token_scaling: bool = False, wrt: Optional[Iterable[str]] = None,
             dhidden: Optional[np.ndarray] = None, dweight: Optional[np.ndarray] = None,
             dbias: Optional[np.ndarray] = None, accumulate: bool = False,
             context: Optional[Context] = None, dtype: str = "fp32", grad_dtype: Optional[str] = None) -> Gradients:
    """fh_ce_backward from forward()'s lse. Options must be those of the forward call (with token_scaling the
    library recomputes each token's target logit for its factor: 2 N H flops).

    grad_output: d(objective)/d(loss): a scalar for 'mean'/'sum' (default 1), one float32 per token for
    'none' (default ones). wrt: which gradients (subset of "hidden", "weight", "bias"); default: those whose
    arrays are passed, or all available when none is. dhidden/dweight/dbias: arrays to write into (dweight
    with the weight's strides), float32 or, with grad_dtype="bf16", uint16 bf16 bits;
    accumulate=True adds to them (beta 1) instead of overwriting (beta 0).
    """
    p = _Prepared(hidden, weight, targets, bias, layout, ignore_index, reduction, label_smoothing, class_weights,
                  softcap, z_loss, dtype, grad_dtype, logit_scale=logit_scale, token_scaling=token_scaling)
    want = p.wanted(wrt, dhidden, dweight, dbias)
    g = p.grad_output(grad_output)
    bufs = p.grad_buffers(want, dhidden, dweight, dbias, accumulate)
    if p.n == 0:
        p.zero_grads(bufs, accumulate)
    else:
        lse = _flatten_vector(_check_array(lse, "lse", np.float32), "lse", p.token_shape, p.n,
                              "one value per token, from forward()")
        grads = p.grads_struct(bufs, accumulate)
        p.problem.backward(context or default_context(), lse.ctypes.data, g.ctypes.data, grads)
    return p.shaped_grads(bufs, dhidden)


@_joined(lambda a: "fh_ce_forward_backward")
def forward_backward(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray,
                     bias: Optional[np.ndarray] = None, *, grad_output=None, layout: str = "vh",
                     ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                     class_weights: Optional[np.ndarray] = None, softcap: float = 0.0, z_loss: float = 0.0,
                     logit_scale: Optional[float] = None, token_scaling: bool = False, return_entropy: bool = False,
                     wrt: Optional[Iterable[str]] = None, dhidden: Optional[np.ndarray] = None,
                     dweight: Optional[np.ndarray] = None, dbias: Optional[np.ndarray] = None,
                     accumulate: bool = False, context: Optional[Context] = None,
                     dtype: str = "fp32", grad_dtype: Optional[str] = None) -> CrossEntropyResult:
    """fh_ce_forward_backward: forward outputs and gradients in one call (the training step: 6 NHV flops
    instead of 8). Arguments as in backward() and forward()."""
    p = _Prepared(hidden, weight, targets, bias, layout, ignore_index, reduction, label_smoothing, class_weights,
                  softcap, z_loss, dtype, grad_dtype, logit_scale=logit_scale, token_scaling=token_scaling)
    want = p.wanted(wrt, dhidden, dweight, dbias)
    g = p.grad_output(grad_output)
    bufs = p.grad_buffers(want, dhidden, dweight, dbias, accumulate)
    if p.n == 0:
        p.zero_grads(bufs, accumulate)
        r = _run_forward(p, context, return_entropy=return_entropy)
    else:
        r = _run_forward(p, context, g, p.grads_struct(bufs, accumulate), return_entropy)
    grads = p.shaped_grads(bufs, dhidden)
    r.dhidden, r.dweight, r.dbias = grads.dhidden, grads.dweight, grads.dbias
    return r


def cross_entropy(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, bias: Optional[np.ndarray] = None,
                  layout: str = "vh", ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, class_weights: Optional[np.ndarray] = None, softcap: float = 0.0,
                  z_loss: float = 0.0, return_grads: Union[bool, Iterable[str]] = False, grad_output=None,
                  context: Optional[Context] = None, dtype: str = "fp32",
                  grad_dtype: Optional[str] = None, *, logit_scale: Optional[float] = None,
                  token_scaling: bool = False, return_entropy: bool = False) -> CrossEntropyResult:
    """F.cross_entropy(hidden @ W.T + bias, targets, ...) without the logits, plus softcap, logit_scale, z-loss
    and DFT's token scaling.

    return_grads: False (forward only), True (all available gradients) or names among "hidden", "weight",
    "bias"; gradients of grad_output * loss (default grad_output 1, or ones per token for 'none').
    """
    options = dict(layout=layout, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                   class_weights=class_weights, softcap=softcap, z_loss=z_loss, logit_scale=logit_scale,
                   token_scaling=token_scaling, return_entropy=return_entropy, context=context, dtype=dtype)
    if return_grads is False or return_grads is None:
        if grad_output is not None or grad_dtype is not None:
            raise ValueError("grad_output and grad_dtype are only used with return_grads")
        return forward(hidden, weight, targets, bias, **options)
    return forward_backward(hidden, weight, targets, bias, grad_output=grad_output,
                            wrt=None if return_grads is True else return_grads, grad_dtype=grad_dtype, **options)


def workspace_size(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, bias: Optional[np.ndarray] = None,
                   *, layout: str = "vh", train_step: bool = False, context: Optional[Context] = None,
                   dtype: str = "fp32") -> int:
    """Workspace bytes fh_ce_forward/backward (train_step=False) or fh_ce_forward_backward (True) need for
    these shapes under the context's settings (pure query)."""
    p = _Prepared(hidden, weight, targets, bias, layout, -100, "mean", 0.0, None, 0.0, 0.0, dtype)
    if p.n == 0:
        return 0
    return p.problem.workspace_size(context or default_context(), train_step)


# ---------------------------------------------------------------------------------------------------------
# Log-probs (fh_logprob_*)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class LogprobsResult:
    """Per token (targets' shape): logp = log p(target) and the entropy and log-sum-exp of softmax(s), each 0
    where the target is ignore_index. Gradients (of sum g_logp logp + g_entropy entropy + g_lse lse) are None
    unless an upstream gradient was given."""
    logp: np.ndarray
    entropy: np.ndarray
    lse: np.ndarray
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None


def _logprob_entry(a: Dict[str, Any]) -> str:
    support = "support_" if a.get("support_ids") is not None else ""
    step = any(a.get(g) is not None for g in ("g_logp", "g_entropy", "g_lse"))
    return f"fh_logprob_{support}forward" + ("_backward" if step else "")


def _support(support_ids: Optional[np.ndarray], support_offsets: Optional[np.ndarray], token_shape: Tuple[int, ...],
             n: int) -> Optional[Support]:
    """support_ids padded (the tokens' shape + [k], -1 padding) or CSR (1-D, with support_offsets [N + 1]); None
    without support_ids."""
    if support_ids is None:
        if support_offsets is not None:
            raise ValueError("support_offsets without support_ids: a CSR support is support_ids with support_offsets")
        return None
    ids = _check_array(support_ids, "support_ids", np.int64)
    if support_offsets is None:
        padded = np.ascontiguousarray(ids.reshape(n, padded_support_width(ids.shape, token_shape, n)))
        return Support(n, _view(padded, "support_ids"), None, (padded,))
    offsets = np.ascontiguousarray(_check_array(support_offsets, "support_offsets", np.int64))
    flat = np.ascontiguousarray(ids) if ids.size > 0 else np.zeros(1, dtype=np.int64)
    return Support(n, _view(flat, "support_ids"), _view(offsets, "support_offsets"), (flat, offsets))


@_joined(_logprob_entry)
def logprobs(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, bias: Optional[np.ndarray] = None, *,
             temperature: float = 1.0, softcap: Optional[float] = None, logit_scale: Optional[float] = None,
             ignore_index: int = -100, g_logp: Optional[np.ndarray] = None, g_entropy: Optional[np.ndarray] = None,
             g_lse: Optional[np.ndarray] = None, layout: str = "vh", context: Optional[Context] = None,
             dtype: str = "fp32", grad_dtype: Optional[str] = None, support_ids: Optional[np.ndarray] = None,
             support_offsets: Optional[np.ndarray] = None) -> LogprobsResult:
    """Per-token log-probs, entropies and log-sum-exps of s = softcap(logit_scale (hidden W^T + bias)) / temperature
    without the logits (fh_logprob_forward); with any of g_logp, g_entropy, g_lse (float32, the targets' shape),
    also the gradients of every input in one call (fh_logprob_forward_backward). With support_ids (int64; padded,
    the targets' shape + [k] with -1 padding, or CSR with support_offsets [N + 1]), each over its token's support
    instead of the vocabulary (fh_logprob_support_*; fusedhead.torch.fused_linear_logprobs says more)."""
    p = _Prepared(hidden, weight, targets, bias, layout, ignore_index, "mean", 0.0, None, 0.0, 0.0, dtype, grad_dtype)
    support = _support(support_ids, support_offsets, p.token_shape, p.n)
    upstream = [None if g is None else _flatten_vector(_check_array(g, name, np.float32), name, p.token_shape, p.n,
                                                        "one value per token")
                for g, name in ((g_logp, "g_logp"), (g_entropy, "g_entropy"), (g_lse, "g_lse"))]
    values = [p.tokens(np.float32) for _ in range(3)]
    bufs = p.grad_buffers(p.wanted(True, None, None, None), None, None, None, False) \
        if any(g is not None for g in upstream) else None
    if p.n == 0:
        for a in values:
            a[...] = 0
        if bufs is not None:
            p.zero_grads(bufs, False)
    else:
        problem = LogprobProblem(p.head, _view(p.targets, "targets"), ignore_index=ignore_index,
                                 temperature=temperature, softcap=softcap, logit_scale=logit_scale, support=support)
        ctx = context or default_context()
        outs = dict(logp=values[0].ctypes.data, entropy=values[1].ctypes.data, lse=values[2].ctypes.data)
        if bufs is None:
            problem.forward(ctx, **outs)
        else:
            problem.forward_backward(ctx, *(None if g is None else g.ctypes.data for g in upstream),
                                     p.grads_struct(bufs, False), **outs)
    r = LogprobsResult(*(p.shaped(a) for a in values))
    if bufs is not None:
        grads = p.shaped_grads(bufs, None)
        r.dhidden, r.dweight, r.dbias = grads.dhidden, grads.dweight, grads.dbias
    return r


# ---------------------------------------------------------------------------------------------------------
# Batch heads (GRPO, preference): shared argument handling
# ---------------------------------------------------------------------------------------------------------
def _wanted(return_grads: Union[bool, Iterable[str]], bias) -> Tuple[str, ...]:
    """The gradients return_grads asks for: False (none), True (all available) or names among "hidden", "weight",
    "bias"."""
    if return_grads is True:
        return ("hidden", "weight") + (("bias",) if bias is not None else ())
    if not return_grads:
        return ()
    want = tuple(return_grads)
    if set(want) - {"hidden", "weight", "bias"} or ("bias" in want and bias is None):
        raise ValueError(f"return_grads: expected names among 'hidden', 'weight', 'bias' (bias only with a "
                         f"bias), got {list(want)}")
    return want


def _token_array(a, name: str, dtype, shape: Tuple[int, ...], dims: str, hint: str = ""):
    """A C-contiguous array of the batch's token shape, flattened without a copy (None stays None)."""
    if a is None:
        return None
    a = _check_array(a, name, dtype, hint)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {dims} = {list(shape)}, got {list(a.shape)}")
    return _flatten_vector(a, name, shape, int(np.prod(shape)), dims)


def _packed_rows(hidden: np.ndarray, cu_seqlens, sequences: str) -> Tuple[np.ndarray, Tuple[int, ...], int, str]:
    """Packed sequences: hidden [N, H] or [1, N, H] (a padding-free batch) and cu_seqlens, int32 or int64 [S + 1]
    offsets -> (the offsets as a contiguous int64 array, the per-token shape: hidden's leading dimensions, S, that
    shape's name). The library checks the offsets (0 first, increasing, N last)."""
    cu = np.asarray(cu_seqlens)
    if cu.dtype not in (np.int32, np.int64):
        raise TypeError(f"cu_seqlens: expected an int32 or int64 array, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected [{sequences} + 1] offsets of at least one sequence, got shape "
                         f"{list(cu.shape)}")
    if not (hidden.ndim == 2 or (hidden.ndim == 3 and hidden.shape[0] == 1)):
        raise ValueError(f"hidden: with cu_seqlens expected the packed rows [N, H] or [1, N, H], got shape "
                         f"{list(hidden.shape)}")
    return (np.ascontiguousarray(cu, dtype=np.int64), tuple(int(d) for d in hidden.shape[:-1]), int(cu.shape[0]) - 1,
            "[N] (packed rows)")


class _BatchHead:
    """hidden, weight and bias of a batch head, checked, and the gradients return_grads asks for in fresh arrays
    (dhidden in hidden's shape, dweight with the weight's strides), float32 or grad_dtype="bf16" bits."""

    def __init__(self, hidden, weight, bias, dtype: str, grad_dtype: Optional[str], return_grads):
        input_dtype, self.fh_dtype, hint = _input_dtype(dtype)
        grad_np, self.grad_fh = _grad_dtype(grad_dtype, self.fh_dtype)
        self.hidden = _check_array(hidden, "hidden", input_dtype, hint)
        self.weight = _check_array(weight, "weight", input_dtype, hint)
        self.bias = None if bias is None else _check_array(bias, "bias", np.float32, _FP32_HINT)
        want = _wanted(return_grads, bias)
        self.dx = np.zeros(self.hidden.shape, grad_np) if "hidden" in want else None
        self.dw = _empty_with_strides(self.weight, grad_np) if "weight" in want else None
        self.db = np.zeros(bias.shape, grad_np) if "bias" in want else None

    def linear(self, layout: str) -> LinearHead:
        x = _flatten_rows(self.hidden, "hidden")
        return LinearHead(_view(x, "hidden"), _view(self.weight, "weight"),
                          None if self.bias is None else _view(self.bias, "bias"), layout, self.fh_dtype)

    def run(self, problem, grad_output: float, context: Optional[Context], outputs: dict):
        """(loss, metrics struct): the problem's forward_backward into the gradient arrays, or its forward alone
        when no gradient is asked for; outputs: the library's output arrays by name."""
        ptrs = {k: v.ctypes.data for k, v in outputs.items()}
        ctx = context or default_context()
        if self.dx is None and self.dw is None and self.db is None:
            return problem.forward(ctx, **ptrs)
        g = np.array([grad_output], np.float32)
        head = problem.head
        grads = head.grads(None if self.dx is None else _view(self.dx.reshape(head.n, -1), "dhidden"),
                           None if self.dw is None else _view(self.dw, "dweight"),
                           None if self.db is None else _view(self.db, "dbias"), dtypes=(self.grad_fh,) * 3)
        return problem.forward_backward(ctx, g.ctypes.data, grads, **ptrs)


# ---------------------------------------------------------------------------------------------------------
# GRPO (TRL GRPOTrainer._compute_loss semantics; mirrors fh_grpo_forward / fh_grpo_forward_backward)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class GRPOResult:
    """loss: float; metrics: TRL's logged keys ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
    "policy_loss", "vespo/phi_seq_mean", "sampling/importance_sampling_ratio/mean", ...), only those TRL logs for
    the options and inputs; per_token_logp, per_token_loss, entropy, lse: [B, T] float32 (per_token_loss before
    masking; lse of the tempered logits). Gradients (of grad_output * loss) are None unless requested."""
    loss: float
    metrics: dict
    per_token_logp: np.ndarray
    per_token_loss: np.ndarray
    entropy: np.ndarray
    lse: np.ndarray
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None


@_joined(lambda a: "fh_grpo_forward_backward" if a.get("return_grads") else "fh_grpo_forward")
def grpo_loss(hidden: np.ndarray, weight: np.ndarray, completion_ids: np.ndarray, completion_mask: np.ndarray,
              advantages: np.ndarray, bias: Optional[np.ndarray] = None,
              old_per_token_logps: Optional[np.ndarray] = None, ref_per_token_logps: Optional[np.ndarray] = None,
              sampling_per_token_logps: Optional[np.ndarray] = None, *, layout: str = "vh",
              return_grads: Union[bool, Iterable[str]] = False, grad_output: float = 1.0,
              context: Optional[Context] = None, dtype: str = "fp32", grad_dtype: Optional[str] = None,
              support_ids: Optional[np.ndarray] = None, support_offsets: Optional[np.ndarray] = None,
              cu_seqlens: Optional[np.ndarray] = None, **options) -> GRPOResult:
    """TRL's GRPO loss (GRPOTrainer._compute_loss of TRL 1.16.0) from hidden [B, T, H] float32
    (position t predicts completion_ids[b, t], int64 [B, T]), completion_mask float32 [B, T], advantages float32
    [B], optional old / ref / sampling (the sampler's, vLLM's) per-token log-probs float32 [B, T], without the
    logits. Nothing is copied (C-contiguous token arrays expected). dtype="bf16": hidden and weight are bfloat16
    bits in uint16 arrays (the rest float32; the gradients too unless grad_dtype="bf16").

    options: TRL GRPOConfig names and defaults (fusedhead._core.GRPO_OPTION_DEFAULTS): loss_type ("dapo"; grpo,
    bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), importance_sampling_level, temperature, epsilon_low (alias
    epsilon), epsilon_high, delta, beta, sapo_temperature_pos/neg, num_items_in_batch, max_completion_length,
    entropy_coef, top_entropy_quantile, off_policy_mask_threshold, use_bias_correction_kl,
    vllm_importance_sampling_correction (True: applies when sampling_per_token_logps is given),
    vllm_importance_sampling_mode ("sequence_mask"; token_truncate, token_mask, sequence_truncate),
    vllm_importance_sampling_clip_min / _clip_max (None: no bound; _cap: TRL's deprecated alias of clip_max),
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg. return_grads: False, True (all) or names among
    "hidden", "weight", "bias". support_ids / support_offsets: the policy's log-probs over each token's support, as
    fusedhead.torch.fused_linear_grpo_loss takes them. cu_seqlens (int32 or int64 [B + 1]): packed sequences,
    hidden [N, H] or [1, N, H] and the per-token arrays (and outputs) of hidden's leading shape, as
    fusedhead.torch.fused_linear_grpo_loss takes them.
    """
    opt = grpo_options(**options)
    arrays = _BatchHead(hidden, weight, bias, dtype, grad_dtype, return_grads)
    cu = None
    if cu_seqlens is None:
        if arrays.hidden.ndim != 3:
            raise ValueError(f"hidden: expected [B, T, H], got shape {list(arrays.hidden.shape)}")
        b, t = int(arrays.hidden.shape[0]), int(arrays.hidden.shape[1])
        shape, dims = (b, t), "[B, T]"
    else:
        cu, shape, b, dims = _packed_rows(arrays.hidden, cu_seqlens, "B")
        t = 0
    n = int(np.prod(shape))
    ids = _token_array(completion_ids, "completion_ids", np.int64, shape, dims, " (use .astype(np.int64))")
    mask = _token_array(completion_mask, "completion_mask", np.float32, shape, dims, " (use .astype(np.float32))")
    old = _token_array(old_per_token_logps, "old_per_token_logps", np.float32, shape, dims, _FP32_HINT)
    ref = _token_array(ref_per_token_logps, "ref_per_token_logps", np.float32, shape, dims, _FP32_HINT)
    samp = _token_array(sampling_per_token_logps, "sampling_per_token_logps", np.float32, shape, dims, _FP32_HINT)
    adv = _check_array(advantages, "advantages", np.float32, _FP32_HINT)
    if adv.shape != (b,):
        raise ValueError(f"advantages: expected shape [B] = [{b}], got {list(adv.shape)}")
    support = _support(support_ids, support_offsets, shape, n)
    outs = {k: np.zeros(shape, np.float32) for k in ("per_token_logp", "per_token_loss", "entropy", "lse")}
    grads = dict(dhidden=arrays.dx, dweight=arrays.dw, dbias=arrays.db)
    if n == 0:
        if arrays.dw is not None:
            arrays.dw[...] = 0
        return GRPOResult(0.0, {}, **outs, **grads)
    opt_view = lambda a, name: None if a is None else _view(a, name)  # noqa: E731
    problem = GRPOProblem(arrays.linear(layout), b, t, _view(ids, "completion_ids"), _view(mask, "completion_mask"),
                          _view(adv, "advantages"), opt_view(old, "old_per_token_logps"),
                          opt_view(ref, "ref_per_token_logps"), opt, opt_view(samp, "sampling_per_token_logps"),
                          support, opt_view(cu, "cu_seqlens"))
    loss, m = arrays.run(problem, grad_output, context, outs)
    return GRPOResult(loss, grpo_metrics_dict(m), **outs, **grads)


# ---------------------------------------------------------------------------------------------------------
# Preference heads: DPO, ORPO, SimPO, CPO (TRL semantics; mirrors fh_preference_forward / _forward_backward)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class PreferenceResult:
    """loss: float; metrics: TRL's logged keys ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
    "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss",
    "log_odds_ratio", "log_odds_chosen", "entropy", "mean_token_accuracy"), only those TRL logs for the options; sequence_logps and rewards: float32
    [2B], the chosen sequences' then the rejected ones'; per_token_logp: float32 [2B, T]. Gradients (of
    grad_output * loss) are None unless requested."""
    loss: float
    metrics: dict
    sequence_logps: np.ndarray
    rewards: np.ndarray
    per_token_logp: np.ndarray
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None


def preference_loss(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, mask: np.ndarray,
                    bias: Optional[np.ndarray] = None, ref_logps: Optional[np.ndarray] = None,
                    ref_per_token_logps: Optional[np.ndarray] = None, *, layout: str = "vh",
                    return_grads: Union[bool, Iterable[str]] = False, grad_output: float = 1.0,
                    context: Optional[Context] = None, dtype: str = "fp32", grad_dtype: Optional[str] = None,
                    cu_seqlens: Optional[np.ndarray] = None, **options) -> PreferenceResult:
    """TRL's DPO, ORPO, SimPO or CPO loss from hidden [2B, T, H] or [2B*T, H] float32 (the chosen sequences, then
    the rejected ones: pair b is sequences b and B + b; position t predicts targets[s, t], int64 [2B, T]) and the
    loss mask float32 [2B, T], without the logits. dpo's reference log-probs: ref_logps float32 [2B] (aggregated
    as the loss aggregates its own) or ref_per_token_logps float32 [2B, T], at most one; neither: 0 (reference-free).
    Nothing is copied (C-contiguous token arrays expected). dtype="bf16": hidden and weight are bfloat16 bits in
    uint16 arrays (the rest float32; the gradients too unless grad_dtype="bf16").

    options: loss ("dpo", "orpo", "simpo", "cpo") and TRL's config names: loss_type (a name, or for dpo at TRL's
    current semantics a list of them, with loss_weights), beta, label_smoothing, simpo_gamma, rpo_alpha (dpo at
    v0.28 only), cpo_alpha, discopop_tau, use_weighting (refused); dpo_semantics "current" (TRL >= v0.29.0, the
    default) or "trl_0_28" (include/fusedhead.h has the formulas; fusedhead.torch.fused_linear_preference_loss the
    loss types).
    return_grads: False, True (all) or names among "hidden", "weight", "bias". cu_seqlens (int32 or int64
    [2B + 1]): packed sequences, the chosen ones then the rejected ones, hidden [N, H] or [1, N, H] and the per-token
    arrays (and per_token_logp) of hidden's leading shape.
    """
    opt = preference_options(**options)
    arrays = _BatchHead(hidden, weight, bias, dtype, grad_dtype, return_grads)
    tg = _check_array(targets, "targets", np.int64, " (use .astype(np.int64))")
    x, cu = arrays.hidden, None
    if cu_seqlens is None:
        rows, t = pairs_shape(tg.shape)
        if x.shape[:-1] not in ((rows, t), (rows * t,)):
            raise ValueError(f"hidden: expected [2B, T, H] = [{rows}, {t}, H] or [2B*T, H] = [{rows * t}, H] "
                             f"(targets are [2B, T] = {list(tg.shape)}), got shape {list(x.shape)}")
        shape, dims = (rows, t), "[2B, T]"
    else:
        cu, shape, rows, dims = _packed_rows(x, cu_seqlens, "2B")
        t = 0
        if rows % 2:
            raise ValueError(f"cu_seqlens: expected [2B + 1] offsets, the chosen sequences then the rejected ones (an "
                             f"even count), got {rows} sequences")
    ids = _token_array(tg, "targets", np.int64, shape, dims)
    m = _token_array(mask, "mask", np.float32, shape, dims, " (use .astype(np.float32))")
    ref_tok = _token_array(ref_per_token_logps, "ref_per_token_logps", np.float32, shape, dims, _FP32_HINT)
    ref = None
    if ref_logps is not None:
        ref = _check_array(ref_logps, "ref_logps", np.float32, _FP32_HINT)
        if ref.shape != (rows,):
            raise ValueError(f"ref_logps: expected shape [2B] = [{rows}], got {list(ref.shape)}")
    outs = dict(sequence_logps=np.zeros(rows, np.float32), rewards=np.zeros(rows, np.float32),
                per_token_logp=np.zeros(shape, np.float32))
    problem = PreferenceProblem(arrays.linear(layout), rows // 2, t, _view(ids, "targets"), _view(m, "mask"),
                                None if ref is None else _view(ref, "ref_logps"),
                                None if ref_tok is None else _view(ref_tok, "ref_per_token_logps"), opt,
                                None if cu is None else _view(cu, "cu_seqlens"))
    loss, metrics = arrays.run(problem, grad_output, context, outs)
    return PreferenceResult(loss, preference_metrics_dict(metrics), **outs, dhidden=arrays.dx, dweight=arrays.dw,
                            dbias=arrays.db)


# ---------------------------------------------------------------------------------------------------------
# KTO (TRL KTOTrainer semantics; mirrors fh_kto_forward / fh_kto_forward_backward)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class KTOResult:
    """loss: float; metrics: TRL's logged keys ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy"), only those TRL logs for the
    batch; sequence_logps and rewards: float32 [B]; per_token_logp: float32 [B, T]. Gradients (of grad_output *
    loss) are None unless requested."""
    loss: float
    metrics: dict
    sequence_logps: np.ndarray
    rewards: np.ndarray
    per_token_logp: np.ndarray
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None


def _sequence_vector(a, name: str, dtype, b: int, hint: str = "") -> Optional[np.ndarray]:
    """A contiguous per-sequence [B] array (None stays None)."""
    if a is None:
        return None
    a = _check_array(a, name, dtype, hint)
    if a.shape != (b,) or not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous array of shape [B] = [{b}], got shape {list(a.shape)}")
    return a


@_joined(lambda a: "fh_kto_forward_backward" if a.get("return_grads") else "fh_kto_forward")
def kto_loss(hidden: np.ndarray, weight: np.ndarray, targets: np.ndarray, mask: np.ndarray, labels: np.ndarray,
             bias: Optional[np.ndarray] = None, ref_logps: Optional[np.ndarray] = None,
             ref_per_token_logps: Optional[np.ndarray] = None, kl: Optional[float] = None,
             kl_logratios: Optional[np.ndarray] = None, *, layout: str = "vh",
             return_grads: Union[bool, Iterable[str]] = False, grad_output: float = 1.0,
             context: Optional[Context] = None, dtype: str = "fp32", grad_dtype: Optional[str] = None,
             cu_seqlens: Optional[np.ndarray] = None, **options) -> KTOResult:
    """TRL's KTO loss (KTOTrainer._compute_loss at huggingface/trl f2cd5771) from hidden [B, T, H] or [B*T, H]
    float32 (position t predicts targets[b, t], int64 [B, T]), the completion mask float32 [B, T] and labels [B]
    (bool or uint8, 1 / True: desirable), without the logits. The reference: ref_logps float32 [B] or
    ref_per_token_logps float32 [B, T] (summed under the mask), exactly one. loss_type "kto" takes the batch's KL
    term either as kl (a number, as TRL uses it: already clamped at 0) or as kl_logratios float32 [B] (each
    sequence's mismatched-completion log-ratio, policy minus reference; the head forms max(mean, 0));
    "apo_zero_unpaired" takes neither. Nothing is copied (C-contiguous arrays expected). dtype="bf16": hidden and
    weight are bfloat16 bits in uint16 arrays (the rest float32; the gradients too unless grad_dtype="bf16").

    options: TRL KTOConfig's names: loss_type ("kto", "apo_zero_unpaired"), beta, desirable_weight,
    undesirable_weight (include/fusedhead.h has the formulas). return_grads: False, True (all) or names among
    "hidden", "weight", "bias". cu_seqlens (int32 or int64 [B + 1]): packed sequences, hidden [N, H] or [1, N, H]
    and the per-token arrays (and per_token_logp) of hidden's leading shape.
    """
    opt = kto_options(**options)
    arrays = _BatchHead(hidden, weight, bias, dtype, grad_dtype, return_grads)
    tg = _check_array(targets, "targets", np.int64, " (use .astype(np.int64))")
    cu = None
    if cu_seqlens is None:
        if tg.ndim != 2 or 0 in tg.shape:
            raise ValueError(f"targets: expected [B, T] with B, T >= 1, got shape {list(tg.shape)}")
        b, t = int(tg.shape[0]), int(tg.shape[1])
        if arrays.hidden.shape[:-1] not in ((b, t), (b * t,)):
            raise ValueError(f"hidden: expected [B, T, H] = [{b}, {t}, H] or [B*T, H] = [{b * t}, H] (targets are "
                             f"[B, T] = {[b, t]}), got shape {list(arrays.hidden.shape)}")
        shape, dims = (b, t), "[B, T]"
    else:
        cu, shape, b, dims = _packed_rows(arrays.hidden, cu_seqlens, "B")
        t = 0
    ids = _token_array(tg, "targets", np.int64, shape, dims)
    m = _token_array(mask, "mask", np.float32, shape, dims, " (use .astype(np.float32))")
    if isinstance(labels, np.ndarray) and labels.dtype == np.bool_:
        labels = labels.view(np.uint8)  # the same bytes: False 0, True 1
    lab = _sequence_vector(labels, "labels", np.uint8, b, " (bool or uint8)")
    ref = _sequence_vector(ref_logps, "ref_logps", np.float32, b, _FP32_HINT)
    ref_tok = _token_array(ref_per_token_logps, "ref_per_token_logps", np.float32, shape, dims, _FP32_HINT)
    klr = _sequence_vector(kl_logratios, "kl_logratios", np.float32, b, _FP32_HINT)
    kl_value = None if kl is None else np.array([kl], np.float32)
    outs = dict(sequence_logps=np.zeros(b, np.float32), rewards=np.zeros(b, np.float32),
                per_token_logp=np.zeros(shape, np.float32))
    opt_view = lambda a, name: None if a is None else _view(a, name)  # noqa: E731
    problem = KTOProblem(arrays.linear(layout), b, t, _view(ids, "targets"), _view(m, "mask"), _view(lab, "labels"),
                         opt_view(ref, "ref_logps"), opt_view(ref_tok, "ref_per_token_logps"),
                         opt_view(kl_value, "kl"), opt_view(klr, "kl_logratios"), opt, opt_view(cu, "cu_seqlens"))
    loss, metrics = arrays.run(problem, grad_output, context, outs)
    return KTOResult(loss, kto_metrics_dict(metrics), **outs, dhidden=arrays.dx, dweight=arrays.dw, dbias=arrays.db)


# ---------------------------------------------------------------------------------------------------------
# Distillation: forward KL, reverse KL, generalized JSD plus a hard-label cross-entropy (TRL's GKD, Liger's fused
# linear JSD / distillation losses; mirrors fh_distill_forward / fh_distill_forward_backward)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class DistillResult:
    """loss: a float for 'mean'/'sum', the per-token losses (the tokens' shape) for 'none'. soft_loss, hard_loss:
    the divergence and cross-entropy parts, reduced like the loss (summed over tokens for 'none') and before
    weight_soft_loss / weight_hard_loss (hard_loss: also when weight_hard_loss is 0; 0 without targets).
    per_token_loss: float32 l_i (0 where ignored). Gradients (the student's, of grad_output * loss) are None unless requested; the teacher
    gets none."""
    loss: Union[float, np.ndarray]
    soft_loss: float
    hard_loss: float
    per_token_loss: np.ndarray
    dhidden: Optional[np.ndarray] = None
    dweight: Optional[np.ndarray] = None
    dbias: Optional[np.ndarray] = None


def distill_loss(student_hidden: np.ndarray, student_weight: np.ndarray, teacher_hidden: np.ndarray,
                 teacher_weight: np.ndarray, targets: Optional[np.ndarray] = None,
                 student_bias: Optional[np.ndarray] = None, teacher_bias: Optional[np.ndarray] = None, *,
                 divergence: str = "jsd", beta: float = 0.5, temperature: float = 1.0,
                 weight_soft_loss: float = 1.0, weight_hard_loss: float = 0.0, ignore_index: int = -100,
                 reduction: str = "mean", top_k: int = 0, add_tail: bool = True, student_layout: str = "vh",
                 teacher_layout: str = "vh", return_grads: Union[bool, Iterable[str]] = False, grad_output=None,
                 context: Optional[Context] = None, dtype: str = "fp32", teacher_dtype: Optional[str] = None,
                 grad_dtype: Optional[str] = None) -> DistillResult:
    """Distillation loss of a student head towards a teacher head over the same vocabulary, without either's
    logits (include/fusedhead.h, "Distillation", has the formulas): with s, t the student's and teacher's logits
    over temperature, divergence "forward_kl" KL(q || p), "reverse_kl" KL(p || q) or "jsd" (beta q + (1 - beta) p
    mixture; beta 0 is forward_kl, 1 reverse_kl, as TRL's generalized_jsd_loss), plus weight_hard_loss times the
    cross-entropy of the student's untempered logits at targets; tokens whose target is ignore_index are left out,
    'mean' divides by the tokens counted. No temperature^2 factor (TRL and Liger apply none). top_k > 0 (< V):
    the divergence over each token's top-k support with add_tail, as TRL's generalized_jsd_loss(top_k, add_tail)
    (fusedhead.torch.fused_linear_distillation_loss says which support each divergence takes).

    student_hidden [..., H_s], teacher_hidden [..., H_t] with the same number of tokens N; weights [V, H] (layout
    "vh") or [H, V] ("hv") each, the same V; biases float32 [V]; targets int64 shaped like the student's leading
    dimensions (or [N]), optional when weight_hard_loss is 0 (then every token counts). Nothing is copied.
    dtype="bf16": the student's hidden and weight are bfloat16 bits in uint16 arrays; teacher_dtype (default:
    dtype) the teacher's. return_grads: False (fh_distill_forward), True (all of the student's gradients) or names
    among "hidden", "weight", "bias" (fh_distill_forward_backward): gradients of grad_output * loss (a scalar,
    default 1, or one float32 per token for 'none'), float32 or bf16 bits with grad_dtype="bf16".
    """
    opt = distill_options(divergence=divergence, beta=beta, temperature=temperature,
                          weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss,
                          ignore_index=ignore_index, reduction=reduction, top_k=top_k, add_tail=add_tail)
    red = Reduction(opt.reduction)
    if not return_grads and (grad_output is not None or grad_dtype is not None):
        raise ValueError("grad_output and grad_dtype are only used with return_grads")
    _wanted(return_grads, student_bias)  # its ValueError names return_grads, not a head
    student = prefixed_errors("student", _BatchHead, student_hidden, student_weight, student_bias, dtype,
                              grad_dtype, return_grads)
    teacher = prefixed_errors("teacher", _BatchHead, teacher_hidden, teacher_weight, teacher_bias,
                              dtype if teacher_dtype is None else teacher_dtype, None, False)
    xs = prefixed_errors("student", _flatten_rows, student.hidden, "hidden")
    xt = prefixed_errors("teacher", _flatten_rows, teacher.hidden, "hidden")
    n, token_shape = xs.shape[0], tuple(student.hidden.shape[:-1])
    tg = None
    if targets is not None:
        tg = _flatten_vector(_check_array(targets, "targets", np.int64, " (use .astype(np.int64))"), "targets",
                             token_shape, n, "the student hidden's leading dimensions")
    g = None
    if student.dx is not None or student.dw is not None or student.db is not None:
        g = _distill_grad_output(grad_output, red, token_shape, n)
    per_token = np.zeros(n, np.float32)
    if n == 0 and xt.shape[0] == 0:  # nothing to compute: the shapes are checked, the library is not called
        for name, w in (("student", student), ("teacher", teacher)):
            dummy = np.zeros((1, w.hidden.shape[-1]), w.hidden.dtype)
            prefixed_errors(name, LinearHead, _view(dummy, "hidden"), _view(w.weight, "weight"),
                            None if w.bias is None else _view(w.bias, "bias"),
                            student_layout if name == "student" else teacher_layout, w.fh_dtype)
        if student.dw is not None:
            student.dw[...] = 0
        loss = per_token.reshape(token_shape) if red == Reduction.NONE else 0.0
        return DistillResult(loss, 0.0, 0.0, per_token.reshape(token_shape), student.dx, student.dw, student.db)
    if n == 0 or xt.shape[0] == 0:
        raise ValueError(f"teacher_hidden: expected as many tokens as the student's ({n}), got {xt.shape[0]}")
    problem = DistillProblem(prefixed_errors("student", student.linear, student_layout),
                             prefixed_errors("teacher", teacher.linear, teacher_layout),
                             None if tg is None else _view(tg, "targets"), opt)
    return _distill_run(problem, student, g, per_token, token_shape, red, context)


def distill_forward_backward(student_hidden: np.ndarray, student_weight: np.ndarray, teacher_hidden: np.ndarray,
                             teacher_weight: np.ndarray, targets: Optional[np.ndarray] = None,
                             student_bias: Optional[np.ndarray] = None, teacher_bias: Optional[np.ndarray] = None,
                             *, wrt: Union[bool, Iterable[str]] = True, **options) -> DistillResult:
    """fh_distill_forward_backward: distill_loss(..., return_grads=wrt) (wrt: True for every gradient of the
    student, or names among "hidden", "weight", "bias"); the other arguments as distill_loss's."""
    if not wrt:
        raise ValueError("wrt: expected True or names among 'hidden', 'weight', 'bias' (use distill_loss for the "
                         "loss alone)")
    return distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, student_bias,
                        teacher_bias, return_grads=wrt, **options)


def _distill_run(problem, student: _BatchHead, g: Optional[np.ndarray], per_token: np.ndarray,
                 token_shape: Tuple[int, ...], red: Reduction, context: Optional[Context]) -> DistillResult:
    """A distillation problem's forward (g None) or forward_backward into the student's gradient arrays."""
    ctx = context or default_context()
    if g is None:
        loss, soft, hard = problem.forward(ctx, per_token.ctypes.data)
    else:
        head = problem.head
        grads = head.grads(None if student.dx is None else _view(student.dx.reshape(head.n, -1), "dhidden"),
                           None if student.dw is None else _view(student.dw, "dweight"),
                           None if student.db is None else _view(student.db, "dbias"), dtypes=(student.grad_fh,) * 3)
        loss, soft, hard = problem.forward_backward(ctx, g.ctypes.data, grads, per_token.ctypes.data)
    per_token = per_token.reshape(token_shape)
    return DistillResult(per_token if red == Reduction.NONE else loss, soft, hard, per_token, student.dx, student.dw,
                         student.db)


def _distill_grad_output(grad_output, reduction: Reduction, token_shape: Tuple[int, ...], n: int) -> np.ndarray:
    """The upstream gradient as the library reads it: one float32 for 'mean'/'sum' (default 1), one per token for
    'none' (default ones; a scalar is broadcast)."""
    count = n if reduction == Reduction.NONE else 1
    if grad_output is None:
        return np.ones(count, np.float32)
    if isinstance(grad_output, (int, float, np.floating, np.integer)) and not isinstance(grad_output, bool):
        return np.full(count, grad_output, np.float32)
    g = _check_array(grad_output, "grad_output", np.float32)
    if reduction == Reduction.NONE:
        return _flatten_vector(g, "grad_output", token_shape, n, "one value per token")
    if g.size != 1:
        raise ValueError(f"grad_output: expected a scalar for reduction '{reduction.name.lower()}', got shape "
                         f"{list(g.shape)}")
    return np.ascontiguousarray(g).reshape(1)


# ---------------------------------------------------------------------------------------------------------
# Top-k teacher distillation: the teacher as k token ids and log-probs per token (TRL's server distillation,
# forward KL on the teacher's support; mirrors fh_distill_topk_forward / fh_distill_topk_forward_backward)
# ---------------------------------------------------------------------------------------------------------
def distill_topk_loss(hidden: np.ndarray, weight: np.ndarray, teacher_ids: np.ndarray,
                      teacher_logprobs: np.ndarray, targets: Optional[np.ndarray] = None,
                      bias: Optional[np.ndarray] = None, *, add_tail: bool = True, temperature: float = 1.0,
                      weight_soft_loss: float = 1.0, weight_hard_loss: float = 0.0, ignore_index: int = -100,
                      reduction: str = "mean", layout: str = "vh", return_grads: Union[bool, Iterable[str]] = False,
                      grad_output=None, context: Optional[Context] = None, dtype: str = "fp32",
                      grad_dtype: Optional[str] = None) -> DistillResult:
    """Forward KL of the student's head towards a teacher given per token as its top-k token ids and log-probs (a
    vLLM server's answer), without the student's logits (include/fusedhead.h, "Top-k teacher distillation", has
    the formulas; TRL's ServerDistillationTrainer with loss_top_k = k, loss_add_tail = add_tail, beta 0). The
    teacher's log-probs are taken as given (its temperature already applied); only the student is tempered.

    hidden [..., H]; weight [V, H] ("vh") or [H, V] ("hv"); bias float32 [V]; teacher_ids int64 and
    teacher_logprobs float32, both [..., k] with the hidden's leading shape (or [N, k]), C-contiguous, a log-prob of
    -inf marking a padded entry (TRL's fill; its id is not read); targets int64 like the hidden's leading shape (or
    [N]), optional when weight_hard_loss is 0 (then every token counts); ignore_index tokens are left out and 'mean'
    divides by the tokens counted (a token with no valid entry adds 0 and counts). dtype, return_grads,
    grad_output, grad_dtype as distill_loss's. Returns a DistillResult (soft_loss the KL part, hard_loss the
    cross-entropy part).
    """
    opt = distill_topk_options(add_tail=add_tail, temperature=temperature, weight_soft_loss=weight_soft_loss,
                               weight_hard_loss=weight_hard_loss, ignore_index=ignore_index, reduction=reduction)
    red = Reduction(opt.reduction)
    if not return_grads and (grad_output is not None or grad_dtype is not None):
        raise ValueError("grad_output and grad_dtype are only used with return_grads")
    student = _BatchHead(hidden, weight, bias, dtype, grad_dtype, return_grads)
    x = _flatten_rows(student.hidden, "hidden")
    n, token_shape = x.shape[0], tuple(student.hidden.shape[:-1])
    ids = _check_array(teacher_ids, "teacher_ids", np.int64, " (use .astype(np.int64))")
    lps = _check_array(teacher_logprobs, "teacher_logprobs", np.float32, _FP32_HINT)
    k = ids.shape[-1] if ids.ndim > 0 else 0
    if ids.shape != lps.shape or ids.shape[:-1] not in (token_shape, (n,)):
        raise ValueError(f"teacher_ids {list(ids.shape)} and teacher_logprobs {list(lps.shape)}: expected both "
                         f"{list(token_shape) + ['k']} (the hidden's leading dimensions) or [{n}, k]")
    for name, a in (("teacher_ids", ids), ("teacher_logprobs", lps)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array (np.ascontiguousarray({name}))")
    tg = None
    if targets is not None:
        tg = _flatten_vector(_check_array(targets, "targets", np.int64, " (use .astype(np.int64))"), "targets",
                             token_shape, n, "the hidden's leading dimensions")
    g = None
    if student.dx is not None or student.dw is not None or student.db is not None:
        g = _distill_grad_output(grad_output, red, token_shape, n)
    per_token = np.zeros(n, np.float32)
    if n == 0:  # nothing to compute
        if student.dw is not None:
            student.dw[...] = 0
        loss = per_token.reshape(token_shape) if red == Reduction.NONE else 0.0
        return DistillResult(loss, 0.0, 0.0, per_token.reshape(token_shape), student.dx, student.dw, student.db)
    problem = DistillTopkProblem(student.linear(layout), _view(ids.reshape(n, k), "teacher_ids"),
                                 _view(lps.reshape(n, k), "teacher_logprobs"),
                                 None if tg is None else _view(tg, "targets"), opt)
    return _distill_run(problem, student, g, per_token, token_shape, red, context)
