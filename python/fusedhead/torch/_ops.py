"""How a head's library calls become differentiable torch operations.

On torch >= 2.4 each head is a `torch.library.custom_op` ("fusedhead::<name>") with a fake implementation and an
autograd formula, so that torch.compile traces it with no graph break and `torch.library.opcheck` can check it;
on older torch the same implementations run inside an `autograd.Function`. The fake implementation is the real
one run on fake tensors: every check raises while tracing as it does eagerly, and the outputs' shapes, strides
and dtypes are the real ones by construction (only the library call is skipped, `TorchLinear.computes`).

Two kinds of head:
  TrainStep  a scalar loss whose gradients for the inputs that need them come from the same library call
             (upstream gradient 1: 6 NHV flops instead of 8 for forward then backward); backward scales them by
             the incoming scalar.
  SplitStep  per-token outputs: the forward op's outputs include what backward needs, and a second op
             ("<name>_backward") calls the library with the per-token upstream gradients.

An op's arguments are tensors, options as Python values (float, int, bool, str: a trace specialises on them as
on any Python value, nothing is read with .item()), the Context as its integer key (0: the thread's default),
and for a TrainStep which of (hidden, weight, bias) need a gradient. A gradient that is not needed comes back from
an op as an empty tensor and from the front ends as None.
"""
from __future__ import annotations

import enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._core import Context, collective, context_by_key, default_context, int64
from ._tensors import DweightPool, TorchLinear, compiling, dweight_pool, is_fake

# torch.library.custom_op and register_autograd arrived in torch 2.4
TORCH_OPS = hasattr(torch, "library") and hasattr(torch.library, "custom_op")

# (schema type, name); types "Tensor", "float", "int", "bool", "str", "float[]", with "?": or None
Args = Sequence[Tuple[str, str]]
Grads = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


def _argument(kind: str, name: str, value):
    """An op argument as its schema type; TypeError naming it when it is not one."""
    if value is None and kind.endswith("?"):
        return None
    kind = kind.rstrip("?")
    if kind == "Tensor":
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if not compiling() and _is_dtensor(value):  # compiled, DTensor's own dispatch refuses the op
            raise TypeError(f"{name}: a DTensor (placements {list(value.placements)}): fusedhead.torch takes plain "
                            f"tensors, and would take a shard for the whole. A weight or bias sharded on the "
                            f"vocabulary (Shard(0) on a 1-D mesh) across ranks that hold the same tokens is taken as "
                            f"its shard with a fusedhead.distributed.Context whose layout's vocab_group is the mesh's "
                            f"process group (docs/mpi.md); for the whole tensor pass {name}.full_tensor()")
        return value
    if kind == "float":
        if isinstance(value, str):
            raise TypeError(f"{name}: expected a real number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a real number, got {value!r}") from None
    if kind == "int":
        return int64(name, value)
    if kind == "bool":
        if not isinstance(value, (bool, int, np.bool_)) or value not in (0, 1):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
        return bool(value)
    if kind == "str":
        if isinstance(value, enum.Enum):
            return value.name.lower()
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a string, got {value!r}")
        return value
    if kind == "float[]":
        if isinstance(value, (str, torch.Tensor)) or not hasattr(value, "__iter__"):
            raise TypeError(f"{name}: expected a sequence of numbers, got {value!r}")
        return [_argument("float", name, v) for v in value]
    raise ValueError(f"{name}: unknown schema type {kind!r}")


def _is_dtensor(t: torch.Tensor) -> bool:
    """A torch.distributed DTensor (torch >= 2.4), known without importing torch.distributed."""
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in type(t).__mro__)


def _values(args: Args, values: Dict[str, object], context: Optional[Context]) -> List[object]:
    return [_argument(kind, name, _vocab_shard(name, values[name], context)) for kind, name in args]


def _vocab_shard(name: str, value, context: Optional[Context]):
    """value, or its local shard when it is a DTensor that the context's layout takes as this rank's vocabulary
    shard (fusedhead.distributed: a weight or bias sharded on the vocabulary over the layout's vocab group); its
    gradient then comes back to the DTensor through to_local's own."""
    if context is None or compiling() or not isinstance(value, torch.Tensor) or not _is_dtensor(value):
        return value
    shard = getattr(context, "vocab_shard", None)
    local = shard(name, value) if shard is not None else None
    return value if local is None else local


def _needs_grad(t) -> bool:
    return torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad


def context_key(context: Optional[Context]) -> int:
    return 0 if context is None else context.key


def refuse_double_backward() -> None:
    """The gradients are the library's numbers, not differentiable torch operations: a graph built on them
    (create_graph=True: gradient penalties, Hessian-vector products) would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError("fusedhead: double backward (create_graph=True) is not supported: the gradients come from "
                           "the library, not from differentiable torch operations")


def train_step(problem, lin: TorchLinear, context: Optional[Context], need: Sequence[bool], **outputs):
    """(the problem's result, (dx, dw, db)): its forward_backward with upstream gradient 1 into new buffers for the
    inputs in need, or its forward alone when none is; the result is None when the library is not called (no
    tokens, or a trace's fake tensors), the gradients then zero. outputs: the library's output addresses by name."""
    grads = lin.alloc_grads(*need)
    if not lin.computes:
        return None, grads
    ctx = context or default_context()
    if any(need):
        one = torch.ones(1, dtype=torch.float32)
        return problem.forward_backward(ctx, one.data_ptr(), lin.grads_struct(*grads), **outputs), grads
    return problem.forward(ctx, **outputs), grads


def _scaled(saved: Grads, grad_loss: torch.Tensor, pool: Optional[DweightPool]) -> Grads:
    """A train step's saved gradients (of the loss, upstream 1) times d(objective)/d(loss). Not in place: a retained
    graph's next backward needs them as they are. Eagerly, an upstream 1 returns them as they are and dweight's
    product goes to a pooled buffer; a trace multiplies always (the upstream value is not known). bf16 gradients were
    rounded in the forward, so their product is a second rounding (exact for a power of two)."""
    dx, dw, db = saved
    eager = type(grad_loss) is torch.Tensor and not compiling()
    if eager and bool(grad_loss == 1):
        return dx, dw, db
    dx, db = (None if t is None else t * grad_loss for t in (dx, db))  # NaN propagates, as in torch
    if dw is not None:
        out = pool.take(dw.shape, dw.stride(), dw.dtype) if eager and pool is not None else None
        dw = torch.mul(dw, grad_loss.to(dw.dtype), out=out) if out is not None else dw * grad_loss.to(dw.dtype)
    return dx, dw, db


def _no_zero_grads(ctx) -> None:
    """A train step's outputs other than the loss get no gradient, but autograd would hand backward a zero tensor for
    each (materialized grads): one of them is the saved dweight, so backward would start by filling a second
    weight-sized buffer (931 MB at V=151643 H=1536 in fp32) that it never reads. Backward runs only when the loss has
    a gradient, so grad_loss is always a tensor."""
    ctx.set_materialize_grads(False)


def _input_grads(positions: Sequence[int], grads: Grads, count: int) -> tuple:
    """Backward's result: dx, dw, db at the positions of hidden, weight and bias among count inputs, None elsewhere."""
    out: List[Optional[torch.Tensor]] = [None] * count
    for position, g in zip(positions, grads):
        out[position] = g
    return tuple(out)


def _schema(args: Args, extra: str, outputs: int) -> str:
    inputs = ", ".join(f"{kind} {name}" for kind, name in args)
    return f"({inputs}, {extra}) -> ({', '.join(['Tensor'] * outputs)})"


def _empty_if_none(grads: Grads) -> Tuple[torch.Tensor, ...]:
    return tuple(torch.empty(0) if g is None else g for g in grads)


def _register(name: str, schema: str, impl: Callable) -> Callable:
    """A custom op whose real and fake implementations are impl (which skips the library on fake tensors)."""
    op = torch.library.custom_op(f"fusedhead::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(impl)
    return op


class TrainStep:
    """A head whose loss's gradients come from its forward call. run(args by name, need (hidden, weight, bias),
    context) -> (outputs, (dx, dw, db)); outputs[0] is the differentiable loss, the rest are not
    differentiable. grad_args names the arguments that get dx, dw, db."""

    def __init__(self, name: str, args: Args, outputs: int, run: Callable, entry: str,
                 grad_args: Tuple[str, str, str] = ("hidden", "weight", "bias")):
        self.name, self.args, self.outputs, self.run, self.entry = name, tuple(args), outputs, run, entry
        self.names = [n for _, n in args]
        self.grad_positions = [self.names.index(a) for a in grad_args]
        self.op = self._register() if TORCH_OPS else None

    def _run(self, values: Sequence, need: Sequence[bool], context: Optional[Context]):
        function = f"{self.entry}_forward_backward" if any(need) else f"{self.entry}_forward"
        with collective(context, function):
            return self.run(dict(zip(self.names, values)), tuple(need), context)

    def __call__(self, context: Optional[Context] = None, **values) -> tuple:
        vals = _values(self.args, values, context)
        need = tuple(_needs_grad(vals[p]) for p in self.grad_positions)
        if self.op is not None:
            return tuple(self.op(*vals, context_key(context), *need))[:self.outputs]
        if any(need):
            return _LegacyTrain.apply(self, context, need, *vals)
        return self._run(vals, need, context)[0]

    def _register(self):
        def impl(*vals):
            *vals, key, need_x, need_w, need_b = vals
            outputs, grads = self._run(vals, (need_x, need_w, need_b), context_by_key(key))
            return (*outputs, *_empty_if_none(grads))

        op = _register(self.name, _schema(self.args, "int context, bool need_x, bool need_w, bool need_b",
                                          self.outputs + 3), impl)

        def setup_context(ctx, inputs, output):
            need = inputs[-3:]
            weight = inputs[self.grad_positions[1]]
            ctx.need = need
            ctx.pool = dweight_pool(weight) if need[1] and not is_fake(weight) else None
            ctx.save_for_backward(*output[-3:])
            ctx.mark_non_differentiable(*output[1:])
            _no_zero_grads(ctx)

        def backward(ctx, grad_loss, *_):
            refuse_double_backward()
            saved = tuple(g if n else None for g, n in zip(ctx.saved_tensors, ctx.need))
            return _input_grads(self.grad_positions, _scaled(saved, grad_loss, ctx.pool), len(self.args) + 4)

        op.register_autograd(backward, setup_context=setup_context)
        return op


class _LegacyTrain(torch.autograd.Function):
    """TrainStep on torch < 2.4: apply(step, context, need, *values)."""

    @staticmethod
    def forward(ctx, step: TrainStep, context, need, *vals):
        outputs, grads = step._run(vals, need, context)
        ctx.step = step
        ctx.pool = dweight_pool(vals[step.grad_positions[1]]) if need[1] else None
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(*outputs[1:])
        _no_zero_grads(ctx)
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        refuse_double_backward()
        grads = _scaled(ctx.saved_tensors, grad_loss, ctx.pool)
        return (None, None, None) + _input_grads(ctx.step.grad_positions, grads, len(ctx.step.args))


class SplitStep:
    """A head with per-token outputs. forward(args by name, context) -> outputs; backward(args by name, the
    forward's outputs at saved, the upstream gradients of the outputs at differentiable (None where unused), need
    (hidden, weight, bias), context) -> (dx, dw, db)."""

    def __init__(self, name: str, args: Args, outputs: int, differentiable: Sequence[int], saved: Sequence[int],
                 forward: Callable, backward: Callable, entry: str,
                 grad_args: Tuple[str, str, str] = ("hidden", "weight", "bias")):
        self.name, self.args, self.outputs, self.entry = name, tuple(args), outputs, entry
        self.differentiable, self.saved = tuple(differentiable), tuple(saved)
        self.forward, self.backward = forward, backward
        self.names = [n for _, n in args]
        self.tensor_positions = [i for i, (kind, _) in enumerate(args) if kind.startswith("Tensor")]
        self.grad_positions = [self.names.index(a) for a in grad_args]
        self.ops = self._register() if TORCH_OPS else None

    def _forward(self, vals: Sequence, context: Optional[Context]) -> tuple:
        with collective(context, f"{self.entry}_forward"):
            return tuple(self.forward(dict(zip(self.names, vals)), context))

    def _backward(self, vals: Sequence, saved: Sequence, upstream: Sequence, need: Sequence[bool],
                  context: Optional[Context]) -> Grads:
        with collective(context, f"{self.entry}_backward"):
            return self.backward(dict(zip(self.names, vals)), tuple(saved), tuple(upstream), tuple(need), context)

    def __call__(self, context: Optional[Context] = None, **values) -> tuple:
        vals = _values(self.args, values, context)
        if self.ops is not None:
            return tuple(self.ops[0](*vals, context_key(context)))
        if any(_needs_grad(vals[p]) for p in self.grad_positions):
            return _LegacySplit.apply(self, context, *vals)
        return self._forward(vals, context)

    def _restore(self, saved_tensors: Sequence[torch.Tensor], values: Sequence) -> Tuple[list, tuple]:
        """The forward's argument values (tensors from saved_tensors, the rest as kept) and its saved outputs."""
        vals = list(values)
        for i, position in enumerate(self.tensor_positions):
            vals[position] = saved_tensors[i]
        return vals, tuple(saved_tensors[len(self.tensor_positions):])

    def _keep(self, ctx, vals: Sequence, output: Sequence) -> None:
        ctx.values = [None if i in self.tensor_positions else v for i, v in enumerate(vals)]
        ctx.save_for_backward(*(vals[p] for p in self.tensor_positions), *(output[i] for i in self.saved))
        ctx.mark_non_differentiable(*(o for i, o in enumerate(output) if i not in self.differentiable))
        ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None, the library's NULL

    def _register(self):
        step = self

        def forward_impl(*vals):
            *vals, key = vals
            return step._forward(vals, context_by_key(key))

        saved_args = ", ".join(f"Tensor saved{i}" for i in range(len(self.saved)))
        grad_args = ", ".join(f"Tensor? grad{i}" for i in range(len(self.differentiable)))
        count = len(self.args)

        def backward_impl(*vals):
            args = vals[:count]
            saved = vals[count:count + len(step.saved)]
            upstream = vals[count + len(step.saved):count + len(step.saved) + len(step.differentiable)]
            key, need_x, need_w, need_b = vals[-4:]
            need = (need_x, need_w, need_b)
            return _empty_if_none(step._backward(args, saved, upstream, need, context_by_key(key)))

        forward_op = _register(self.name, _schema(self.args, "int context", self.outputs), forward_impl)
        extra = ", ".join(a for a in (saved_args, grad_args) if a)
        backward_op = _register(f"{self.name}_backward",
                                _schema(self.args, f"{extra}, int context, bool need_x, bool need_w, bool need_b", 3),
                                backward_impl)

        def setup_context(ctx, inputs, output):
            *vals, key = inputs
            ctx.key = key
            step._keep(ctx, vals, output)

        def backward(ctx, *grads):
            refuse_double_backward()
            vals, saved = step._restore(ctx.saved_tensors, ctx.values)
            need = tuple(bool(ctx.needs_input_grad[p]) for p in step.grad_positions)
            upstream = [grads[i] for i in step.differentiable]
            result = backward_op(*vals, *saved, *upstream, ctx.key, *need)
            return _input_grads(step.grad_positions, tuple(g if n else None for g, n in zip(result, need)), count + 1)

        forward_op.register_autograd(backward, setup_context=setup_context)
        return forward_op, backward_op


class _LegacySplit(torch.autograd.Function):
    """SplitStep on torch < 2.4: apply(step, context, *values)."""

    @staticmethod
    def forward(ctx, step: SplitStep, context, *vals):
        output = step._forward(vals, context)
        ctx.step, ctx.context = step, context
        step._keep(ctx, vals, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward()
        step = ctx.step
        vals, saved = step._restore(ctx.saved_tensors, ctx.values)
        need = tuple(bool(ctx.needs_input_grad[2 + p]) for p in step.grad_positions)
        upstream = [grads[i] for i in step.differentiable]
        result = step._backward(vals, saved, upstream, need, ctx.context)
        return (None, None) + _input_grads(step.grad_positions, result, len(step.args))
