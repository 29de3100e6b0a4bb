"""Cross-entropy: fused_linear_cross_entropy, FusedLinearCrossEntropy, and Hugging Face's causal-LM loss
(causal_lm_loss)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._core import CEProblem, Context, View, default_context, parse_layout, parse_reduction
from .._lib import Reduction
from ._ops import SplitStep, TrainStep, train_step
from ._tensors import (INT64_HINT, TorchLinear, address, check_tensor, contiguous_vector, fp32_operand, opt_view,
                       scalar, token_vector, view)

_ARGS = (("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor", "targets"), ("Tensor?", "bias"),
         ("Tensor?", "class_weights"), ("int", "ignore_index"), ("str", "reduction"), ("float", "label_smoothing"),
         ("float?", "softcap"), ("float", "z_loss"), ("float?", "logit_scale"), ("bool", "token_scaling"),
         ("str", "layout"), ("bool", "float32_loss"), ("bool", "want_entropy"), ("bool", "want_correct"))


class _CE:
    """Everything one cross-entropy call needs, checked and in library form, from the ops' arguments by name. The
    losses come back in the inputs' dtype, or in float32 with float32_loss (as Hugging Face's loss, which upcasts
    the logits)."""

    def __init__(self, a: dict):
        self.lin = TorchLinear(a["hidden"], a["weight"], a["bias"], a["layout"])
        check_tensor(a["targets"], "targets", torch.int64, INT64_HINT)
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = token_vector(a["targets"], "targets", self.token_shape, self.lin.n,
                                    "hidden's leading dimensions")
        class_weights = a["class_weights"]
        if class_weights is not None:
            class_weights = contiguous_vector(fp32_operand(class_weights, "class_weights", self.lin.dtype).detach())
        self.class_weights = class_weights
        self.reduction = parse_reduction(a["reduction"])
        self.ignore_index, self.z_loss, self.token_scaling = a["ignore_index"], a["z_loss"], a["token_scaling"]
        self.loss_dtype = torch.float32 if a["float32_loss"] else self.lin.dtype
        # N = 0: a placeholder of the 1-row head's size, for the shape checks only (the library is not called)
        targets_view = view(self.targets) if self.lin.n > 0 else View(0, (1,), (1,))
        self.problem = CEProblem(self.lin.head, targets_view, ignore_index=a["ignore_index"],
                                 reduction=self.reduction, label_smoothing=a["label_smoothing"],
                                 class_weights=opt_view(class_weights),
                                 softcap=0.0 if a["softcap"] is None else a["softcap"], z_loss=a["z_loss"],
                                 logit_scale=a["logit_scale"], token_scaling=a["token_scaling"])
        # the optional outputs, zero-filled (empty when not asked for): the entropy (float32, the targets' shape,
        # 0 where ignored) and the correct count (an int64 scalar); no gradient flows through them
        self.entropy = torch.zeros(self.token_shape if a["want_entropy"] else (0,), dtype=torch.float32)
        self.correct = torch.zeros(() if a["want_correct"] else (0,), dtype=torch.int64)
        self.extras = {name: address(t) for name, t, wanted in (("entropy", self.entropy, a["want_entropy"]),
                                                                ("correct", self.correct, a["want_correct"]))
                       if wanted}

    def per_token_z(self, lse: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """z_loss * lse^2 per token (0 where ignored), times DFT's p_y = exp(logp) with token_scaling, from the
        forward's fp32 lse and log-probs."""
        zl = self.z_loss * lse * lse * (torch.exp(logp) if self.token_scaling else 1.0)
        return torch.where(self.targets != self.ignore_index, zl,
                           torch.zeros((), dtype=lse.dtype)).view(self.token_shape).to(self.loss_dtype)


def _train(a: dict, need, context: Optional[Context]):
    """'mean'/'sum': (loss, z_loss, entropy, correct), the gradients of loss (upstream 1)."""
    ce = _CE(a)
    result, grads = train_step(ce.problem, ce.lin, context, need, **ce.extras)
    loss, z = result if result is not None else (0.0, 0.0)
    return (scalar(loss, ce.loss_dtype), scalar(z, ce.loss_dtype), ce.entropy, ce.correct), grads


def _forward_none(a: dict, context: Optional[Context]):
    """'none': (per-token loss, per-token z-loss, lse [N] for the backward, entropy, correct)."""
    ce = _CE(a)
    per_token, lse, logp = (torch.zeros(ce.lin.n, dtype=torch.float32) for _ in range(3))
    if ce.lin.computes:
        ce.problem.forward(context or default_context(), per_token_loss=per_token.data_ptr(), lse=lse.data_ptr(),
                           per_token_logp=logp.data_ptr(), **ce.extras)
    return (per_token.view(ce.token_shape).to(ce.loss_dtype), ce.per_token_z(lse, logp), lse, ce.entropy,
            ce.correct)


def _backward_none(a: dict, saved, upstream, need, context: Optional[Context]):
    """fh_ce_backward with the per-token upstream gradient. The library refuses a non-finite upstream value, so the
    binding passes 0 for it and makes that token's dx row and all of dweight and dbias NaN, as torch's NaN
    propagation does (X^T dZ and the column sums of dZ mix that row into all of them)."""
    ce = _CE(a)
    (lse,), (grad,) = saved, upstream
    dx, dw, db = ce.lin.alloc_grads(*need)
    if ce.lin.computes and grad is not None:
        g = token_vector(grad.to(torch.float32), "grad_output", ce.token_shape, ce.lin.n, "per token")
        finite = torch.isfinite(g)
        poisoned = not bool(finite.all())
        if poisoned:
            g = torch.where(finite, g, torch.zeros_like(g))
        ce.problem.backward(context or default_context(), lse.data_ptr(), g.data_ptr(), ce.lin.grads_struct(dx, dw, db))
        if poisoned:
            if dx is not None:
                dx.view(-1, dx.shape[-1])[~finite] = float("nan")
            for t in (dw, db):
                if t is not None:
                    t.fill_(float("nan"))
    return dx, dw, db


_CE_TRAIN = TrainStep("cross_entropy", _ARGS, 4, _train, "fh_ce")
_CE_NONE = SplitStep("cross_entropy_none", _ARGS, 5, differentiable=(0,), saved=(2,), forward=_forward_none,
                     backward=_backward_none, entry="fh_ce")


class CrossEntropyOutput(NamedTuple):
    """fused_linear_cross_entropy's result with return_entropy or return_correct: the loss, the z-loss part of it
    (detached), the per-token entropy of the softmax (float32, the targets' shape, 0 where ignored; None unless
    asked for) and the correct count (an int64 scalar: tokens, ignored ones aside, whose argmax is their target;
    None unless asked for). Neither has a gradient."""
    loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: Optional[torch.Tensor]
    correct: Optional[torch.Tensor]


def _cross_entropy(context: Optional[Context], **a):
    """(loss, z_loss, entropy, correct) through the 'mean'/'sum' train step or the 'none' pair."""
    if torch.is_grad_enabled() and isinstance(a["class_weights"], torch.Tensor) and a["class_weights"].requires_grad:
        raise ValueError("class_weights: gradients with respect to class weights are not supported "
                         "(torch's cross_entropy does not implement them either); pass class_weights.detach()")
    if a["reduction"] in ("none", Reduction.NONE):
        loss, z, _lse, entropy, correct = _CE_NONE(context, **a)
        return loss, z, entropy, correct
    return _CE_TRAIN(context, **a)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               class_weights: Optional[torch.Tensor] = None, softcap: Optional[float] = 0.0,
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
    loss, z, entropy, correct = _cross_entropy(
        context, hidden=hidden, weight=weight, targets=targets, bias=bias, class_weights=class_weights,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
        z_loss=z_loss, logit_scale=logit_scale, token_scaling=token_scaling, layout=layout, float32_loss=False,
        want_entropy=return_entropy, want_correct=return_correct)
    if return_entropy or return_correct:
        return CrossEntropyOutput(loss, z, entropy if return_entropy else None, correct if return_correct else None)
    return (loss, z) if return_z_loss else loss


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
        check_tensor(labels, "labels", torch.int64, INT64_HINT)
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss, _, _, _ = _cross_entropy(
        context, hidden=hidden_states, weight=lm_head_weight, targets=shift_labels, bias=bias, class_weights=None,
        ignore_index=ignore_index, reduction="mean" if num_items_in_batch is None else "sum", label_smoothing=0.0,
        softcap=final_logit_softcapping, z_loss=0.0, logit_scale=logit_scale, token_scaling=False, layout="vh",
        float32_loss=True, want_entropy=False, want_correct=False)
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
