"""TRL's server-distillation loss on a teacher's top-k log-probs, in torch float64 with the student's logits
materialised and gradients by autograd: the reference fusedhead's top-k distillation head is held to.

Transcribed (written anew from reading the code, not copied) from huggingface/trl at commit
f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/experimental/server_distillation/server_distillation_trainer.py:
  - ServerDistillationTrainer._compute_server_forward_kl_loss (the beta = 0 path: forward KL on the teacher's top-k,
    valid entries those whose log-prob is > -inf, loss_add_tail or renormalisation over the support),
  - _add_tail_bucket (the tail: log(-expm1(clamp(logsumexp, max=-1e-7)))),
  - _jsd_divergence with beta = 0 and a support mask (where-masked entries, nan_to_num),
  - _reduce_divergence_loss with reduction "batchmean" (sum over the completion mask / its count, clamp_min 1),
  - compute_loss: student_log_probs = log_softmax(student_logits / temperature) (the teacher server applies its own
    temperature: its log-probs are taken as given).
One micro-batch, current_gradient_accumulation_steps = 1 (the head leaves that division to the caller). TRL builds
the completion mask from labels != -100; here it is targets != ignore_index (every token when targets is None).
fusedhead's additions, not in TRL's server path, are written beside it: the 'sum' and 'none' reductions (the same
per-token divergence, summed over the support, 0 where ignored) and the hard-label cross-entropy on the untempered
logits (weight_hard_loss, as fusedhead's distillation head).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_tail_bucket(log_probs: torch.Tensor, valid_mask: torch.Tensor):
    """_add_tail_bucket: a (k+1)-th entry log(1 - sum exp(log_probs)), its mask True."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True)
    log_sum = torch.clamp(log_sum, max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    tail_mask = torch.ones_like(valid_mask[..., :1], dtype=torch.bool)
    return torch.cat([log_probs, tail], dim=-1), torch.cat([valid_mask, tail_mask], dim=-1)


def forward_kl_with_support(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                            support_mask: torch.Tensor) -> torch.Tensor:
    """_jsd_divergence(beta=0, support_mask): teacher_probs * (teacher - student) per entry, masked entries 0."""
    zero = torch.zeros_like(student_log_probs)
    safe_student = torch.where(support_mask, student_log_probs, zero)
    safe_teacher = torch.where(support_mask, teacher_log_probs, zero)
    teacher_probs = torch.where(support_mask, teacher_log_probs.exp(), zero)
    return torch.nan_to_num(teacher_probs * (safe_teacher - safe_student), nan=0.0)


def server_forward_kl(student_log_probs: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                      add_tail: bool) -> torch.Tensor:
    """_compute_server_forward_kl_loss up to its reduction: the per-entry divergence [N, k (+1)]."""
    valid = teacher_logprobs > float("-inf")
    neg_inf = torch.full((), float("-inf"), dtype=student_log_probs.dtype)
    student_topk = student_log_probs.gather(dim=-1, index=teacher_ids)
    student_topk = torch.where(valid, student_topk, neg_inf)
    teacher_topk = torch.where(valid, teacher_logprobs, neg_inf)
    if add_tail:
        student_sparse, support_mask = add_tail_bucket(student_topk, valid)
        teacher_sparse, _ = add_tail_bucket(teacher_topk, valid)
    else:
        support_mask = valid
        student_sparse = student_topk - torch.logsumexp(student_topk, dim=-1, keepdim=True)
        teacher_sparse = teacher_topk - torch.logsumexp(teacher_topk, dim=-1, keepdim=True)
    return forward_kl_with_support(student_sparse, teacher_sparse, support_mask)


def distill_topk_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                      teacher_logprobs: torch.Tensor, targets=None, bias=None, *, add_tail=True, temperature=1.0,
                      weight_soft_loss=1.0, weight_hard_loss=0.0, ignore_index=-100, reduction="mean"):
    """(loss, soft_loss, hard_loss, per_token_loss) in float64: hidden [N, H], weight [V, H] (nn.Linear's), teacher
    [N, k] ids (int64) and log-probs (-inf: padding, as TRL's server fill; its id is replaced by 0, as TRL's
    _topk_to_tensor fills them, before the gather)."""
    logits = F.linear(hidden, weight, bias)
    student_log_probs = F.log_softmax(logits / temperature, dim=-1)
    lp = teacher_logprobs.to(torch.float64)
    ids = torch.where(lp > float("-inf"), teacher_ids, torch.zeros_like(teacher_ids))
    divergence = server_forward_kl(student_log_probs, ids, lp, add_tail)
    n = hidden.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if targets is None else targets != ignore_index
    per_token_soft = torch.where(mask, divergence.sum(dim=-1), torch.zeros(n, dtype=torch.float64))
    if targets is not None:
        safe = torch.where(mask, targets, torch.zeros_like(targets))
        ce = F.cross_entropy(logits, safe, reduction="none")
        per_token_hard = torch.where(mask, ce, torch.zeros_like(ce))
    else:
        per_token_hard = torch.zeros(n, dtype=torch.float64)
    per_token = weight_soft_loss * per_token_soft + weight_hard_loss * per_token_hard
    if reduction == "mean":
        # _reduce_divergence_loss, batchmean: jsd[mask].sum() / mask.sum().clamp_min(1)
        denom = mask.sum().clamp_min(1)
        soft = divergence[mask].sum() / denom
        hard = per_token_hard.sum() / denom
        loss = weight_soft_loss * soft + weight_hard_loss * hard
    elif reduction == "sum":
        soft, hard = per_token_soft.sum(), per_token_hard.sum()
        loss = weight_soft_loss * soft + weight_hard_loss * hard
    else:
        soft, hard = per_token_soft.sum(), per_token_hard.sum()
        loss = per_token
    return loss, soft, hard, per_token
