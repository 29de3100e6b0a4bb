"""TRL's trainers with their per-token log-probs through fusedhead (tested with TRL 1.16.0).

    import fusedhead.trl
    fusedhead.trl.patch()            # once, before or after building the trainer; fusedhead.trl.unpatch() undoes it
    SFTTrainer(model=model, args=SFTConfig(loss_type="nll"), ...).train()

TRL's seam: since 1.x every trainer that scores completions (SFT, DPO, KTO, GRPO, RLOO) calls
`trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`, which gives the model a
`fused_lm_head=True` forward; that forward runs the body and hands the last hidden states, `lm_head`'s weight and bias,
the labels, the temperature, the model's `final_logit_softcapping` and logit scale to
`trl.trainer.utils._ChunkedLogProbFunction.apply(hidden [N, H], weight, bias, targets [N], temperature, chunk_size,
softcap, logit_scale, outputs)` (trl/kernels/chunked_logprob.py), which returns (log_probs, entropy,
log_sum_sq_probs, mean_logits, is_top1) per token. The trainers' losses are built from those (SFT's nll and dft
losses from log_probs; GRPO's from log_probs and entropy). patch() replaces that name with fusedhead:
  - log_probs and entropy: fusedhead.torch.fused_linear_logprobs (differentiable, the entropy's gradient included);
  - is_top1 (SFT's and DPO's mean_token_accuracy; no gradient): the argmax of fusedhead's cross-entropy forward
    (lowest index of the largest transformed logit, TRL's tie rule), an extra forward pass (2 N H V flops);
  - mean_logits (DPO's and KTO's logged logits; no gradient) without softcapping: x·mean(W)·scale / T, no pass over
    the vocabulary;
  - log_sum_sq_probs, and mean_logits with softcapping: TRL's own function, forward only (a RoutingWarning says so
    once).
A call fusedhead cannot take (not on the CPU, float16, a sharded weight) goes to TRL's own function with a
RoutingWarning naming the reason (strict=True: NotRoutedError). Under CPU autocast to bf16 the inputs are cast to
bf16, as TRL's function computes in the autocast dtype.
"""
from __future__ import annotations

import warnings
import numpy as np
import torch

from .torch import fused_linear_logprobs
from .transformers import NotRoutedError, RoutingWarning, _autocast_dtype, _autocast_off

__all__ = ["patch", "unpatch", "is_patched", "RoutingWarning", "NotRoutedError"]

TESTED_TRL = "1.16.0"
_state = {"original": None, "strict": False, "warned": set()}


def _refuse(reason: str):
    message = f"fusedhead.trl: {reason}"
    if _state["strict"]:
        raise NotRoutedError(message)
    if reason not in _state["warned"]:
        _state["warned"].add(reason)
        warnings.warn(message + "; TRL's own function computes it", RoutingWarning, stacklevel=4)


def _top1(hidden, weight, bias, targets, softcap, logit_scale) -> torch.Tensor:
    """Whether each target is the lowest-index argmax of the transformed logits (fusedhead's forward)."""
    import fusedhead.numpy as fhnp

    def arr(t):
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    r = fhnp.cross_entropy(arr(hidden), arr(weight), arr(targets),
                           bias=None if bias is None else bias.detach().float().contiguous().numpy(),
                           softcap=softcap or 0.0, logit_scale=logit_scale,
                           dtype="bf16" if hidden.dtype == torch.bfloat16 else "fp32")
    return torch.from_numpy(np.asarray(r.argmax)).view(targets.shape) == targets


class FusedheadLogProbFunction:
    """Stands in for TRL's ChunkedLogProbFunction: only `apply` is called (trl/trainer/utils.py)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        original = _state["original"]
        reason = None
        dtype = _autocast_dtype(hidden.device.type) or hidden.dtype
        if hidden.device.type != "cpu" or weight.device.type != "cpu":
            reason = f"hidden states on {hidden.device} (fusedhead computes on CPU tensors)"
        elif dtype not in (torch.float32, torch.bfloat16):
            reason = f"{dtype} compute dtype (fusedhead takes float32 or bfloat16)"
        elif type(weight) is not torch.nn.Parameter and type(weight) is not torch.Tensor:
            reason = f"lm_head's weight is a {type(weight).__name__}"
        elif _autocast_dtype("cpu") is None and weight.dtype != hidden.dtype:
            reason = f"hidden states in {hidden.dtype} and lm_head.weight in {weight.dtype}"
        if reason:
            _refuse(reason)
            return original.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                  logit_scale, outputs)
        leftover = [o for o in outputs if o == "log_sum_sq_probs"
                    or (o == "mean_logits" and final_logit_softcapping is not None)]
        scale = None if logit_scale == 1.0 else float(logit_scale)
        h, w, b = hidden, weight, bias
        if dtype == torch.bfloat16:
            h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
            b = None if b is None else b.to(torch.bfloat16)
        with _autocast_off():
            want_entropy = "entropy" in outputs
            result = fused_linear_logprobs(h, w, targets, temperature, return_entropy=want_entropy, bias=b,
                                           softcap=final_logit_softcapping, logit_scale=scale)
            logp, entropy = result if want_entropy else (result, None)
            with torch.no_grad():
                is_top1 = (_top1(h, w, b, targets, final_logit_softcapping, scale) if "is_top1" in outputs
                           else None)
                mean_logits = None
                if "mean_logits" in outputs and final_logit_softcapping is None:
                    z = h.float() @ w.float().mean(0) + (0.0 if b is None else b.float().mean())
                    mean_logits = z * (float(logit_scale) / temperature)
        log_sum_sq = None
        if leftover:
            _refuse(f"{', '.join(leftover)} has no fusedhead form" +
                    (" with final_logit_softcapping" if "mean_logits" in leftover else ""))
            with torch.no_grad():
                extra = original.apply(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                       targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                                       tuple(leftover))
            log_sum_sq = extra[2]
            if "mean_logits" in leftover:
                mean_logits = extra[3]
        return logp, entropy, log_sum_sq, mean_logits, is_top1


def patch(strict: bool = False):
    """Route TRL's per-token log-prob function (every trainer's fused LM head) through fusedhead; idempotent."""
    import trl.trainer.utils as tu
    _state["strict"] = strict
    if _state["original"] is None:
        _state["original"] = tu._ChunkedLogProbFunction
        tu._ChunkedLogProbFunction = FusedheadLogProbFunction


def unpatch():
    import trl.trainer.utils as tu
    if _state["original"] is not None:
        tu._ChunkedLogProbFunction = _state["original"]
        _state["original"] = None


def is_patched() -> bool:
    return _state["original"] is not None
