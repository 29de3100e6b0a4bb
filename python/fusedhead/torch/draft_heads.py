"""Speculative-decoding draft heads: EAGLE-3's loss, a draft lm_head over a subset of the target's vocabulary
distilled from the target's head, without either head's logits.

SpecForge (specforge/core/eagle3.py _compute_target_p at ee22b877, specforge/core/loss.py _compute_loss at
91ed55cb), per position i of the B*T the draft predicts:
    z = target logits over the target's whole vocabulary,   position_i = t2d[argmax z_i] * loss_mask_i
    q_i = softmax(z_i[t2d])  (the target's distribution renormalised over the draft vocabulary)
    loss = -(1 / (B T)) sum_i position_i sum_j q_ij log softmax(draft logits_i)_j
The target head is frozen (no gradient); the gradient reaches the draft's hidden states and its lm_head. Here it is
three library calls: the target's argmax over its whole vocabulary (fh_ce_forward's argmax, streaming), then
forward KL from the target's head restricted to the draft's ids (its weight's rows gathered, [V_draft, H]) to the
draft's head over the positions that count (fh_distill_forward_backward, 'sum', upstream 1 / (B T)), plus the
target's entropy over the draft vocabulary at those positions (fh_logprob_forward), since SpecForge's soft
cross-entropy is forward KL + that entropy.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._core import CEProblem, Context, DistillProblem, LogprobProblem, default_context, distill_options
from ._ops import TrainStep
from ._tensors import INT64_HINT, TorchLinear, check_tensor, scalar, token_vector, view

_ARGS = (("Tensor", "draft_hidden"), ("Tensor", "draft_weight"), ("Tensor?", "draft_bias"),
         ("Tensor", "target_hidden"), ("Tensor", "target_weight"), ("Tensor", "draft_ids"), ("Tensor", "loss_mask"))


class _Eagle3:
    """One EAGLE-3 call, checked: the draft's TorchLinear (its weight [V_draft, H_draft]), the target's (detached,
    [V, H_target]), draft_ids (int64 [V_draft]: the target id of each draft id, distinct, in [0, V)), loss_mask (the
    draft hidden's leading shape, nonzero where a position counts)."""

    def __init__(self, a: dict):
        self.draft = TorchLinear(a["draft_hidden"], a["draft_weight"], a["draft_bias"], "vh")
        self.target = TorchLinear(a["target_hidden"].detach(), a["target_weight"].detach(), None, "vh")
        self.token_shape = self.draft.hidden_shape[:-1]
        n = self.draft.n
        if self.target.n != n:
            raise ValueError(f"target_hidden: expected as many positions as draft_hidden's ({n}), got {self.target.n}")
        ids = check_tensor(a["draft_ids"], "draft_ids", torch.int64, INT64_HINT)
        if tuple(ids.shape) != (self.draft.vocab,):
            raise ValueError(f"draft_ids: expected [V_draft] = [{self.draft.vocab}] (the target id of each draft id), "
                             f"got {list(ids.shape)}")
        if not self.draft.fake:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.target.vocab):
                raise ValueError(f"draft_ids: every id must be in [0, {self.target.vocab}) (the target's vocabulary)")
            if ids.unique().numel() != ids.numel():
                raise ValueError("draft_ids: an id is listed twice (each draft id maps to its own target id)")
        self.ids = ids
        mask = a["loss_mask"]
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"loss_mask: expected a torch.Tensor, got {type(mask).__name__}")
        self.loss_mask = token_vector(mask.detach(), "loss_mask", self.token_shape, n, "draft_hidden's leading "
                                      "dimensions")


def _run(a: dict, need, context: Optional[Context]):
    """(loss,), the gradients of the loss (draft hidden and draft weight)."""
    e = _Eagle3(a)
    n = e.draft.n
    grads = e.draft.alloc_grads(*need)
    if not e.draft.computes:
        return (scalar(None, e.draft.dtype),), grads
    ctx = context or default_context()
    # The target's argmax over its whole vocabulary: every row ignored (no loss), argmax is defined for them all.
    none = torch.full((n,), -100, dtype=torch.int64)
    argmax = torch.empty(n, dtype=torch.int64)
    CEProblem(e.target.head, view(none), reduction="sum").forward(ctx, argmax=argmax.data_ptr())
    in_draft = torch.zeros(e.target.vocab, dtype=torch.bool)
    in_draft[e.ids] = True
    counts = in_draft[argmax] & (e.loss_mask != 0)
    # The target's head over the draft vocabulary, in draft-id order; a row counts where position_i = 1 (its
    # target, 0, unused: no hard loss).
    restricted = TorchLinear(a["target_hidden"].detach(), a["target_weight"].detach().index_select(0, e.ids), None,
                             "vh")
    targets = torch.where(counts, torch.zeros_like(none), none)
    kl = DistillProblem(e.draft.head, restricted.head, view(targets),
                        distill_options(divergence="forward_kl", reduction="sum"))
    if any(need):
        upstream = torch.full((1,), 1.0 / n, dtype=torch.float32)
        kl_sum = kl.forward_backward(ctx, upstream.data_ptr(), e.draft.grads_struct(*grads))[0]
    else:
        kl_sum = kl.forward(ctx)[0]
    entropy = torch.zeros(n, dtype=torch.float32)
    LogprobProblem(restricted.head, view(targets)).forward(ctx, entropy=entropy.data_ptr())
    loss = (kl_sum + float(entropy.double().sum())) / n
    return (scalar(loss, e.draft.dtype),), grads


_EAGLE3 = TrainStep("eagle3", _ARGS, 1, _run, "fh_distill", grad_args=("draft_hidden", "draft_weight", "draft_bias"))


def fused_linear_eagle3_loss(draft_hidden: torch.Tensor, draft_weight: torch.Tensor, target_hidden: torch.Tensor,
                             target_weight: torch.Tensor, draft_ids: torch.Tensor, loss_mask: torch.Tensor, *,
                             draft_bias: Optional[torch.Tensor] = None,
                             context: Optional[Context] = None) -> torch.Tensor:
    """SpecForge's EAGLE-3 draft-head loss (one TTT step's) without the [B*T, V] target logits or the draft's
    [B*T, V_draft] logits: -(1 / (B T)) sum over positions of position_mask * sum_j q_j log softmax(draft logits)_j,
    q the target's softmax renormalised over the draft vocabulary, position_mask = (the target's argmax over its whole
    vocabulary is a draft id) * loss_mask (module docstring). draft_hidden [..., H_d] and target_hidden [..., H_t]
    (the positions' final hidden states), draft_weight [V_draft, H_d] (the draft's lm_head, trained), target_weight
    [V, H_t] (the target's, frozen: detached); draft_ids int64 [V_draft], the target id of each draft id (SpecForge's
    t2d.nonzero() or arange(V_draft) + d2t); loss_mask of the hidden states' leading shape. float32 or bfloat16 (each
    head's hidden and weight alike); draft_bias [V_draft] or None (SpecForge's draft head has none). Returns the loss,
    differentiable in draft_hidden, draft_weight and draft_bias."""
    (loss,) = _EAGLE3(context, draft_hidden=draft_hidden, draft_weight=draft_weight, draft_bias=draft_bias,
                      target_hidden=target_hidden.detach(), target_weight=target_weight.detach(), draft_ids=draft_ids,
                      loss_mask=loss_mask)
    return loss
