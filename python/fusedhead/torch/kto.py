"""KTO (TRL KTOTrainer semantics: loss types kto and apo_zero_unpaired): fused_linear_kto_loss and
FusedLinearKTOLoss."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._core import KTO_METRIC_KEYS, Context, KTOProblem, kto_options, parse_layout
from ._ops import TrainStep, train_step
from ._tensors import (INT64_HINT, TorchLinear, address, bt_tensor, check_inputs, check_tensor, contiguous_vector,
                       fp32_operand, fp32_vector, is_fake, mask_tensor, metrics_dict, metrics_tensors, opt_view, scalar,
                       sequence_rows, view)

_ARGS = (("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor", "targets"), ("Tensor", "mask"), ("Tensor", "labels"),
         ("Tensor?", "bias"), ("Tensor?", "ref_logps"), ("Tensor?", "ref_per_token_logps"), ("Tensor?", "kl_tensor"),
         ("Tensor?", "kl_logratios"), ("Tensor?", "cu_seqlens"), ("str", "layout"), ("float?", "kl"),
         ("str", "loss_type"), ("float", "beta"), ("float", "desirable_weight"), ("float", "undesirable_weight"))


class _KTO:
    """Everything one KTO call needs, checked and in library form. targets int64 [B, T]; hidden [B, T, H] or
    [B*T, H]; mask [B, T] (bool, integer or floating: converted to float32); labels [B] (bool or integer 0 / 1:
    converted to uint8); the reference ref_logps [B] or ref_per_token_logps [B, T]; kto's KL term kl (a number) or
    kl_tensor (one element) or kl_logratios [B]; float32 values (bfloat16 too with bfloat16 inputs: converted).
    Packed: cu_seqlens [B + 1], hidden [N, H] or [1, N, H] and the per-token tensors of hidden's leading shape."""

    def __init__(self, a: dict):
        hidden, targets, labels = a["hidden"], a["targets"], a["labels"]
        dtype = check_inputs(hidden, a["weight"])
        check_tensor(targets, "targets", torch.int64, INT64_HINT)
        self.cu_seqlens = None
        if a["cu_seqlens"] is None:
            if targets.dim() != 2 or 0 in targets.shape:
                raise ValueError(f"targets: expected [B, T] with B, T >= 1, got shape {list(targets.shape)}")
            b, t = int(targets.shape[0]), int(targets.shape[1])
            if tuple(hidden.shape[:-1]) not in ((b, t), (b * t,)):
                raise ValueError(f"hidden: expected [B, T, H] = [{b}, {t}, H] or [B*T, H] = [{b * t}, H] (targets "
                                 f"are [B, T] = {[b, t]}), got shape {list(hidden.shape)}")
            bt, dims = (b, t), dict(dims="[B, T]", source="the targets' shape")
        else:
            packed = sequence_rows(hidden, a["cu_seqlens"], "B")
            b, t, bt, self.cu_seqlens, dims = packed.sequences, 0, packed.token_shape, packed.cu_seqlens, dict(
                dims=packed.dims)
        self.lin = TorchLinear(hidden, a["weight"], a["bias"], a["layout"])
        self.batch, n = b, self.lin.n
        self.targets = bt_tensor(targets, "targets", torch.int64, bt, n, **dims)
        self.mask = mask_tensor(a["mask"], "mask", bt, n, **dims)
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"labels: expected a bool or integer torch.Tensor, got "
                            f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if tuple(labels.shape) != (b,):
            raise ValueError(f"labels: expected shape [B] = [{b}], got {list(labels.shape)}")
        # the values are data: checked when they exist (not while tracing)
        if labels.dtype != torch.bool and not is_fake(labels) and bool(((labels != 0) & (labels != 1)).any()):
            raise ValueError("labels: expected 0 (undesirable) or 1 (desirable) in every entry")
        self.labels = contiguous_vector(labels.detach().to(torch.uint8))
        ref_logps, ref_per_token_logps = a["ref_logps"], a["ref_per_token_logps"]
        self.ref_logps = None if ref_logps is None else fp32_vector(ref_logps, "ref_logps", dtype, b, "[B]")
        self.ref_per_token_logps = None if ref_per_token_logps is None else bt_tensor(
            fp32_operand(ref_per_token_logps, "ref_per_token_logps", dtype), "ref_per_token_logps", torch.float32,
            bt, n, **dims)
        kl, kl_tensor = a["kl"], a["kl_tensor"]
        self.kl = (kl_tensor.reshape(1).to(torch.float32).contiguous() if kl_tensor is not None else
                   None if kl is None else torch.tensor([kl], dtype=torch.float32))
        kl_logratios = a["kl_logratios"]
        self.kl_logratios = None if kl_logratios is None else fp32_vector(kl_logratios, "kl_logratios", dtype, b,
                                                                          "[B]")
        self.problem = KTOProblem(self.lin.head, b, t, view(self.targets), view(self.mask), view(self.labels),
                                  opt_view(self.ref_logps), opt_view(self.ref_per_token_logps),
                                  opt_view(self.kl), opt_view(self.kl_logratios),
                                  kto_options(loss_type=a["loss_type"], beta=a["beta"],
                                              desirable_weight=a["desirable_weight"],
                                              undesirable_weight=a["undesirable_weight"]),
                                  opt_view(self.cu_seqlens))


def _run(a: dict, need, context: Optional[Context]):
    """(loss, metrics float64 [9] in fh_kto_metrics order, sequence log-probs [B], rewards [B]), the gradients of
    the loss."""
    k = _KTO(a)
    logps = torch.zeros(k.batch, dtype=torch.float32)
    rewards = torch.zeros(k.batch, dtype=torch.float32)
    result, grads = train_step(k.problem, k.lin, context, need, sequence_logps=address(logps),
                               rewards=address(rewards))
    loss, m = result if result is not None else (None, None)
    return (scalar(loss, k.lin.dtype), *metrics_tensors(m, KTO_METRIC_KEYS), logps, rewards), grads


_KTO_STEP = TrainStep("kto", _ARGS, 5, _run, "fh_kto")


class KTOLossOutput(NamedTuple):
    """loss: a scalar in the inputs' dtype, differentiable; metrics: TRL's logged keys -> floats, only those TRL
    logs for the batch (under torch.compile 0-d tensors, every key present, NaN where TRL logs nothing);
    logps, rewards: float32 [B], detached: the sequence log-probs l and TRL's rewards."""
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
                          layout: str = "vh", context: Optional[Context] = None,
                          cu_seqlens: Optional[torch.Tensor] = None) -> KTOLossOutput:
    """TRL's KTO loss (KTOTrainer, loss_type "kto" or "apo_zero_unpaired") from the hidden states of B sequences
    and the lm_head weight, without the [B*T, V] logits.

    hidden [B, T, H] or [B*T, H] (position t predicts targets[b, t]); targets int64 [B, T]; mask [B, T], the
    completion mask (targets where it is 0 may be anything); labels [B], True / 1 for a desirable sequence. The
    reference model's log-probs: ref_logps [B] (summed over the completion) or ref_per_token_logps [B, T], exactly
    one. kto's KL term (TRL computes it from mismatched completions, without gradient): kl, the value as TRL uses
    it (already clamped at 0), or kl_logratios [B], each sequence's KL completion log-prob under the policy minus
    the reference's (e.g. from fused_linear_logprobs under torch.no_grad()), of which the head takes
    max(mean, 0); apo_zero_unpaired takes neither. cu_seqlens (int32 or int64 [B + 1]): packed sequences, hidden
    [N, H] or [1, N, H] and targets, mask and ref_per_token_logps of hidden's leading shape; the results equal the
    padded [B, T] call's. include/fusedhead.h has the formulas. Returns (loss, metrics,
    logps, rewards), a KTOLossOutput: metrics with TRL's keys "kl", "rewards/chosen", "rewards/rejected",
    "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy" (those
    TRL logs for the batch).
    """
    kl_tensor = None
    if isinstance(kl, torch.Tensor):  # read by the op, not by the trace
        if kl.numel() != 1:
            raise ValueError(f"kl: expected a number or a one-element tensor, got shape {list(kl.shape)}")
        kl_tensor, kl = kl.detach(), None
    value, metrics, present, logps, rewards = _KTO_STEP(
        context, hidden=hidden, weight=weight, targets=targets, mask=mask, labels=labels, bias=bias,
        ref_logps=ref_logps, ref_per_token_logps=ref_per_token_logps, kl_tensor=kl_tensor,
        kl_logratios=kl_logratios, cu_seqlens=cu_seqlens, layout=layout, kl=kl, loss_type=loss_type, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    return KTOLossOutput(value, metrics_dict(KTO_METRIC_KEYS, metrics, present), logps, rewards)


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
                kl_logratios: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> KTOLossOutput:
        return fused_linear_kto_loss(hidden, weight, targets, mask, labels, bias=bias, ref_logps=ref_logps,
                                     ref_per_token_logps=ref_per_token_logps, kl=kl, kl_logratios=kl_logratios,
                                     layout=self.layout, context=self.context, cu_seqlens=cu_seqlens, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"
