"""The torch reference: F.cross_entropy(F.linear(...)) plus logit scale, softcap, z-loss and DFT, written in plain
torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_logits(x, w, b=None, *, layout="vh", logit_scale=None, softcap=0.0):
    """z = softcap * tanh(m u / softcap) (m u without softcap), u = x W^T + b over x's rows, in x's dtype."""
    weight = w if layout == "vh" else w.t()
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, b)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def reference_loss(x, w, t, b=None, *, layout="vh", ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   class_weights=None, softcap=0.0, z_loss=0.0, logit_scale=None, token_scaling=False,
                   return_z_loss=False):
    """x [..., H]; w [V, H] ('vh') or [H, V] ('hv'); t x's leading shape. Computes in x's dtype. token_scaling (DFT):
    each token's loss, its label-smoothing and z-loss terms included, times p(target) detached, as Liger-Kernel's
    use_token_scaling (TRL's dft_loss: -exp(logp).detach() * logp, i.e. ce * exp(-ce).detach() without smoothing)."""
    logits = reference_logits(x, w, b, layout=layout, logit_scale=logit_scale, softcap=softcap)
    tt = t.reshape(-1)
    mask = (tt != ignore_index).to(logits.dtype)
    scale = torch.ones_like(mask)
    if token_scaling:
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.where(tt != ignore_index, tt, 0)[:, None])[:, 0]
        scale = logp.exp().detach() * mask
    zl = z_loss * torch.logsumexp(logits, dim=-1) ** 2 * mask * scale  # never class-weighted
    if token_scaling:
        per_token = F.cross_entropy(logits, tt, weight=class_weights, ignore_index=ignore_index, reduction="none",
                                    label_smoothing=label_smoothing) * scale
        if reduction == "mean":  # torch's denominators: the targets' class weights, and the count for z
            wy = mask if class_weights is None else class_weights[torch.where(tt != ignore_index, tt, 0)] * mask
            loss = per_token.sum() / wy.sum()
        else:
            loss = per_token.sum() if reduction == "sum" else per_token
    else:
        loss = F.cross_entropy(logits, tt, weight=class_weights, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    if reduction == "mean":
        z = zl.sum() / mask.sum()
    elif reduction == "sum":
        z = zl.sum()
    else:
        z = zl
    if z_loss:
        loss = loss + z
    if reduction == "none":
        loss, z = loss.view(t.shape), z.view(t.shape)
    return (loss, z) if return_z_loss else loss


def reference_entropy_correct(x, w, t, b=None, *, layout="vh", ignore_index=-100, logit_scale=None, softcap=0.0):
    """(entropy of softmax(z) per token, 0 where ignored, in t's shape; count of tokens not ignored whose first
    largest z is their target)."""
    logits = reference_logits(x, w, b, layout=layout, logit_scale=logit_scale, softcap=softcap)
    tt = t.reshape(-1)
    keep = tt != ignore_index
    logp = torch.log_softmax(logits, dim=-1)
    entropy = torch.where(keep, -(logp.exp() * logp).sum(-1), torch.zeros((), dtype=logits.dtype))
    return entropy.view(t.shape), int(((logits.argmax(-1) == tt) & keep).sum())
