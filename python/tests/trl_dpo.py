"""A float64 transcription of TRL's current DPO loss and logged metrics, for fusedhead's tests.

Transcribed from huggingface/trl at f2cd57710ae345ea6428ae95363267fcf38a3dc8: trl/trainer/dpo_trainer.py,
DPOTrainer._compute_loss (the non-Liger path; the refactor e3b7897c8 "Refactor DPO", first released in v0.29.0),
with selective_log_softmax and entropy_from_logits from trl/trainer/utils.py and the defaults of
trl/trainer/dpo_config.py (beta 0.1, loss_type ["sigmoid"], loss_weights None = 1 each, label_smoothing 0,
discopop_tau 0.05). It starts where the model's forward has returned: the logits are given, and the reference's
sequence log-probs are given as TRL takes them with precompute_ref_log_probs (ref_chosen_logps, ref_rejected_logps:
sums over the shifted completion mask, what its own reference forward computes too). Left out: ld_alpha (None),
f_divergence_type (reverse_kl), use_weighting (False), the MoE aux loss, the accelerator's gathers (one process) and
num_tokens (the running sum of attention_mask, the trainer's bookkeeping)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    logps = F.log_softmax(logits, dim=-1)
    return -(torch.exp(logps) * logps).sum(-1)


def dpo_compute_loss(logits, input_ids, completion_mask, ref_chosen_logps, ref_rejected_logps, *, beta=0.1,
                     loss_type=("sigmoid",), loss_weights=None, label_smoothing=0.0, discopop_tau=0.05):
    """(loss, metrics) of DPOTrainer._compute_loss. logits [2B, L, V] float64 (differentiable), input_ids [2B, L],
    completion_mask [2B, L] 0/1 (the batch is [chosen, rejected]); ref_*_logps [B]."""
    loss_types = list(loss_type)
    loss_weights = loss_weights or [1.0] * len(loss_types)
    shift_logits = logits[..., :-1, :]
    shift_labels = input_ids[..., 1:]
    shift_completion_mask = completion_mask[..., 1:]
    per_token_logps = selective_log_softmax(shift_logits, shift_labels)
    per_token_logps[shift_completion_mask == 0] = 0.0
    logps = per_token_logps.sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)

    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = chosen_logratios, rejected_logratios  # reverse_kl
    delta_score = chosen_scores - rejected_scores

    loss = 0.0
    for lt, loss_weight in zip(loss_types, loss_weights, strict=True):
        if lt == "sigmoid":
            per_sequence_loss = -F.logsigmoid(beta * delta_score)
        elif lt == "hinge":
            per_sequence_loss = torch.relu(1 - beta * delta_score)
        elif lt == "ipo":
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
            rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
            ipo_delta = chosen_avg_score - rejected_avg_score
            per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
        elif lt == "exo_pair":
            epsilon = torch.tensor(label_smoothing, dtype=logits.dtype)
            qw = torch.sigmoid(beta * delta_score)
            log_qw = F.logsigmoid(beta * delta_score)
            log_pw = torch.log1p(-epsilon)
            ql = torch.sigmoid(-beta * delta_score)
            log_ql = F.logsigmoid(-beta * delta_score)
            log_pl = torch.log(epsilon)
            per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
        elif lt == "nca_pair":
            chosen_rewards = beta * chosen_scores
            rejected_rewards = beta * rejected_scores
            per_sequence_loss = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                                 - 0.5 * F.logsigmoid(-rejected_rewards))
        elif lt == "robust":
            clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
            flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
            per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
        elif lt == "bco_pair":
            chosen_rewards = beta * chosen_scores
            rejected_rewards = beta * rejected_scores
            per_sequence_loss = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
        elif lt == "sppo_hard":
            winner_margin_error = (chosen_scores - 0.5 / beta) ** 2
            loser_margin_error = (rejected_scores + 0.5 / beta) ** 2
            per_sequence_loss = winner_margin_error + loser_margin_error
        elif lt == "aot":
            logratios = chosen_logps - rejected_logps
            ref_logratios = ref_chosen_logps - ref_rejected_logps
            logratios_sorted, _ = torch.sort(logratios, dim=0)
            ref_logratios_sorted, _ = torch.sort(ref_logratios, dim=0)
            delta = logratios_sorted - ref_logratios_sorted
            per_sequence_loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                                 - F.logsigmoid(-beta * delta) * label_smoothing)
        elif lt == "aot_unpaired":
            chosen_logratios_sorted, _ = torch.sort(chosen_logratios, dim=0)
            rejected_logratios_sorted, _ = torch.sort(rejected_logratios, dim=0)
            delta = chosen_logratios_sorted - rejected_logratios_sorted
            per_sequence_loss = (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
                                 - F.logsigmoid(-beta * delta) * label_smoothing)
        elif lt == "apo_zero":
            losses_chosen = 1 - torch.sigmoid(beta * chosen_logratios)
            losses_rejected = torch.sigmoid(beta * rejected_logratios)
            per_sequence_loss = losses_chosen + losses_rejected
        elif lt == "apo_down":
            losses_chosen = torch.sigmoid(beta * chosen_logratios)
            losses_rejected = 1 - torch.sigmoid(beta * delta_score)
            per_sequence_loss = losses_chosen + losses_rejected
        elif lt == "discopop":
            dlogits = delta_score * beta
            log_ratio_modulation = torch.sigmoid(dlogits / discopop_tau)
            logistic_component = -F.logsigmoid(dlogits)
            exp_component = torch.exp(-dlogits)
            per_sequence_loss = (logistic_component * (1 - log_ratio_modulation)
                                 + exp_component * log_ratio_modulation)
        elif lt == "sft":
            chosen_logits, _ = shift_logits.chunk(2, dim=0)
            chosen_labels, _ = shift_labels.chunk(2, dim=0)
            chosen_mask, _ = shift_completion_mask.chunk(2, dim=0)
            batch_loss = F.cross_entropy(chosen_logits[chosen_mask.bool()], chosen_labels[chosen_mask.bool()])
            per_sequence_loss = batch_loss.expand(chosen_logits.size(0))
        elif lt == "sigmoid_norm":
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
            rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
            delta = chosen_avg_score - rejected_avg_score
            per_sequence_loss = -F.logsigmoid(beta * delta)
        else:
            raise ValueError(f"Unknown loss type: {lt}")
        loss += per_sequence_loss.mean() * loss_weight

    metrics = {}
    per_token_entropy = entropy_from_logits(shift_logits.detach())
    mask = shift_completion_mask
    entropy_sum = (per_token_entropy * mask).sum()
    total_tokens = mask.sum()
    metrics["entropy"] = (entropy_sum / total_tokens).item() if total_tokens > 0 else 0.0

    chosen_logits, rejected_logits = shift_logits.detach().chunk(2, dim=0)
    chosen_mask, rejected_mask = shift_completion_mask.chunk(2, dim=0)
    total_chosen_logits = chosen_logits[chosen_mask.bool()].mean(-1).sum()
    total_chosen_tokens = chosen_mask.sum()
    total_rejected_logits = rejected_logits[rejected_mask.bool()].mean(-1).sum()
    total_rejected_tokens = rejected_mask.sum()
    metrics["logits/chosen"] = (total_chosen_logits / total_chosen_tokens).item() if total_chosen_tokens > 0 else 0.0
    metrics["logits/rejected"] = ((total_rejected_logits / total_rejected_tokens).item()
                                  if total_rejected_tokens > 0 else 0.0)

    predictions = chosen_logits.argmax(dim=-1)
    chosen_mask = shift_completion_mask[: len(shift_completion_mask) // 2].bool()
    chosen_labels = shift_labels[: len(shift_labels) // 2]
    correct_predictions = (predictions == chosen_labels) & chosen_mask
    total_sum = chosen_mask.sum()
    metrics["mean_token_accuracy"] = (correct_predictions.sum() / total_sum).item() if total_sum > 0 else 0.0

    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics["rewards/chosen"] = chosen_rewards.mean().item()
    metrics["rewards/rejected"] = rejected_rewards.mean().item()
    metrics["rewards/accuracies"] = (chosen_rewards > rejected_rewards).float().mean().item()
    metrics["rewards/margins"] = (chosen_rewards - rejected_rewards).mean().item()
    metrics["logps/chosen"] = chosen_logps.detach().mean().item()
    metrics["logps/rejected"] = rejected_logps.detach().mean().item()
    return loss, metrics
