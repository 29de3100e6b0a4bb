"""GRPO (TRL GRPOTrainer._compute_loss semantics): fused_linear_grpo_loss and FusedLinearGRPOLoss."""
from __future__ import annotations

from typing import Optional

import torch

from .._core import (GRPO_METRIC_KEYS, GRPO_OPTION_DEFAULTS, Context, GRPOProblem, grpo_option_dict, grpo_options,
                     parse_layout)
from ._ops import TrainStep, train_step
from ._tensors import (INT64_HINT, TorchLinear, address, bt_tensor, check_inputs, fp32_operand, fp32_vector,
                       mask_tensor, metrics_dict, metrics_tensors, opt_view, scalar, sequence_rows, support_of, view)

# TRL's GRPOConfig names, their schema types, and TRL's aliases (epsilon, vllm_importance_sampling_cap)
_OPTION_TYPES = dict(
    loss_type="str", importance_sampling_level="str", temperature="float", epsilon_low="float?", epsilon="float?",
    epsilon_high="float?", delta="float?", beta="float", sapo_temperature_pos="float", sapo_temperature_neg="float",
    num_items_in_batch="float?", max_completion_length="int?", entropy_coef="float", top_entropy_quantile="float",
    off_policy_mask_threshold="float?", use_bias_correction_kl="bool", vllm_importance_sampling_correction="bool",
    vllm_importance_sampling_mode="str", vllm_importance_sampling_clip_min="float?",
    vllm_importance_sampling_clip_max="float?", vllm_importance_sampling_cap="float?", vespo_k_pos="float",
    vespo_lambda_pos="float", vespo_k_neg="float", vespo_lambda_neg="float")
assert set(_OPTION_TYPES) == set(GRPO_OPTION_DEFAULTS) | {"epsilon", "vllm_importance_sampling_cap"}
_ARGS = (("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor", "completion_ids"), ("Tensor", "completion_mask"),
         ("Tensor", "advantages"), ("Tensor?", "bias"), ("Tensor?", "old_per_token_logps"),
         ("Tensor?", "ref_per_token_logps"), ("Tensor?", "sampling_per_token_logps"),
         ("Tensor?", "num_items_tensor"), ("Tensor?", "support_ids"), ("Tensor?", "support_offsets"),
         ("Tensor?", "cu_seqlens"), ("str", "layout")) + tuple((t, n) for n, t in _OPTION_TYPES.items())


class _GRPO:
    """Everything one GRPO call needs, checked and in library form. hidden [B, T, H], or packed [N, H] / [1, N, H]
    with cu_seqlens [B + 1]; completion_ids int64 [B, T]; completion_mask [B, T] (bool, integer or floating:
    converted to float32); advantages float32 [B]; old / ref / sampling per-token log-probs float32 [B, T] or None
    (advantages and the log-probs may be bfloat16 with bfloat16 inputs: converted); the per-token tensors of
    hidden's leading shape when packed; num_items_in_batch as a tensor (TRL's) is read here, at run time."""

    def __init__(self, a: dict):
        hidden = a["hidden"]
        dtype = check_inputs(hidden, a["weight"])
        rows = sequence_rows(hidden, a["cu_seqlens"], "B")
        self.lin = TorchLinear(hidden, a["weight"], a["bias"], a["layout"])
        b, t, dims = rows.sequences, rows.seq, dict(dims=rows.dims)
        self.bt, n, self.cu_seqlens = rows.token_shape, self.lin.n, rows.cu_seqlens
        self.completion_ids = bt_tensor(a["completion_ids"], "completion_ids", torch.int64, self.bt, n, INT64_HINT,
                                        **dims)
        self.completion_mask = mask_tensor(a["completion_mask"], "completion_mask", self.bt, n, **dims)
        self.advantages = fp32_vector(a["advantages"], "advantages", dtype, b, "[B]")
        # held for the call: a bf16 input's float32 copy lives as long as this object
        self.logps = {}
        for name in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
            v = a[name]
            self.logps[name] = None if v is None else bt_tensor(fp32_operand(v, name, dtype), name, torch.float32,
                                                                self.bt, n, **dims)
        options = {name: a[name] for name in _OPTION_TYPES}
        if a["num_items_tensor"] is not None and not self.lin.fake:
            options["num_items_in_batch"] = float(a["num_items_tensor"])
        self.options = grpo_options(**options)
        if a["support_offsets"] is not None and a["support_ids"] is None:
            raise ValueError("support_offsets without support_ids: a CSR support is support_ids with support_offsets")
        support = None
        if a["support_ids"] is not None:
            support = support_of(a["support_ids"], a["support_offsets"], self.bt, n)
        self.problem = None
        if n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = GRPOProblem(self.lin.head, b, t, view(self.completion_ids), view(self.completion_mask),
                                       view(self.advantages), opt_view(self.logps["old_per_token_logps"]),
                                       opt_view(self.logps["ref_per_token_logps"]), self.options,
                                       opt_view(self.logps["sampling_per_token_logps"]), support,
                                       opt_view(self.cu_seqlens))


def _run(a: dict, need, context: Optional[Context]):
    """(loss, metrics float64 [16] in fh_grpo_metrics order, per-token logp [B, T]), the gradients of the loss."""
    g = _GRPO(a)
    logp = torch.zeros(g.lin.n, dtype=torch.float32)
    result, grads = train_step(g.problem, g.lin, context, need, per_token_logp=address(logp))
    loss, m = result if result is not None else (None, None)
    return (scalar(loss, g.lin.dtype), *metrics_tensors(m, GRPO_METRIC_KEYS), logp.view(g.bt)), grads


_GRPO_STEP = TrainStep("grpo", _ARGS, 4, _run, "fh_grpo")


def _grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias, old, ref, sampling, options: dict,
               layout, return_per_token_logps, context, support_ids=None, support_offsets=None, cu_seqlens=None):
    values = dict(dict.fromkeys(_OPTION_TYPES), **options)
    if isinstance(values["num_items_in_batch"], torch.Tensor):  # TRL's: read by the op, not by the trace
        values["num_items_tensor"], values["num_items_in_batch"] = values["num_items_in_batch"], None
    else:
        values["num_items_tensor"] = None
    loss, metrics, present, logp = _GRPO_STEP(context, hidden=hidden, weight=weight, completion_ids=completion_ids,
                                     completion_mask=completion_mask, advantages=advantages, bias=bias,
                                     old_per_token_logps=old, ref_per_token_logps=ref,
                                     sampling_per_token_logps=sampling, support_ids=support_ids,
                                     support_offsets=support_offsets, cu_seqlens=cu_seqlens, layout=layout,
                                     **values)
    metrics = metrics_dict(GRPO_METRIC_KEYS, metrics, present)
    return (loss, metrics, logp) if return_per_token_logps else (loss, metrics)


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
                           context: Optional[Context] = None, support_ids: Optional[torch.Tensor] = None,
                           support_offsets: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """TRL GRPOTrainer._compute_loss (TRL 1.16.0) from hidden [B, T, H] (position t predicts
    completion_ids[b, t]) and the lm_head weight, without the [B*T, V] logits.

    Options use TRL's GRPOConfig names and defaults (include/fusedhead.h has the formulas):
      loss_type "dapo" (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo); importance_sampling_level "token"
      or "sequence" (GSPO); temperature; epsilon (alias epsilon_low, 0.2) and epsilon_high (None: = epsilon_low;
      cispo's absolute cap); delta (None: off); beta (KL, ref_per_token_logps required when != 0);
      sapo_temperature_pos/neg; num_items_in_batch (dapo, cispo and vespo's policy normaliser, an int, float or
      tensor; None: the mask's sum); max_completion_length (dr_grpo; None: T); entropy_coef (the entropy bonus:
      the mean entropy over the masked tokens, those the entropy mask keeps with top_entropy_quantile < 1, for
      every loss type, as TRL 1.16.0); top_entropy_quantile (< 1: only the tokens whose entropy is in that
      top quantile of the batch carry the policy term); off_policy_mask_threshold (None: off);
      use_bias_correction_kl; vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg.
      vLLM importance sampling (TRL's use_vllm is "sampling_per_token_logps was given"):
      vllm_importance_sampling_correction (True), vllm_importance_sampling_mode ("sequence_mask";
      "token_truncate", "token_mask", "sequence_truncate"), vllm_importance_sampling_clip_min (None) and
      vllm_importance_sampling_clip_max (3.0) (None: no bound); vllm_importance_sampling_cap is TRL's deprecated
      alias of clip_max (FutureWarning).
    Inputs: old_per_token_logps None: on-policy (old = logp detached); sampling_per_token_logps: the sampler's
    per-token log-probs [B, T] or None (then no importance-sampling correction, and the off-policy mask compares
    with old). support_ids (with support_offsets for CSR; as fused_linear_logprobs takes them): the policy's
    log-probs and entropies over each token's support (the sampler's kept set) instead of the vocabulary, so that
    they share the normalisation of vLLM's processed log-probs in the importance ratio (TRL #6789, #7269); every
    completion id at a non-zero mask must be in its support, and masked tokens' per-token log-probs are 0.
    cu_seqlens (int32 or int64 [B + 1], flash-attention's offsets): packed sequences, hidden [N, H] or [1, N, H] (a
    padding-free batch) and every per-token tensor of hidden's leading shape, sequence b at rows
    cu_seqlens[b] .. cu_seqlens[b + 1] - 1; the results equal the [B, T] call's on the same sequences padded, and the
    padding costs nothing (dr_grpo needs max_completion_length then).
    Returns (loss, metrics) where metrics has TRL's keys, only those TRL logs for these options: "kl", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss" and "entropy_coef" (with an
    entropy bonus), "sampling/sampling_logp_difference/mean" and "/max", "sampling/importance_sampling_ratio/min",
    "/mean" and "/max" (with the importance-sampling correction); or (loss, metrics, per_token_logps) with
    return_per_token_logps=True (detached float32 [B, T]). Under torch.compile the metrics are 0-d tensors, every
    key present (NaN where TRL logs nothing).
    """
    options = dict(
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
                      ref_per_token_logps, sampling_per_token_logps, options, layout, return_per_token_logps, context,
                      support_ids, support_offsets, cu_seqlens)


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
        # TRL's defaults and aliases resolved, names and choices checked (values: by the library, per call)
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
                sampling_per_token_logps: Optional[torch.Tensor] = None, support_ids: Optional[torch.Tensor] = None,
                support_offsets: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
        opts = dict(self.options)
        if num_items_in_batch is not None:
            opts["num_items_in_batch"] = num_items_in_batch
        return _grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                          ref_per_token_logps, sampling_per_token_logps, opts, self.layout,
                          self.return_per_token_logps, self.context, support_ids, support_offsets, cu_seqlens)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + f", layout={self.layout!r}"
