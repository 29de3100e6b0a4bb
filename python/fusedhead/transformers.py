"""Hugging Face transformers causal LMs whose training loss goes through fusedhead: no [N, V] logits.

    import fusedhead.transformers
    model = fusedhead.transformers.patch(AutoModelForCausalLM.from_config(config))   # in place; returns the model
    Trainer(model=model, ...).train()       # model(input_ids, labels=labels).loss: causal_lm_loss, logits None

What patch does (tested with transformers 5.24.0; the seams it uses exist since 4.46, when `loss_function` came):
the model gets an instance `forward` that, when the model is training and labels are given (or when the caller passes
`skip_logits=True`, Liger's and the Trainer's name), runs the model's own forward with two things swapped for the
length of that call:
  - `model.lm_head`'s forward: it keeps the hidden states it is given (already sliced by `logits_to_keep`) and returns
    a 3-value probe instead of logits;
  - `model.loss_function` (transformers' per-instance loss seam, `PreTrainedModel.loss_function` in
    modeling_utils.py): fusedhead.torch.causal_lm_loss on the kept hidden states and the head's weight (and bias),
    with the labels, `num_items_in_batch`, `ignore_index` and `shift_labels` that the model passes to it, as
    `ForCausalLMLoss` (transformers/loss/loss_utils.py) takes them.
Whatever the model does between its head and its loss (Gemma 2/3's final softcapping, Cohere's `logit_scale`,
Granite's division by `logits_scaling`) runs on the probe; the loss checks that the probe came out as the model
family's known transform (this module's table, _FAMILIES) would make it, and raises otherwise: a model that scales or
caps its logits never gets the plain loss. The result is the model's own output class with `logits=None`.
Evaluation (`model.eval()`), calls without labels, and generation run the model's forward untouched.

Why not transformers' own fused-loss slot: in transformers 5.24.0 the "ForCausalLMLoss" entry of the kernel mapping
(integrations/hub_kernels.py, `use_kernels` / `KernelConfig`) is CUDA-only, needs the `kernels` package and a Hub
download, and no model class routes its loss through it: every causal LM computes `logits = self.lm_head(hidden)`
and passes the logits to `self.loss_function`. So the hidden states are reachable only around the head, as above.
Replacing `LOSS_MAPPING["ForCausalLM"]` would also change the Trainer's token count for `num_items_in_batch`
(trainer.py's `_loss_shifts_labels` compares that entry with `ForCausalLMLoss`), so patch never touches it.

Routing is loud: what cannot go through fusedhead (a model class not in the table, a head that is not a plain
`nn.Linear` or PEFT's `ModulesToSaveWrapper` around one, hooks on the head, a custom loss function, a vocabulary size
that differs from the head's, hidden states on another device or in float16, an option that reaches the loss and that
`ForCausalLMLoss` ignores) warns once per model and reason (`RoutingWarning`, naming the model class and the
reason) and keeps transformers' own path; `strict=True` raises `NotRoutedError` instead.

Autocast: under CPU autocast to bfloat16 (the Trainer's `bf16=True` on CPU) the head's weight and the hidden states
are cast to bfloat16, as autocast's `linear` does, and the loss is float32 as transformers' (which upcasts the
logits). PEFT: LoRA on `lm_head` is refused (the adapter's dropout acts on the head's input); `ModulesToSaveWrapper`
works, the gradient reaching the active adapter's copy of the head.
"""
from __future__ import annotations

import functools
import inspect
import types
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .torch import causal_lm_loss
from .torch._tensors import compiling

__all__ = ["patch", "unpatch", "is_patched", "RoutingWarning", "NotRoutedError", "SUPPORTED_MODELS"]

TESTED_TRANSFORMERS = "5.24.0"


class RoutingWarning(UserWarning):
    """A model, head, option or call that does not go through fusedhead; transformers' own loss runs instead."""


class NotRoutedError(RuntimeError):
    """patch(..., strict=True): what would have been a RoutingWarning."""


@dataclass(frozen=True)
class _Head:
    """What a family does to lm_head's output before the loss: logits = softcap(logit_scale * (x W^T + b))."""
    logit_scale: Optional[float] = None
    softcap: Optional[float] = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _plain(model) -> _Head:
    return _Head()


def _gemma_softcap(model) -> _Head:
    # Gemma2ForCausalLM / Gemma3ForCausalLM.forward: logits / c, tanh, * c when config.final_logit_softcapping is set
    return _Head(softcap=getattr(model.config, "final_logit_softcapping", None))


def _cohere(model) -> _Head:
    # CohereForCausalLM.forward: logits * self.logit_scale (config.logit_scale)
    return _Head(logit_scale=float(model.logit_scale))


def _granite(model) -> _Head:
    # GraniteForCausalLM.forward: logits / config.logits_scaling
    return _Head(logit_scale=1.0 / float(model.config.logits_scaling))


# Model classes (transformers' names) whose forward is body -> lm_head -> elementwise transform -> loss_function, and
# the transform, read from transformers 5.24.0's modeling_<family>.py.
_FAMILIES: dict[str, Callable] = {
    "LlamaForCausalLM": _plain, "MistralForCausalLM": _plain, "Qwen2ForCausalLM": _plain,
    "Qwen3ForCausalLM": _plain, "GemmaForCausalLM": _plain, "PhiForCausalLM": _plain,  # Phi: lm_head has a bias
    "GPT2LMHeadModel": _plain,  # tied to transformer.wte
    "Gemma2ForCausalLM": _gemma_softcap, "Gemma3ForCausalLM": _gemma_softcap,
    "CohereForCausalLM": _cohere, "GraniteForCausalLM": _granite,
}
SUPPORTED_MODELS = tuple(sorted(_FAMILIES))

# What reaches ForCausalLMLoss and is read by it; the rest of TransformersKwargs is for the body, and ForCausalLMLoss
# drops anything else (fixed_cross_entropy's **kwargs): such an option is reported, not silently dropped.
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# The 3 probe values (exact in bf16) the head returns in place of logits.
_PROBE = (-3.0, 0.5, 2.0)
# What a compiled model's probe check says (a traced check's message cannot be formatted at run time).
_UNKNOWN_TRANSFORM = ("fusedhead.transformers: the model transformed its logits in a way fusedhead does not know (its "
                      "probe did not come out as the family's transform makes it); unpatch the model "
                      "(fusedhead.transformers.unpatch)")


def _transformers_kwarg_names() -> frozenset:
    try:
        from transformers.utils.generic import TransformersKwargs
        return frozenset(getattr(TransformersKwargs, "__annotations__", {}))
    except ImportError:  # pragma: no cover - older transformers
        return frozenset()


class _State:
    """One patched model's routing state: the family, strictness, reasons already warned, and the current call's
    captured hidden states."""

    def __init__(self, family: str, strict: bool, original_forward, had_forward: bool, labels_position: Optional[int]):
        self.family, self.strict = family, strict
        self.original_forward, self.had_forward = original_forward, had_forward
        self.labels_position = labels_position  # labels' index among the forward's positional parameters
        self.known_kwargs = _transformers_kwarg_names() | frozenset(_LOSS_KWARGS)  # what the loss may be passed
        self.warned: set = set()
        self.reset()

    def reset(self):
        self.hidden = None
        self.head_calls = 0
        self.loss_calls = 0
        self.stock = False
        self.linear = None
        self.dtype = None


def _refuse(state_or_strict, model_name: str, reason: str, warned: Optional[set] = None):
    strict = state_or_strict.strict if isinstance(state_or_strict, _State) else state_or_strict
    if warned is None and isinstance(state_or_strict, _State):
        warned = state_or_strict.warned
    message = f"fusedhead.transformers: {model_name}: {reason}"
    if strict:
        raise NotRoutedError(message)
    if warned is None or reason not in warned:
        if warned is not None:
            warned.add(reason)
        warnings.warn(message + "; transformers' own loss runs instead", RoutingWarning, stacklevel=4)


def _unwrap_peft(model):
    """The transformers model inside a PEFT PeftModel (get_base_model), else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__name__.startswith("Peft"):
        return get_base()
    return model


def _family(model) -> tuple:
    """(family name, reason it is refused or None). A subclass counts as its transformers base class only when it
    does not override forward."""
    for cls in type(model).__mro__:
        if cls.__name__ in _FAMILIES and cls.__module__.startswith("transformers."):
            if type(model).forward is not cls.forward:
                return None, (f"{type(model).__name__} overrides the forward of {cls.__name__}, so its head and loss "
                              "are unknown to fusedhead")
            return cls.__name__, None
    return None, (f"{type(model).__name__} is not a model class whose head fusedhead knows (supported: "
                  f"{', '.join(SUPPORTED_MODELS)})")


def _head_linear(head) -> tuple:
    """(the nn.Linear that computes the logits now, or None, reason). Accepts a plain nn.Linear and PEFT's
    ModulesToSaveWrapper around one (its active adapter's copy, or the original when adapters are off)."""
    kind = type(head).__name__
    if type(head) is torch.nn.Linear:
        linear = head
    elif kind == "ModulesToSaveWrapper":
        active = list(getattr(head, "active_adapters", []) or [])
        if head.disable_adapters or not active or any(a not in head._adapters for a in active):
            linear = head.original_module
        else:
            linear = head.modules_to_save[active[0]]
        if type(linear) is not torch.nn.Linear:
            return None, f"lm_head is a ModulesToSaveWrapper around a {type(linear).__name__}, not an nn.Linear"
    elif hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        return None, (f"lm_head is PEFT's {type(head).__module__}.{kind} (LoRA or another adapter on the head), "
                      "which fusedhead does not support: leave lm_head out of target_modules (modules_to_save "
                      "works) or merge the adapter first")
    else:
        return None, f"lm_head is a {type(head).__module__}.{kind}, not a plain torch.nn.Linear"
    for module in {id(head): head, id(linear): linear}.values():
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return None, "lm_head has forward hooks (or an accelerate hook), which the fused loss would skip"
    return linear, None


def _loss_function_reason(model) -> Optional[str]:
    from transformers.loss.loss_utils import ForCausalLMLoss
    current = getattr(model, "_loss_function", None)
    if current is None:
        loss_type = getattr(model, "loss_type", None)
        from transformers.loss.loss_utils import LOSS_MAPPING
        current = LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM")
        if current is not ForCausalLMLoss:
            return f"loss_type {loss_type!r} maps to {getattr(current, '__name__', current)}, not ForCausalLMLoss"
    elif current is not ForCausalLMLoss:
        return f"model.loss_function was set to {getattr(current, '__name__', current)!r}, not ForCausalLMLoss"
    return None


def _static_reason(model, family: Optional[str]) -> Optional[str]:
    """Why this model cannot go through fusedhead as it stands now (None: it can)."""
    if family is None:
        return _family(model)[1]
    head = getattr(model, "lm_head", None)
    if head is None:
        return f"{type(model).__name__} has no lm_head"
    linear, reason = _head_linear(head)
    if reason:
        return reason
    if linear.out_features != model.config.vocab_size:
        return (f"lm_head has {linear.out_features} outputs but config.vocab_size is {model.config.vocab_size} "
                "(ForCausalLMLoss views the logits by config.vocab_size)")
    return _loss_function_reason(model)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype on device_type, or None when autocast is off there."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except TypeError:  # pragma: no cover - torch < 2.4
        if device_type != "cpu":
            return None
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return dtype if enabled else None


def _call_reason(hidden: torch.Tensor, linear: torch.nn.Linear) -> tuple:
    """(compute dtype, reason this call cannot go through fusedhead or None)."""
    if hidden.device.type != "cpu" or linear.weight.device.type != "cpu":
        return None, f"the hidden states are on {hidden.device} (fusedhead computes on CPU tensors)"
    dtype = _autocast_dtype("cpu")
    if dtype is not None and dtype != torch.bfloat16:
        return None, f"CPU autocast to {dtype} (fusedhead takes float32 or bfloat16)"
    if dtype is None:
        dtype = hidden.dtype
        if linear.weight.dtype != dtype:
            return None, f"hidden states in {hidden.dtype} and lm_head.weight in {linear.weight.dtype}"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"{dtype} hidden states (fusedhead takes float32 or bfloat16)"
    return dtype, None


def patch(model, strict: bool = False):
    """Make `model` (a transformers causal LM, or a PEFT model around one) compute its training loss through
    fusedhead.torch.causal_lm_loss, in place; returns `model`. See the module docstring for what changes and what
    does not. A model that cannot go through fusedhead is left as it is, with a RoutingWarning naming the model class
    and the reason (strict=True: NotRoutedError). Patching twice is a no-op (the strict setting is updated)."""
    inner = _unwrap_peft(model)
    state = getattr(inner, "_fusedhead_state", None)
    if state is not None:
        state.strict = strict
        return model
    family, reason = _family(inner)
    reason = reason or _static_reason(inner, family)
    if reason:
        _refuse(strict, type(inner).__name__, reason, warned=None)
        return model
    had_forward = "forward" in inner.__dict__
    original = inner.forward
    inner._fusedhead_state = _State(family, strict, original, had_forward, _labels_position(original))
    # A method bound to this instance, and its state an attribute of it: copy.deepcopy of the patched model (a reference
    # model, an EMA copy) rebinds both to the copy, whose forward then runs the copy's own weights.
    inner.forward = types.MethodType(_patched_forward(original), inner)
    return model


def _patched_forward(original):
    """A function for patch to bind to the model: _fused_forward under the original forward's name, docstring and
    signature (with self first, which binding drops), which transformers' Trainer reads to keep its input columns."""
    def forward(self, *args, **kwargs):
        return _fused_forward(self, *args, **kwargs)

    forward.__name__, forward.__qualname__, forward.__doc__ = "forward", "forward", original.__doc__
    signature = inspect.signature(original)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    return forward


def _head_forward(inner, state: _State, linear_forward, hidden, *args, **kwargs):
    """lm_head during a fused call: keep the hidden states, return the probe (or the logits, when this call
    cannot go through fusedhead)."""
    state.head_calls += 1
    linear = state.linear
    if state.head_calls > 1 or args or kwargs:
        raise RuntimeError(f"fusedhead.transformers: {type(inner).__name__} called lm_head twice or with extra "
                           "arguments in one forward; unpatch the model (fusedhead.transformers.unpatch)")
    dtype, why = _call_reason(hidden, linear)
    if why:
        _refuse(state, type(inner).__name__, why)
        state.stock = True
        return linear_forward(hidden)
    state.hidden, state.dtype = hidden, dtype
    return torch.tensor(_PROBE, dtype=dtype, device=hidden.device).view(1, 1, len(_PROBE))


def _loss_function(inner, state: _State, logits=None, labels=None, vocab_size=None, num_items_in_batch=None,
                   ignore_index=-100, shift_labels=None, **kwargs):
    state.loss_calls += 1
    from transformers.loss.loss_utils import ForCausalLMLoss
    if state.stock or state.hidden is None or state.loss_calls > 1:
        if state.hidden is not None:  # the probe reached a second loss call: nothing sane to return
            raise RuntimeError(f"fusedhead.transformers: {type(inner).__name__} called its loss function "
                               "twice in one forward; unpatch the model (fusedhead.transformers.unpatch)")
        if not state.stock:
            _refuse(state, type(inner).__name__, "lm_head was not called before the loss (was it replaced?)")
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
                               **kwargs)
    spec = _FAMILIES[state.family](inner)
    probe = torch.tensor(_PROBE, dtype=torch.float64)
    want = spec.apply(probe.to(state.dtype)).double()
    got = logits.detach().double().reshape(-1) if torch.is_tensor(logits) else None
    tol = 1e-2 if state.dtype == torch.bfloat16 else 1e-5
    if compiling() and got is not None and got.shape == want.shape:  # checked when the graph runs, not traced
        torch._assert_async(torch.isclose(got, want, rtol=tol, atol=tol).all(), _UNKNOWN_TRANSFORM)
    elif got is None or got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
        raise RuntimeError(
            f"fusedhead.transformers: {type(inner).__name__} transformed its logits in a way fusedhead does not "
            f"know (a probe {list(_PROBE)} came out as {None if got is None else got.tolist()}, expected "
            f"{want.tolist()} from {spec}); unpatch the model (fusedhead.transformers.unpatch)")
    unknown = sorted(set(kwargs) - state.known_kwargs)
    if unknown:
        _refuse(state, type(inner).__name__,
                f"option(s) {', '.join(unknown)} reach ForCausalLMLoss, which ignores them (fusedhead would too)")
    linear = state.linear
    weight, bias = linear.weight, linear.bias
    hidden = state.hidden
    if state.dtype == torch.bfloat16:
        hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
        bias = None if bias is None else bias.to(torch.bfloat16)
    if vocab_size is not None and vocab_size != weight.shape[0]:
        raise RuntimeError(f"fusedhead.transformers: vocab_size {vocab_size} != lm_head's {weight.shape[0]}")
    with _autocast_off():
        return causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels,
                              final_logit_softcapping=spec.softcap, logit_scale=spec.logit_scale, bias=bias)


def _fused_forward(inner, *args, **kwargs):
    """The patched model's forward (bound to it as a method, see patch)."""
    state = inner._fusedhead_state
    original = state.original_forward
    skip_logits = kwargs.pop("skip_logits", None)
    labels = kwargs.get("labels")
    if labels is None and state.labels_position is not None and len(args) > state.labels_position:
        labels = args[state.labels_position]
    fused = (inner.training and labels is not None) if skip_logits is None else bool(skip_logits)
    if not fused:
        return original(*args, **kwargs)
    if labels is None:
        raise ValueError("fusedhead.transformers: skip_logits=True needs labels")
    reason = _static_reason(inner, state.family)
    if reason:
        _refuse(state, type(inner).__name__, reason)
        return original(*args, **kwargs)
    head = inner.lm_head
    state.reset()
    state.linear, _ = _head_linear(head)
    previous_loss = inner.__dict__.get("_loss_function")
    head_had_forward = "forward" in head.__dict__
    head.forward = functools.partial(_head_forward, inner, state, head.forward)
    inner._loss_function = functools.partial(_loss_function, inner, state)
    try:
        out = original(*args, **kwargs)
    finally:
        if head_had_forward:
            head.forward = head.forward.args[2]  # the head's own forward, after inner and state
        else:
            del head.forward
        if previous_loss is not None:  # a user-set ForCausalLMLoss (_static_reason refuses any other)
            inner._loss_function = previous_loss
        else:
            del inner._loss_function
        fused_call = not state.stock and state.hidden is not None
        state.reset()
    if not fused_call:
        return out
    return _without_logits(out)


class _autocast_off:
    """CPU autocast off inside the fused loss (its inputs are already in the dtype autocast would use). A class of its
    own rather than torch.autocast itself: torch.compile does not trace this __enter__ and breaks its graph here,
    where with torch.autocast it traced on into forward's swapping of lm_head.forward and failed on the swap's undo
    (torch 2.13, transformers 5.24.0; python/tests/test_transformers.py compiles a patched model)."""

    def __enter__(self):
        self._ctx = torch.autocast("cpu", enabled=False)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _labels_position(forward) -> Optional[int]:
    """labels' index among forward's positional parameters (a bound method's), or None."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover
        return None
    for i, p in enumerate(params):
        if p.name == "labels" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def _without_logits(out):
    """The model's output with logits None (the probe dropped): a ModelOutput of the same class, or the tuple of
    return_dict=False without its logits entry (index 1, after the loss)."""
    if isinstance(out, tuple):
        return out[:1] + out[2:]
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})


def is_patched(model) -> bool:
    return getattr(_unwrap_peft(model), "_fusedhead_state", None) is not None


def unpatch(model):
    """Undo patch(model); returns the model."""
    inner = _unwrap_peft(model)
    state = getattr(inner, "_fusedhead_state", None)
    if state is None:
        return model
    if state.had_forward:
        inner.forward = state.original_forward
    else:
        del inner.forward
    del inner._fusedhead_state
    return model
