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
losses from log_probs; GRPO's and RLOO's from log_probs and entropy). DistillationTrainer and GKDTrainer do not use
it: fuse_loss() below gives them fusedhead's distillation head. patch() replaces that name with fusedhead:
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

import contextlib
import types
import warnings
from typing import Optional

import numpy as np
import torch

from .torch import fused_linear_distillation_loss, fused_linear_grpo_loss, fused_linear_logprobs
from .transformers import NotRoutedError, RoutingWarning, _autocast_dtype, _autocast_off, _unwrap_peft

__all__ = ["patch", "unpatch", "is_patched", "fuse_loss", "RoutingWarning", "NotRoutedError"]

TESTED_TRL = "1.16.0"
_state = {"original": None, "strict": False, "warned": set()}


def _refuse(reason: str, fallback: str = "; TRL's own function computes it"):
    message = f"fusedhead.trl: {reason}"
    if _state["strict"]:
        raise NotRoutedError(message)
    if reason not in _state["warned"]:
        _state["warned"].add(reason)
        warnings.warn(message + fallback, RoutingWarning, stacklevel=4)


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


# --- The whole loss: GRPOTrainer's and GKDTrainer's compute_loss on fusedhead's heads ------------------------------

_SCALED = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_GRPO_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _head_reason(model) -> Optional[str]:
    """Why the model's head cannot go to fusedhead's GRPO / distillation heads (None: it can)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in _SCALED:
        if getattr(config, name, None) not in (None, 1.0):
            return f"{type(model).__name__} has {name}={getattr(config, name)!r} (fusedhead's GRPO and " \
                   f"distillation heads take no logit scale or softcap; the per-token seam, patch(), does)"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"{type(model).__name__}'s output embedding is a {type(head).__name__}, not a torch.nn.Linear"
    if type(head.weight) is not torch.nn.Parameter or head.weight.device.type != "cpu":
        return f"{type(model).__name__}'s lm_head weight is a {type(head.weight).__name__} on {head.weight.device}"
    return None


def _hidden_and_head(model, input_ids, attention_mask, autocast_ctx):
    """The backbone's last hidden states [B, L, H] and lm_head's weight and bias, in one dtype (bf16 under CPU
    autocast to bf16, as TRL's head computes in the autocast dtype)."""
    head = model.get_output_embeddings()
    backbone = _unwrap_peft(model).base_model  # a PEFT model's base_model is its adapter wrapper, not the backbone
    with autocast_ctx:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state
        dtype = _autocast_dtype("cpu") or head.weight.dtype
    w, b = head.weight, head.bias
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"{dtype} compute dtype (fusedhead takes float32 or bfloat16)"
    return (hidden.to(dtype), w.to(dtype), None if b is None else b.to(dtype)), None


def _grpo_reason(trainer, model, inputs) -> Optional[str]:
    if trainer.accelerator.num_processes != 1:
        return f"{trainer.accelerator.num_processes} processes (the fused GRPO loss logs one process's metrics)"
    if trainer.use_vllm:
        return "use_vllm (the fused GRPO loss is tested without vLLM's importance-sampling inputs)"
    if "tool_mask" in inputs:
        return "a tool_mask"
    if any(inputs.get(k) is not None for k in _GRPO_MULTIMODAL):
        return "multimodal inputs"
    if trainer.aux_loss_enabled:
        return "an MoE auxiliary loss"
    if trainer.use_adaptive_entropy:
        return "use_adaptive_entropy (TRL's entropy controller)"
    if inputs["advantages"].dim() != 1:
        return "per-token advantages"
    return _head_reason(model)


def _grpo_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GRPOTrainer.compute_loss (TRL 1.16.0, trl/trainer/grpo_trainer.py _compute_loss) through
    fusedhead.torch.fused_linear_grpo_loss: the backbone's hidden states and lm_head's weight, no logits."""
    original = type(self).compute_loss
    reason = None if return_outputs else _grpo_reason(self, model, inputs)
    mode = "train" if self.model.training else "eval"
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    token_sum = self.loss_type in ("cispo", "dapo", "vespo")
    mask = inputs["completion_mask"]
    nib = None
    entropy_coef = self.entropy_coef
    if reason is None and token_sum:
        # TRL: num_items_in_batch spans the generation batch; rescaled to one accumulation window
        nib = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            nib = nib * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        # the policy term's accumulation is in nib; TRL divides the entropy bonus by the accumulation steps
        # too (grpo_trainer.py:3198-3200 at 1.16.0), and the head applies no accumulation of its own
        entropy_coef = self.entropy_coef / accumulation
    if reason is None:
        completion_ids = inputs["completion_ids"]
        c = completion_ids.size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], mask], dim=1)
        got, reason = _hidden_and_head(model, input_ids, attention_mask, self.accelerator.autocast())
    if reason is not None:
        _refuse(f"GRPO loss: {reason}", "; TRL's own compute_loss computes it")
        return original(self, model, inputs, return_outputs, num_items_in_batch)

    hidden, weight, bias = got
    args = self.args
    with _autocast_off():
        loss, metrics = fused_linear_grpo_loss(
            hidden[:, -c - 1:-1], weight, completion_ids, mask, inputs["advantages"], bias=bias,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            delta=args.delta, beta=self.beta, sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg, num_items_in_batch=nib,
            max_completion_length=self.max_completion_length, entropy_coef=entropy_coef,
            top_entropy_quantile=self.top_entropy_quantile, off_policy_mask_threshold=self.off_policy_mask_threshold,
            use_bias_correction_kl=args.use_bias_correction_kl, vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg)
    if not token_sum:
        loss = loss / accumulation   # TRL divides these loss types (and every entropy bonus) by the accumulation
    for key, value in metrics.items():
        if key == "entropy_coef":
            if not (mode == "train" and self.accelerator.sync_gradients):
                continue
            value = self.entropy_coef  # the trainer's, not the one scaled for accumulation above
        self._metrics[mode][key].append(float(value))
    return loss


def _student_and_teacher(model, teacher, input_ids, attention_mask, autocast):
    """The student's and the teacher's (hidden [B, L, H], weight, bias), or the reason they cannot go to fusedhead's
    distillation head; each backbone runs under a fresh autocast() context (compute_loss itself runs under none:
    accelerate puts the autocast of mixed precision on the prepared models' forward)."""
    reason = _head_reason(model) or _head_reason(teacher)
    if reason is None and model.get_output_embeddings().weight.shape[0] != \
            teacher.get_output_embeddings().weight.shape[0]:
        reason = "the student's and the teacher's lm_head have different vocabulary sizes"
    if reason is not None:
        return None, reason
    student, reason = _hidden_and_head(model, input_ids, attention_mask, autocast())
    if reason is not None:
        return None, reason
    teacher.eval()
    with torch.no_grad():
        teacher_out, reason = _hidden_and_head(teacher, input_ids, attention_mask, autocast())
    return (student, teacher_out), reason


def _gkd_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GKDTrainer.compute_loss (TRL 1.16.0, trl/experimental/gkd/gkd_trainer.py: generalized_jsd_loss of the shifted
    student and teacher logits, beta=self.beta, temperature 1, labels -100 ignored, summed over num_items_in_batch
    or averaged over the labelled tokens) through fusedhead.torch.fused_linear_distillation_loss."""
    original = type(self).compute_loss
    heads, reason = None, "return_outputs (the student's logits)" if return_outputs else None
    if reason is None:
        # TRL calls both prepared models, whose forward runs under the accelerator's autocast (bf16=True)
        heads, reason = _student_and_teacher(model, self.teacher_model, inputs["input_ids"],
                                             inputs["attention_mask"], self.accelerator.autocast)
    if reason is not None:
        _refuse(f"GKD loss: {reason}", "; TRL's own compute_loss computes it")
        return original(self, model, inputs, return_outputs, num_items_in_batch)
    (hs, ws, bs), (ht, wt, bt) = heads
    labels = inputs["labels"][:, 1:]
    with _autocast_off():
        loss = fused_linear_distillation_loss(
            hs[:, :-1], ws, ht[:, :-1], wt, labels, student_bias=bs, teacher_bias=bt, divergence="jsd",
            beta=self.beta, temperature=1.0, reduction="mean" if num_items_in_batch is None else "sum")
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


_DISTILLATION_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                            "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _distillation_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """DistillationTrainer.compute_loss (TRL 1.16.0, trl/trainer/distillation_trainer.py: _compute_loss and
    _chunked_divergence_loss) through fusedhead.torch.fused_linear_distillation_loss: the generalized JSD (beta
    self.beta: 0 forward KL, 1 reverse KL) between the student's and the teacher's tempered (self.temperature)
    distributions at the completion positions, over completion_mask times tool_mask; in training summed over the
    generated batch's num_items_in_batch (per process), otherwise averaged over the valid positions. The logged
    entropy (the student's mean tempered entropy over those positions, no gradient) comes from
    fusedhead.torch.fused_linear_logprobs, a second forward pass over the student's head."""
    original = type(self).compute_loss
    heads, reason = None, None
    if self.accelerator.num_processes != 1:
        reason = f"{self.accelerator.num_processes} processes (TRL runs this loss inside the DDP/FSDP wrapper's " \
                 f"forward, which the fused loss does not)"
    elif self.teacher_model is None:
        reason = "no teacher_model (a subclass supplies the teacher another way)"
    elif any(k in inputs for k in _DISTILLATION_MULTIMODAL):
        reason = "multimodal inputs"
    if reason is None:
        # TRL calls the unwrapped backbones (_get_last_hidden_state), outside the autocast accelerate puts on the
        # prepared models' forward: in fp32 under bf16=True on the CPU, and so does this
        heads, reason = _student_and_teacher(
            model, self.accelerator.unwrap_model(self.teacher_model),
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), contextlib.nullcontext)
    if reason is not None:
        _refuse(f"distillation loss: {reason}", "; TRL's own compute_loss computes it")
        return original(self, model, inputs, return_outputs, num_items_in_batch)
    (hs, ws, bs), (ht, wt, bt) = heads
    nib = None
    if self.model.training and inputs.get("num_items_in_batch") is not None:
        nib = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    completion_ids = inputs["completion_ids"]
    c = completion_ids.size(1)
    targets = completion_ids.masked_fill(mask == 0, -100)   # the head's ignore_index: TRL's masked positions
    hs, ht = hs[:, -c - 1:-1], ht[:, -c - 1:-1]            # position t predicts completion token t
    with _autocast_off():
        loss = fused_linear_distillation_loss(
            hs, ws, ht, wt, targets, student_bias=bs, teacher_bias=bt, divergence="jsd", beta=self.beta,
            temperature=self.temperature, reduction="mean" if nib is None else "sum")
        with torch.no_grad():
            _, entropy = fused_linear_logprobs(hs.detach(), ws.detach(), targets, self.temperature,
                                               return_entropy=True, bias=None if bs is None else bs.detach())
    if nib is not None:
        loss = loss / nib
    mode = "train" if self.model.training else "eval"
    n_valid = self.accelerator.gather_for_metrics((mask != 0).sum()).sum()
    entropy_sum = self.accelerator.gather_for_metrics(entropy.sum()).sum()
    self._metrics[mode]["entropy"].append((entropy_sum / n_valid).item() if n_valid > 0 else 0.0)
    return (loss, None) if return_outputs else loss


def _fused_compute_loss(trainer):
    """The fused compute_loss for the trainer's class, or raises TypeError: a trainer with no whole-loss head, or a
    subclass that overrides the loss methods the fused one mirrors (e.g. trl.experimental's GMPOTrainer, a
    GRPOTrainer with its own _compute_loss; ServerDistillationTrainer, a DistillationTrainer with its own
    compute_loss)."""
    from trl.trainer.distillation_trainer import DistillationTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
    mirrored = [(GRPOTrainer, ("compute_loss", "_compute_loss"), _grpo_compute_loss),
                (DistillationTrainer, ("compute_loss", "_compute_loss"), _distillation_compute_loss)]
    try:
        from trl.experimental.gkd import GKDTrainer
        mirrored.append((GKDTrainer, ("compute_loss",), _gkd_compute_loss))
    except ImportError:  # pragma: no cover
        pass
    cls = type(trainer)
    for base, names, fused in mirrored:
        if isinstance(trainer, base):
            own = [n for n in names if getattr(cls, n) is not getattr(base, n)]
            if own:
                raise TypeError(f"fusedhead.trl.fuse_loss: {cls.__name__} overrides {base.__name__}'s "
                                f"{', '.join(own)}, whose loss fusedhead's head would replace; its per-token "
                                f"log-probs go through fusedhead.trl.patch()")
            return fused
    raise TypeError(f"fusedhead.trl.fuse_loss: {cls.__name__} has no whole-loss fusedhead head (GRPOTrainer, "
                    f"DistillationTrainer, GKDTrainer); its per-token log-probs go through fusedhead.trl.patch()")


def fuse_loss(trainer, strict: bool = False):
    """Give a TRL trainer instance fusedhead's head for its whole loss, where TRL's loss is one fusedhead head
    (tested with TRL 1.16.0):
      - GRPOTrainer: compute_loss -> fusedhead.torch.fused_linear_grpo_loss on the backbone's hidden states of the
        completion and lm_head's weight: the per-token log-probs, entropies and the whole clipped objective, KL,
        entropy bonus, masks and metrics in one pass (TRL's _compute_loss otherwise).
      - DistillationTrainer and GKDTrainer: compute_loss -> fusedhead.torch.fused_linear_distillation_loss
        (generalized JSD between the student's and the teacher's heads; neither's [N, V] logits).
    Other trainers (SFT, DPO, KTO, RLOO) and subclasses that override those losses: TypeError; SFT's, DPO's, KTO's
    and RLOO's losses are built from TRL's per-token function, which patch() routes. A call fusedhead cannot take
    (see the reasons in _grpo_reason, _distillation_compute_loss and _head_reason) goes to TRL's own compute_loss
    with a RoutingWarning (strict=True: NotRoutedError). Returns the trainer (changed in place)."""
    fused = _fused_compute_loss(trainer)
    _state["strict"] = strict
    trainer.compute_loss = types.MethodType(fused, trainer)
    return trainer
