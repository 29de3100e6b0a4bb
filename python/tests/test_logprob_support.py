"""fused_linear_logprobs over a support (support_ids, padded or CSR) against torch in float64: the logits masked to
each token's support (-inf elsewhere), log_softmax, the entropy and logsumexp over what is left, with autograd.

Tolerances: those of test_logprob.py (1e-5 on values, 1e-4 normwise on gradients): the support's logits are dot
products summed in double and rounded to fp32, dU stays fp32. bf16 inputs: the reference runs on the same bf16
values in float64 and no GEMM rounds dU to bf16 here, so the fp32 tolerances hold for the values; gradients 4e-3:
bf16 dx and dweight are fp32 sums rounded once to bf16, whose unit roundoff 2^-8 = 3.9e-3 bounds each element's
relative error and so the normwise one (1.6e-3 to 1.8e-3 seen), plus the fp32 1e-4."""
import numpy as np
import pytest
import torch

from fusedhead import errors
from fusedhead import numpy as fhn
from fusedhead.torch import fused_linear_logprobs

torch.manual_seed(0)
B, T, H, V = 3, 7, 24, 301


def support_of(targets: torch.Tensor, k: int, ignore_index: int = -100) -> torch.Tensor:
    """[B, T, k] ids: each token's target and k - 1 other distinct random ids, shuffled; one entry other than the
    target of every third token -1 (padding); an ignored token gets random ids."""
    flat = targets.reshape(-1)
    rows = []
    for i, y in enumerate(flat.tolist()):
        others = torch.randperm(V)
        others = others[others != y][: k - 1] if y != ignore_index else others[:k]
        row = torch.cat([torch.tensor([y]), others]) if y != ignore_index else others
        row = row[torch.randperm(k)]
        if i % 3 == 2 and k > 1:
            row[int((row != y).nonzero()[0])] = -1
        rows.append(row)
    return torch.stack(rows).reshape(*targets.shape, k)


def csr_of(padded: torch.Tensor):
    """The same support as CSR: (ids, offsets)."""
    rows = [r[r >= 0] for r in padded.reshape(-1, padded.shape[-1])]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(r) for r in rows]), 0)
    return torch.cat(rows), offsets


def reference(h, w, b, targets, support, temperature, softcap=None, logit_scale=None, ignore_index=-100):
    u = torch.nn.functional.linear(h, w, b) * (logit_scale or 1.0)
    if softcap:
        u = softcap * torch.tanh(u / softcap)
    s = u / temperature
    inside = torch.zeros(*s.shape[:-1], V + 1, dtype=torch.bool)  # padding marks the extra column, then dropped
    inside.scatter_(-1, torch.where(support >= 0, support, V), True)
    inside = inside[..., :V]
    masked = s.masked_fill(~inside, float("-inf"))
    lse = torch.logsumexp(masked, -1)
    logq = masked - lse.unsqueeze(-1)
    keep = targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    logp = logq.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq.masked_fill(~inside, 0.0)).sum(-1)
    zero = torch.zeros((), dtype=s.dtype)
    return tuple(torch.where(keep, t, zero) for t in (logp, entropy, lse))


def rel(a, b):
    return float((a.double() - b).norm() / max(float(b.norm()), 1e-30))


def inputs(dtype=torch.float32, k=8):
    h = torch.randn(B, T, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) * 0.3
    b = torch.randn(V, dtype=torch.float64) * 0.1
    targets = torch.randint(0, V, (B, T))
    targets[torch.rand(B, T) < 0.2] = -100
    if dtype == torch.bfloat16:
        h, w = h.to(torch.bfloat16).to(torch.float64), w.to(torch.bfloat16).to(torch.float64)
    return h, w, b, targets, support_of(targets, k)


@pytest.mark.parametrize("form", ["padded", "csr"])
@pytest.mark.parametrize("k", [1, 8, V])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_autograd(form, k, dtype):
    h, w, b, targets, support = inputs(dtype, k)
    adv = torch.randn(B, 1, dtype=torch.float64)

    def objective(logp, entropy, lse):
        return -(logp * adv).sum() + 0.01 * (lse ** 2).sum() - 0.1 * entropy.sum()

    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, b))
    ref = reference(hr, wr, br, targets, support, 0.7)
    objective(*ref).backward()
    hf, wf = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    bf = b.float().requires_grad_()
    ids, offsets = csr_of(support) if form == "csr" else (support, None)
    logp, entropy, lse = fused_linear_logprobs(hf, wf, targets, 0.7, return_entropy=True, return_lse=True, bias=bf,
                                               support_ids=ids, support_offsets=offsets)
    assert logp.shape == (B, T) and logp.dtype == torch.float32
    for got, want in zip((logp, entropy, lse), ref):
        assert float((got.detach().double() - want.detach()).abs().max()) <= 1e-5 / 0.7
    objective(logp.double(), entropy.double(), lse.double()).backward()
    gtol = 1e-4 if dtype == torch.float32 else 2.0 ** -8 + 1e-4
    assert rel(hf.grad, hr.grad) <= gtol and rel(wf.grad, wr.grad) <= gtol and rel(bf.grad, br.grad) <= gtol
    ignored = targets == -100
    assert bool((logp[ignored] == 0).all() and (hf.grad[ignored] == 0).all())
    if k == 1:  # a support of the target alone: probability 1, entropy 0
        assert bool((logp == 0).all() and (entropy == 0).all())


def test_softcap_scale_and_layout_hv():
    h, w, _, targets, support = inputs(k=16)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_entropy, _ = reference(hr, wr, None, targets, support, 0.8, 5.0, 2.0)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    hf, wf = h.float().requires_grad_(), w.float().t().contiguous().requires_grad_()  # [H, V]
    logp, entropy = fused_linear_logprobs(hf, wf, targets, 0.8, return_entropy=True, softcap=5.0, logit_scale=2.0,
                                          layout="hv", support_ids=support)
    assert float((logp.double() - ref_logp).abs().max()) <= 1e-5 * 2.0 / 0.8
    (logp.sum() + entropy.sum()).backward()
    assert rel(hf.grad, hr.grad) <= 1e-4 and rel(wf.grad.t(), wr.grad) <= 1e-4


def test_layouts_give_the_same_bits():
    """The [H, V] layout sweeps the weight's rows (src/engine/columns.c) where the [V, H] layout reads columns, each
    logit keeping the same sixteen partial sums: the log-probs, entropies and lse are the same bits in both layouts,
    H = 100 leaving a partial block of hidden indices, bf16 too."""
    g = torch.Generator().manual_seed(5)
    n, hidden, v, k = 40, 100, 3001, 9
    h, w = torch.randn(n, hidden, generator=g), torch.randn(v, hidden, generator=g) * 0.2
    targets = torch.randint(0, v, (n,), generator=g)
    support = torch.stack([(targets + 37 * e) % v for e in range(k)], -1)
    for dtype in (torch.float32, torch.bfloat16):
        hd, wd = h.to(dtype), w.to(dtype)
        vh = fused_linear_logprobs(hd, wd, targets, return_entropy=True, return_lse=True, support_ids=support)
        hv = fused_linear_logprobs(hd, wd.t().contiguous(), targets, return_entropy=True, return_lse=True,
                                   layout="hv", support_ids=support)
        for a, b in zip(vh, hv):
            assert torch.equal(a, b), (dtype, float((a.double() - b.double()).abs().max()))


def test_renormalised_full_log_probs():
    """TRL #7269's correction, log p(y) - log sum_{j in S} p(j) with the full-vocabulary log-probs, is the support's
    log-prob: fused, both ways."""
    h, w, _, targets, support = inputs(k=50)
    hf, wf = h.float(), w.float()
    logp_s = fused_linear_logprobs(hf, wf, targets, support_ids=support)
    logq = torch.log_softmax(torch.nn.functional.linear(hf, wf).double(), -1)
    kept = logq.gather(-1, support.clamp(min=0)).masked_fill(support < 0, float("-inf"))
    safe = targets.clamp(min=0)
    corrected = fused_linear_logprobs(hf, wf, safe).double() - torch.logsumexp(kept, -1)
    counted = targets != -100
    assert float((logp_s.double() - corrected)[counted].abs().max()) <= 1e-5


def test_whole_vocabulary_support_is_the_full_head():
    h, w, _, targets, _ = inputs()
    hf, wf = h.float(), w.float()
    every = torch.arange(V).expand(B, T, V)
    full = fused_linear_logprobs(hf, wf, targets, 0.9, return_entropy=True, return_lse=True)
    over = fused_linear_logprobs(hf, wf, targets, 0.9, return_entropy=True, return_lse=True, support_ids=every)
    for a, b in zip(full, over):
        assert float((a - b).abs().max()) <= 2e-5


def test_refusals_name_the_cause():
    h, w, _, targets, support = inputs(k=4)
    hf, wf = h.float(), w.float()
    counted = int((targets.reshape(-1) != -100).nonzero()[0])
    bad = support.clone().reshape(-1, 4)
    bad[counted] = torch.tensor([(int(targets.reshape(-1)[counted]) + j) % V for j in range(1, 5)])
    with pytest.raises(errors.InvalidSupportError, match=f"row {counted}: its target .* is not in its support"):
        fused_linear_logprobs(hf, wf, targets, support_ids=bad.reshape(B, T, 4))
    twice = support.clone().reshape(-1, 4)
    twice[counted, :2] = targets.reshape(-1)[counted]
    with pytest.raises(errors.InvalidSupportError, match="lists it twice"):
        fused_linear_logprobs(hf, wf, targets, support_ids=twice.reshape(B, T, 4))
    outside = support.clone()
    outside[outside == -1] = V
    with pytest.raises(errors.InvalidSupportError, match=r"outside \[0, 301\) and is not -1"):
        fused_linear_logprobs(hf, wf, targets, support_ids=outside)
    ids, offsets = csr_of(support)
    with pytest.raises(errors.InvalidSupportError, match="CSR offsets start at 0"):
        fused_linear_logprobs(hf, wf, targets, support_ids=ids, support_offsets=offsets + 1)
    with pytest.raises(ValueError, match="support_offsets without support_ids"):
        fused_linear_logprobs(hf, wf, targets, support_offsets=offsets)
    with pytest.raises(TypeError, match="support_ids: expected dtype torch.int64"):
        fused_linear_logprobs(hf, wf, targets, support_ids=support.int())
    with pytest.raises(ValueError, match=r"support_ids: expected the tokens' shape \[3, 7\] \+ \[k\]"):
        fused_linear_logprobs(hf, wf, targets, support_ids=support[:, :-1])
    with pytest.raises(ValueError, match=r"support_offsets: expected a contiguous \[N \+ 1\] = \[22\]"):
        fused_linear_logprobs(hf, wf, targets, support_ids=ids, support_offsets=offsets[:-1])


def test_numpy_front_end():
    h, w, b, targets, support = inputs(k=8)
    ids, offsets = csr_of(support)
    g = torch.randn(B, T, dtype=torch.float64)
    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, b))
    ref_logp, ref_entropy, ref_lse = reference(hr, wr, br, targets, support, 1.3)
    (ref_logp * g).sum().backward()
    for sup, off in ((support, None), (ids, offsets)):
        r = fhn.logprobs(h.float().numpy(), w.float().numpy(), targets.numpy(), b.float().numpy(), temperature=1.3,
                         g_logp=g.float().numpy(), support_ids=sup.numpy(),
                         support_offsets=None if off is None else off.numpy())
        for got, want in ((r.logp, ref_logp), (r.entropy, ref_entropy), (r.lse, ref_lse)):
            assert float(np.abs(got - want.detach().numpy()).max()) <= 1e-5
        assert rel(torch.from_numpy(r.dhidden), hr.grad) <= 1e-4 and rel(torch.from_numpy(r.dweight), wr.grad) <= 1e-4
        assert rel(torch.from_numpy(r.dbias), br.grad) <= 1e-4
