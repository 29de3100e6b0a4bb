"""Preference heads: DPO, ORPO, SimPO, CPO (TRL DPOTrainer, ORPOTrainer, CPOTrainer semantics):
fused_linear_preference_loss and its nn.Module forms."""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Sequence

import torch

from .._core import (PREFERENCE_METRIC_KEYS, Context, PreferenceProblem, pairs_shape, parse_layout,
                     preference_options)
from ._ops import TrainStep, train_step
from ._tensors import (INT64_HINT, TorchLinear, address, bt_tensor, check_inputs, check_tensor, fp32_operand,
                       fp32_vector, mask_tensor, metrics_dict, metrics_tensors, opt_view, scalar, sequence_rows,
                       view)

_OPTION_TYPES = dict(loss="str", loss_type="str", beta="float", label_smoothing="float", simpo_gamma="float",
                     rpo_alpha="float?", cpo_alpha="float", loss_weights="float[]?", dpo_semantics="str",
                     discopop_tau="float", use_weighting="bool")
_ARGS = (("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor", "targets"), ("Tensor", "mask"), ("Tensor?", "bias"),
         ("Tensor?", "ref_logps"), ("Tensor?", "ref_per_token_logps"), ("Tensor?", "cu_seqlens"),
         ("str", "layout")) + tuple(
    (t, n) for n, t in _OPTION_TYPES.items())


def _choice_name(value) -> str:
    return value.name.lower() if isinstance(value, enum.Enum) else value


def _option_values(options: dict) -> dict:
    """The options as op arguments: loss_type, a name or TRL's list of names, as one comma-separated string."""
    loss_type = options["loss_type"]
    if not isinstance(loss_type, (str, enum.Enum)):
        loss_type = ",".join(_choice_name(t) for t in loss_type)
    return dict(options, loss_type=_choice_name(loss_type))


class _Preference:
    """Everything one preference call needs, checked and in library form. targets int64 [2B, T], the chosen
    sequences then the rejected ones; hidden [2B, T, H] or [2B*T, H]; mask [2B, T] (bool, integer or floating:
    converted to float32); dpo's reference log-probs ref_logps [2B] or ref_per_token_logps [2B, T], float32
    (bfloat16 too with bfloat16 inputs: converted). Packed: cu_seqlens [2B + 1], hidden [N, H] or [1, N, H] and the
    per-token tensors of hidden's leading shape."""

    def __init__(self, a: dict):
        hidden, targets = a["hidden"], a["targets"]
        dtype = check_inputs(hidden, a["weight"])
        check_tensor(targets, "targets", torch.int64, INT64_HINT)
        self.cu_seqlens, t = None, 0
        if a["cu_seqlens"] is None:
            rows, t = pairs_shape(tuple(targets.shape))
            if tuple(hidden.shape[:-1]) not in ((rows, t), (rows * t,)):
                raise ValueError(f"hidden: expected [2B, T, H] = [{rows}, {t}, H] or [2B*T, H] = [{rows * t}, H] "
                                 f"(targets are [2B, T] = {[rows, t]}), got shape {list(hidden.shape)}")
            self.bt, dims = (rows, t), dict(dims="[2B, T]", source="the targets' shape")
        else:
            packed = sequence_rows(hidden, a["cu_seqlens"], "2B")
            rows = packed.sequences
            if rows % 2:
                raise ValueError(f"cu_seqlens: expected [2B + 1] offsets, the chosen sequences then the rejected "
                                 f"ones (an even count), got {rows} sequences")
            self.bt, self.cu_seqlens, dims = packed.token_shape, packed.cu_seqlens, dict(dims=packed.dims)
        self.lin = TorchLinear(hidden, a["weight"], a["bias"], a["layout"])
        self.pairs, n = rows // 2, self.lin.n
        self.targets = bt_tensor(targets, "targets", torch.int64, self.bt, n, **dims)
        self.mask = mask_tensor(a["mask"], "mask", self.bt, n, **dims)
        ref_logps, ref_per_token_logps = a["ref_logps"], a["ref_per_token_logps"]
        self.ref_logps = None if ref_logps is None else fp32_vector(ref_logps, "ref_logps", dtype, rows, "[2B]")
        self.ref_per_token_logps = None if ref_per_token_logps is None else bt_tensor(
            fp32_operand(ref_per_token_logps, "ref_per_token_logps", dtype), "ref_per_token_logps", torch.float32,
            self.bt, n, **dims)
        options = {name: a[name] for name in _OPTION_TYPES}
        options["loss_type"] = [] if options["loss_type"] == "" else options["loss_type"].split(",")
        self.problem = PreferenceProblem(self.lin.head, self.pairs, t, view(self.targets), view(self.mask),
                                         opt_view(self.ref_logps), opt_view(self.ref_per_token_logps),
                                         preference_options(**options), opt_view(self.cu_seqlens))


def _run(a: dict, need, context: Optional[Context]):
    """(loss, metrics float64 [13] in fh_preference_metrics order, sequence log-probs [2B], rewards [2B]), the
    gradients of the loss."""
    p = _Preference(a)
    logps = torch.zeros(2 * p.pairs, dtype=torch.float32)
    rewards = torch.zeros(2 * p.pairs, dtype=torch.float32)
    result, grads = train_step(p.problem, p.lin, context, need, sequence_logps=address(logps),
                               rewards=address(rewards))
    loss, m = result if result is not None else (None, None)
    return (scalar(loss, p.lin.dtype), *metrics_tensors(m, PREFERENCE_METRIC_KEYS), logps, rewards), grads


_PREFERENCE = TrainStep("preference", _ARGS, 5, _run, "fh_preference")


class PreferenceLossOutput(NamedTuple):
    """loss: a scalar in the inputs' dtype, differentiable; metrics: TRL's logged keys -> floats, only those TRL
    logs for the options (under torch.compile 0-d tensors, every key present, NaN where TRL logs nothing);
    logps, rewards: float32 [2B] (chosen sequences, then rejected), detached: the sequence
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
                                 context: Optional[Context] = None,
                                 cu_seqlens: Optional[torch.Tensor] = None) -> PreferenceLossOutput:
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
    cu_seqlens (int32 or int64 [2B + 1]): packed sequences, the chosen ones then the rejected ones, hidden [N, H] or
    [1, N, H] and targets, mask and ref_per_token_logps of hidden's leading shape; the results equal the padded
    [2B, T] call's (ORPO's and CPO's logits means aside: TRL takes them over every padded position).
    include/fusedhead.h has the formulas. Returns (loss, metrics, logps, rewards), a PreferenceLossOutput: metrics
    with TRL's keys "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen",
    "entropy", "mean_token_accuracy" (those TRL logs for the options).
    """
    options = dict(loss=loss, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                   simpo_gamma=simpo_gamma, rpo_alpha=rpo_alpha, cpo_alpha=cpo_alpha, loss_weights=loss_weights,
                   dpo_semantics=dpo_semantics, discopop_tau=discopop_tau, use_weighting=use_weighting)
    value, metrics, present, logps, rewards = _PREFERENCE(
        context, hidden=hidden, weight=weight, targets=targets, mask=mask, bias=bias, ref_logps=ref_logps,
        ref_per_token_logps=ref_per_token_logps, cu_seqlens=cu_seqlens, layout=layout, **_option_values(options))
    return PreferenceLossOutput(value, metrics_dict(PREFERENCE_METRIC_KEYS, metrics, present), logps, rewards)


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
                bias: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None) -> PreferenceLossOutput:
        return self._compute(hidden, weight, targets, mask, bias, cu_seqlens=cu_seqlens)

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
                ref_per_token_logps: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> PreferenceLossOutput:
        return self._compute(hidden, weight, targets, mask, bias, ref_logps=ref_logps,
                             ref_per_token_logps=ref_per_token_logps, cu_seqlens=cu_seqlens)


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
