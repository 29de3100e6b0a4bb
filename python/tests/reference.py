"""The torch reference: F.cross_entropy(F.linear(...)) plus softcap and z-loss, written in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_loss(x, w, t, b=None, *, layout="vh", ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   class_weights=None, softcap=0.0, z_loss=0.0, return_z_loss=False):
    """x [..., H]; w [V, H] ('vh') or [H, V] ('hv'); t x's leading shape. Computes in x's dtype."""
    weight = w if layout == "vh" else w.t()
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, b)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    tt = t.reshape(-1)
    loss = F.cross_entropy(logits, tt, weight=class_weights, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    mask = (tt != ignore_index).to(logits.dtype)
    zl = z_loss * torch.logsumexp(logits, dim=-1) ** 2 * mask  # never class-weighted
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
