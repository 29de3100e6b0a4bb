"""TRL's GRPO loss in torch float64, logits materialised, gradients by autograd: the reference the GRPO tests hold
fusedhead to.

Transcribed (written anew from reading the code, not copied) from huggingface/trl at commit
f2cd57710ae345ea6428ae95363267fcf38a3dc8, and brought to TRL 1.16.0 (the version python/requirements-test.txt pins),
which changed two reductions in trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss:
  - luspo: loss = (per_token_loss * mask).sum(-1).mean() (line 3179), each sequence's masked sum averaged over B
    (f2cd5771: (per_token_loss * mask.sum(-1, keepdim=True)).mean(), over every B*T position);
  - the entropy bonus, for every loss type: (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
    / accumulation_factor (lines 3192-3201), effective_mask = mask * entropy_mask (mask alone without it); the count
    is this micro-batch's, not gathered over processes, and num_items_in_batch plays no part (f2cd5771 divided the
    bonus of cispo, dapo and vespo by the policy term's normaliser).
What else is read:
  - trl/trainer/grpo_trainer.py  GRPOTrainer._compute_loss (the loss and the metrics it logs),
    get_off_policy_mask, get_gamma_weights (VESPO), get_high_entropy_mask (top_entropy_quantile),
    _generate_and_score_completions (the vLLM importance-sampling ratio from sampling_per_token_logps, lines
    ~2579-2620 at f2cd5771, 2659-2708 at 1.16.0, and the sampling/... metrics, ~2779-2812 at f2cd5771, 2860-2896 at
    1.16.0), _get_per_token_logps_and_entropies (logits / temperature)
  - trl/trainer/grpo_config.py   option names and defaults (loss_type "dapo", vllm_importance_sampling_mode
    "sequence_mask", clip_max 3.0, VESPO's k and lambda, ...).

One micro-batch on one process, in TRL's terms: accelerator.num_processes = 1 (gathers and reduces are identities),
current_gradient_accumulation_steps = 1 (the head leaves that division to the caller), no tool_mask, no MoE
auxiliary loss, the static entropy coefficient (no adaptive controller), "train" mode. TRL's use_vllm is "a
sampling_per_token_logps was given". Where TRL has no old_per_token_logps it uses the current log-probs detached;
the importance-sampling ratio (computed by TRL at generation time from its old log-probs) is computed here from that
same old. Quirks of TRL kept as they are: the token-level clip-ratio
sequence means divide by an unclamped token count (an empty sequence gives NaN, which nanmin / nanmax skip);
VESPO's weight sums the log of the token importance ratios over every position, padding included; TRL computes the
entropy quantile in float32 (here float64: the tests keep entropies away from the threshold, see
entropy_threshold_gap).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the two-sided clipped objective and its clip metrics
TOKEN_SUM = ("cispo", "dapo", "vespo")                   # the policy term normalised by num_items_in_batch


def _nanmin(x):
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else x.min().item()


def _nanmax(x):
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else x.max().item()


def vllm_importance_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL's vllm_importance_sampling_ratio: [B, T] (token modes) or [B, 1] (sequence modes), detached."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            raise ValueError("a *_truncate mode needs clip_min or clip_max (GRPOConfig)")
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    elif mode.endswith("mask"):
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    else:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
    return ratio


def sampling_metrics(old, sampling, mask, ratio, mode):
    """The sampling/... metrics TRL logs with the correction: |old - sampling| over the tokens with m != 0, the
    ratio over them (token modes) or over every sequence (sequence modes); 0 where there is nothing."""
    keep = mask.bool()
    delta = (old - sampling).abs()[keep]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[keep]
    val = lambda x, f: f(x).item() if x.numel() > 0 else 0.0  # noqa: E731
    return {"sampling/sampling_logp_difference/mean": val(delta, torch.mean),
            "sampling/sampling_logp_difference/max": val(delta, torch.max),
            "sampling/importance_sampling_ratio/min": val(flat, torch.min),
            "sampling/importance_sampling_ratio/mean": val(flat, torch.mean),
            "sampling/importance_sampling_ratio/max": val(flat, torch.max)}


def high_entropy_mask(entropies, mask, quantile):
    """get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile): tokens with m != 0 whose entropy is at
    least the (linear) quantile of the entropies of every token with m != 0; all False when there are none."""
    valid = entropies.detach()[mask.bool()]
    if valid.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool), None
    threshold = torch.quantile(valid, quantile)
    return ((entropies.detach() * mask) >= threshold) & mask.bool(), threshold.item()


def entropy_threshold_gap(entropies, mask, threshold):
    """The distance from the quantile threshold to the nearest valid entropy that is not the threshold itself:
    the tests need it well above fp32 error, else the library's fp32 entropies could select other tokens."""
    valid = entropies.detach()[mask.bool()]
    d = (valid - threshold).abs()
    d = d[d > 0]
    return d.min().item() if d.numel() else math.inf


def off_policy_mask(advantages, logp, sampling, mask, threshold):
    """get_off_policy_mask: [B, 1], 1 keeps the sequence (A >= 0, or its mean sampling - current gap <= threshold)."""
    gap = sampling - logp.detach()
    mean_gap = (gap * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_gap <= threshold)).to(mask.dtype)


@torch.no_grad()
def gamma_weights(advantages, log_ratio, mask, is_ratio, k_pos, lambda_pos, k_neg, lambda_neg):
    """get_gamma_weights (VESPO): phi(w) = exp(lam + k log w - lam w) per sequence [B, 1], detached, with
    log w = the clamped sum of clamped token log-ratios (+ the clamped logs of the token IS ratios, every
    position), non-finite phi -> 0."""
    low = math.log(1e-8)
    s = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        s = s + torch.clamp(torch.log(is_ratio), low, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(s, low, 20.0)
    pos = advantages >= 0
    k = torch.where(pos, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(pos, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_grpo_loss(h, W, b, ids, mask, A, old=None, ref=None, sampling=None, *, loss_type="dapo",
                  importance_sampling_level="token", temperature=1.0, epsilon_low=0.2, epsilon_high=None, delta=None,
                  beta=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, num_items_in_batch=None,
                  max_completion_length=None, entropy_coef=0.0, top_entropy_quantile=1.0,
                  off_policy_mask_threshold=None, use_bias_correction_kl=False,
                  vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                  vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0, vespo_k_pos=2.0,
                  vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, return_details=False, support=None):
    """(loss, metrics dict with TRL's keys, per-token logp detached) of one GRPO micro-batch.

    h [B, T, H], W [V, H], b [V] or None: float64 (leaves with requires_grad for the gradients); ids int64 [B, T];
    mask, old, ref, sampling float64 [B, T] (old / ref / sampling may be None); A float64 [B]. Options: TRL's
    GRPOConfig names and defaults. return_details: also a dict of intermediate values (the entropy threshold, the
    off-policy mask, the least distance of a negative-advantage sequence's mean gap from its threshold, and
    loss_scale: the loss's reduction applied to the absolute per-token losses, plus the entropy term's size).
    support: None, or bool [B, T, V], each token's support (the sampler's kept set): the logits outside it set to
    -inf before the log-softmax, TRL #7269's renormalised log-probs (and the entropy over the support), the rest of
    the loss unchanged.
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    Bn, Tn = ids.shape
    m = mask
    details = {}

    # _get_per_token_logps_and_entropies: logits over the temperature, log-prob of the completion token, entropy
    logits = F.linear(h, W, b) / temperature
    if support is not None:
        logits = logits.masked_fill(~support, float("-inf"))
    logsm = F.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if support is not None:  # 0 log 0 outside the support, not 0 * -inf (nor its NaN gradient)
        zero = torch.zeros((), dtype=logsm.dtype)
        inside = torch.where(support, logsm, zero)
        entropies = -(torch.where(support, inside.exp(), zero) * inside).sum(-1)
    else:
        entropies = -(logsm.exp() * logsm).sum(-1)
    old = logp.detach() if old is None else old

    # _generate_and_score_completions: the vLLM importance-sampling ratio (detached inputs) and its metrics
    use_vllm = sampling is not None
    correct = use_vllm and vllm_importance_sampling_correction
    metrics = {}
    is_ratio = None
    if correct:
        is_ratio = vllm_importance_sampling_ratio(old.detach(), sampling, m, vllm_importance_sampling_mode,
                                                  vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max)
        metrics.update(sampling_metrics(old.detach(), sampling, m, is_ratio, vllm_importance_sampling_mode))
        if loss_type == "vespo" and vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
            raise ValueError("vespo needs a token vllm_importance_sampling_mode (GRPOTrainer.__init__)")

    # _compute_loss
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask, details["entropy_threshold"] = high_entropy_mask(entropies, m, 1 - top_entropy_quantile)
    Au = A.unsqueeze(1)
    if off_policy_mask_threshold is not None:
        keep = off_policy_mask(Au, logp, sampling if use_vllm else old, m, off_policy_mask_threshold)
        gap = ((sampling if use_vllm else old) - logp.detach()) * m
        gap = gap.sum(1) / m.sum(1).clamp(min=1.0)
        details["off_policy_keep"] = keep.squeeze(1)
        details["off_policy_margin"] = (gap - off_policy_mask_threshold).abs()[A < 0].min().item() if (A < 0).any() \
            else math.inf

    log_ratio = logp - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(importance_sampling_level)
    coef_1 = torch.exp(log_w)

    if beta != 0.0:
        dref = ref - logp
        kl = torch.exp(dref) - dref - 1
        if use_bias_correction_kl:
            kl = kl * coef_1

    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * Au * logp
    elif loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * Au, coef_2 * Au)
    elif loss_type == "sapo":
        tau = torch.where(Au > 0, torch.full_like(Au, sapo_temperature_pos), torch.full_like(Au, sapo_temperature_neg))
        per_token = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * Au
    elif loss_type == "vespo":
        phi = gamma_weights(Au, log_ratio, m, is_ratio if correct else None, vespo_k_pos, vespo_lambda_pos,
                            vespo_k_neg, vespo_lambda_neg)
        per_token = -phi * Au * logp
    else:
        raise ValueError(loss_type)

    if off_policy_mask_threshold is not None:
        per_token = per_token * keep
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if correct and loss_type != "vespo":
        per_token = per_token * is_ratio
    if beta != 0.0:
        per_token = per_token + beta * kl

    def reduce(pt):  # the loss type's reduction of a per-token loss
        if loss_type in ("grpo", "sapo"):
            return ((pt * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
        if loss_type == "bnpo":
            return (pt * m).sum() / m.sum().clamp(min=1.0)
        if loss_type == "dr_grpo":
            return (pt * m).sum() / (pt.size(0) * (max_completion_length or Tn))
        if loss_type in TOKEN_SUM:
            return (pt * m).sum() / normalizer
        # luspo (TRL 1.16.0 grpo_trainer.py:3179): each sequence's masked sum, the mean over B
        return (pt * m).sum(-1).mean()

    nib = m.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch), dtype=m.dtype)
    normalizer = nib.clamp(min=1.0)  # cispo, dapo, vespo
    loss = reduce(per_token)
    policy_loss = loss.detach()
    # the loss's scale without cancellation: the same reduction of |per-token loss| (and of the entropy bonus)
    details["loss_scale"] = reduce(per_token.detach().abs()).item()

    if entropy_coef != 0.0:
        # TRL 1.16.0 grpo_trainer.py:3192-3201, every loss type (accumulation_factor 1: one micro-batch)
        effective = m if entropy_mask is None else m * entropy_mask
        bonus = (entropies * effective).sum() / effective.sum().clamp(min=1.0)
        loss = loss - entropy_coef * bonus
        details["loss_scale"] += abs(entropy_coef) * bonus.item()
        metrics["policy_loss"] = policy_loss.item()
        metrics["entropy_coef"] = float(entropy_coef)

    def seq_mean(x):  # masked_seq_mean: one value per sequence (NaN for an empty one at the token level)
        return x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1)

    def batch_mean(x):  # global_masked_mean
        if x.shape[1] == 1:
            return (x.sum() / max(float(x.shape[0]), 1.0)).item()
        return ((x * m).sum() / m.sum().clamp(min=1.0)).item()

    if beta != 0.0:
        metrics["kl"] = batch_mean(kl.detach())
    metrics["entropy"] = batch_mean(entropies.detach())
    if loss_type in CLIPPED:
        c1 = coef_1.detach()
        low = ((c1 < 1 - epsilon_low) & (Au < 0)).double()
        high = ((c1 > 1 + eps_high) & (Au > 0)).double()
        region = ((low + high) > 0).double()
        metrics["clip_ratio/low_mean"] = batch_mean(low)
        metrics["clip_ratio/high_mean"] = batch_mean(high)
        metrics["clip_ratio/region_mean"] = batch_mean(region)
        metrics["clip_ratio/low_min"] = _nanmin(seq_mean(low))
        metrics["clip_ratio/high_max"] = _nanmax(seq_mean(high))
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = batch_mean(((coef_1.detach() > eps_high) & (Au > 0)).double())
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = batch_mean(phi)
    metrics = {k: v for k, v in metrics.items() if v == v}  # NaN: TRL logs nothing useful (fusedhead omits it)
    if return_details:
        return loss, metrics, logp.detach(), details
    return loss, metrics, logp.detach()
