"""TRL's KTO loss in torch float64, logits materialised, gradients by autograd: the reference the KTO tests hold
fusedhead to.

Transcribed (written anew from reading the code, not copied) from huggingface/trl at commit
f2cd57710ae345ea6428ae95363267fcf38a3dc8:
  - trl/trainer/kto_trainer.py  KTOTrainer._compute_loss (the loss and the metrics it logs without Liger) and
    _compute_kl_logps (the KL completions' summed log-probs, masked positions zeroed)
  - trl/trainer/kto_config.py   option names, defaults and loss_type choices ("kto", "apo_zero_unpaired").

One micro-batch on one process, in TRL's terms: accelerator.num_processes = 1 (gather_for_metrics is the identity),
precomputed reference log-probs (batch["ref_logps"], or the reference model's per-token log-probs summed as TRL
sums its own), no MoE auxiliary loss, "train" mode. The logits here are already shifted: position t predicts
targets[:, t] (TRL's shift_logits / input_ids[:, 1:]), and mask is TRL's completion_mask[:, 1:] (0 / 1).
calculate_KL is loss_type != "apo_zero_unpaired"; then kl is (KL_logps - ref_KL_logps).mean().clamp(min=0), the
two summed log-probs of the mismatched KL completions passed in as kl_policy_logps and kl_ref_logps (TRL computes
them without gradient from the model and the reference model); a caller that has TRL's kl value instead passes kl.
TRL's F.sigmoid is written torch.sigmoid here (the same function; F.sigmoid is deprecated in torch 1.13).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _selective_log_softmax(logits, index):
    return torch.gather(F.log_softmax(logits, -1), -1, index.unsqueeze(-1)).squeeze(-1)


def _entropy_from_logits(logits):
    logp = F.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def kto_loss(logits, targets, mask, labels, *, loss_type="kto", beta=0.1, desirable_weight=1.0,
             undesirable_weight=1.0, ref_logps=None, ref_per_token_logps=None, kl=None, kl_policy_logps=None,
             kl_ref_logps=None):
    """(loss, metrics dict as TRL logs them, completion log-probs [B], rewards [B]). logits [B, T, V] float64
    (differentiable), targets int64 [B, T] (any value where mask is 0), mask [B, T] 0/1, labels bool [B]."""
    # per_token_logps[completion_mask == 0] = 0.0 (TRL indexes with input_ids; masked ids may be anything here)
    per_token_logps = _selective_log_softmax(logits, torch.where(mask > 0, targets, 0))
    per_token_logps = per_token_logps.masked_fill(mask == 0, 0.0)
    completion_logps = per_token_logps.sum(-1)
    chosen_idx = torch.nonzero(labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~labels, as_tuple=False).view(-1)
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    if ref_per_token_logps is not None:  # the reference model's log-probs, summed as TRL sums its own
        ref_logps = ref_per_token_logps.masked_fill(mask == 0, 0.0).sum(-1)
    ref_chosen_logps = ref_logps.index_select(0, chosen_idx)
    ref_rejected_logps = ref_logps.index_select(0, rejected_idx)

    calculate_kl = loss_type not in ("apo_zero_unpaired",)
    if calculate_kl and kl is None:
        kl = (kl_policy_logps - kl_ref_logps).mean().detach().clamp(min=0)
    elif calculate_kl:
        kl = torch.as_tensor(kl, dtype=logits.dtype)
    else:
        kl = torch.zeros(1, dtype=logits.dtype)

    empty = torch.zeros(0, dtype=logits.dtype)
    chosen_losses, chosen_rewards = empty, empty
    if chosen_logps.shape[0] != 0 or ref_chosen_logps.shape[0] != 0:
        chosen_logratios = chosen_logps - ref_chosen_logps
        if loss_type == "kto":
            chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
        elif loss_type == "apo_zero_unpaired":
            chosen_losses = 1 - torch.sigmoid(beta * chosen_logratios)
        chosen_rewards = beta * chosen_logratios.detach()
    rejected_losses, rejected_rewards = empty, empty
    if rejected_logps.shape[0] != 0 or ref_rejected_logps.shape[0] != 0:
        rejected_logratios = rejected_logps - ref_rejected_logps
        if loss_type == "kto":
            rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
        elif loss_type == "apo_zero_unpaired":
            rejected_losses = torch.sigmoid(beta * rejected_logratios)
        rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)

    metrics = {"kl": float(kl)}
    detached = logits.detach()
    entropy_sum = (_entropy_from_logits(detached) * mask).sum()
    total_tokens = mask.sum()
    metrics["entropy"] = (entropy_sum / total_tokens).item() if total_tokens > 0 else 0.0
    chosen_mask, rejected_mask = mask.index_select(0, chosen_idx), mask.index_select(0, rejected_idx)
    total_chosen_logits = detached.index_select(0, chosen_idx)[chosen_mask.bool()].mean(-1).sum()
    total_rejected_logits = detached.index_select(0, rejected_idx)[rejected_mask.bool()].mean(-1).sum()
    if chosen_mask.sum() > 0:
        metrics["logits/chosen"] = (total_chosen_logits / chosen_mask.sum()).item()
    if rejected_mask.sum() > 0:
        metrics["logits/rejected"] = (total_rejected_logits / rejected_mask.sum()).item()
    num_chosen, num_rejected = len(chosen_idx), len(rejected_idx)
    if num_chosen > 0:
        metrics["rewards/chosen"] = chosen_rewards.nansum().item() / num_chosen
        metrics["logps/chosen"] = chosen_logps.detach().nansum().item() / num_chosen
    if num_rejected > 0:
        metrics["rewards/rejected"] = rejected_rewards.nansum().item() / num_rejected
        metrics["logps/rejected"] = rejected_logps.detach().nansum().item() / num_rejected
    if num_chosen > 0 and num_rejected > 0:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    rewards = beta * (completion_logps - ref_logps).detach()
    return losses.nanmean(), metrics, completion_logps.detach(), rewards
