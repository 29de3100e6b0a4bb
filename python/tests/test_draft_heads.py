"""fused_linear_eagle3_loss against a float64 transcription of SpecForge's EAGLE-3 loss: specforge/core/eagle3.py
_compute_target_p (at ee22b877) and specforge/core/loss.py _compute_loss (at 91ed55cb), read there and written anew:
the target's full-vocabulary logits, their argmax checked against the draft vocabulary (t2d) and times loss_mask as
the position mask, the target's logits at the draft ids softmaxed (renormalised over the draft vocabulary), and
-sum(position_mask * target_p * log_softmax(draft logits)) over the vocabulary, the mean over every B*T position.

Tolerances: the loss 1e-5 relative (fp32 logits, sums of p-weighted log-probs in double), with bf16 inputs 2^-8 (the
loss comes back in the draft's dtype, rounded to bf16; the reference runs on the same bf16 values); gradients 1e-4
normwise (the distillation head's), 1e-2 with bf16 inputs (dU and the gradients rounded to bf16, docs/bf16.md)."""
import pytest
import torch
import torch.nn.functional as F

from fusedhead.torch import fused_linear_eagle3_loss

B, T, HD, HT, V, VD = 2, 9, 24, 20, 301, 64


def specforge_loss(draft_hidden, draft_weight, target_hidden, target_weight, t2d, loss_mask):
    """float64: SpecForge's _compute_target_p then _compute_loss on materialised logits."""
    target = F.linear(target_hidden, target_weight)                        # [B, T, V]
    position_mask = t2d[target.argmax(-1)][..., None].int() * loss_mask[..., None]
    target_p = torch.softmax(target[..., t2d], dim=2)
    logp = torch.log_softmax(F.linear(draft_hidden, draft_weight), dim=2)  # [B, T, VD]
    return -torch.sum(position_mask * target_p * logp, 2).mean()


def data(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    dh, th = torch.randn(B, T, HD, generator=g), torch.randn(B, T, HT, generator=g)
    dw, tw = torch.randn(VD, HD, generator=g) * 0.4, torch.randn(V, HT, generator=g) * 0.5
    draft_ids = torch.randperm(V, generator=g)[:VD].sort().values           # t2d's Trues in target-id order
    loss_mask = (torch.rand(B, T, generator=g) < 0.8).float()
    if dtype == torch.bfloat16:
        dh, th, dw, tw = (t.to(torch.bfloat16) for t in (dh, th, dw, tw))
    return dh, dw, th, tw, draft_ids, loss_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_specforge(dtype):
    dh, dw, th, tw, ids, mask = data(3, dtype)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    dh64, dw64 = (t.double().requires_grad_() for t in (dh, dw))
    ref = specforge_loss(dh64, dw64, th.double(), tw.double(), t2d, mask.double())
    ref.backward()
    position = t2d[F.linear(th.double(), tw.double()).argmax(-1)] & (mask > 0)
    assert 0 < int(position.sum()) < B * T, "some positions count and some do not"
    dhf, dwf = dh.clone().requires_grad_(), dw.clone().requires_grad_()
    loss = fused_linear_eagle3_loss(dhf, dwf, th, tw, ids, mask)
    assert loss.dtype == dtype
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5 if dtype == torch.float32 else 2.0 ** -8)
    loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for got, want in ((dhf.grad, dh64.grad), (dwf.grad, dw64.grad)):
        assert float((got.double() - want).norm() / want.norm()) <= tol
    assert bool((dhf.grad[~position] == 0).all()), "a position that does not count gets no gradient"


def test_refusals():
    dh, dw, th, tw, ids, mask = data(4)
    with pytest.raises(ValueError, match=r"draft_ids: expected \[V_draft\] = \[64\]"):
        fused_linear_eagle3_loss(dh, dw, th, tw, ids[:-1], mask)
    twice = ids.clone()
    twice[1] = twice[0]
    with pytest.raises(ValueError, match="listed twice"):
        fused_linear_eagle3_loss(dh, dw, th, tw, twice, mask)
    outside = ids.clone()
    outside[0] = V
    with pytest.raises(ValueError, match=r"in \[0, 301\)"):
        fused_linear_eagle3_loss(dh, dw, th, tw, outside, mask)
