"""fused_linear_logprobs against torch in float64: log_softmax(softcap(scale F.linear(h, W, b)) / T).gather(...) and
the entropy -sum p log p, with autograd, through losses built on the [N] outputs.

Tolerances: 1e-5 on values and 1e-4 relative (normwise) on gradients, the issue's; the fused path computes fp32
logits (errors ~1e-6 at these scales), so a wrong term (a missing 1/temperature, the entropy's shift, a gradient at
an ignored token) is far outside them. bf16 inputs: the reference runs on the same bf16 values in float64; the
GEMMs read dU rounded to bf16, so gradients get 1e-2 (docs/bf16.md: ~4e-3 normwise typical)."""
import pytest
import torch

from fusedhead import Context
from fusedhead.torch import fused_linear_logprobs

torch.manual_seed(0)


def reference(h, w, b, targets, temperature, softcap, logit_scale, ignore_index=-100):
    u = torch.nn.functional.linear(h, w, b) * (logit_scale or 1.0)
    if softcap:
        u = softcap * torch.tanh(u / softcap)
    s = u / temperature
    logq = torch.log_softmax(s, dim=-1)
    keep = targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    logp = logq.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    lse = torch.logsumexp(s, dim=-1)
    zero = torch.zeros((), dtype=s.dtype)
    return tuple(torch.where(keep, t, zero) for t in (logp, entropy, lse))


def inputs(B=3, T=11, H=24, V=301, dtype=torch.float32, bias=True, ignore=0.25):
    h = torch.randn(B, T, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) * 0.3
    b = torch.randn(V, dtype=torch.float64) * 0.1 if bias else None
    targets = torch.randint(0, V, (B, T))
    targets[torch.rand(B, T) < ignore] = -100
    if dtype == torch.bfloat16:
        h, w = h.to(torch.bfloat16).to(torch.float64), w.to(torch.bfloat16).to(torch.float64)
    return h, w, b, targets


def rel(a, b):
    return float((a.double() - b).norm() / max(float(b.norm()), 1e-30))


@pytest.fixture(params=["kept", "recomputed"])
def logits_path(request, monkeypatch):
    """Both backward paths: the logits kept from the forward (the default at these sizes) and recomputed."""
    if request.param == "recomputed":
        monkeypatch.setattr(Context, "keeps_logits", lambda self, n, vocab: False)
    return request.param


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_autograd(temperature, with_entropy, dtype, logits_path):
    h, w, b, targets = inputs(dtype=dtype)
    adv = torch.randn(3, 1, dtype=torch.float64)
    coef = torch.randn(3, 11, dtype=torch.float64)

    def objective(logp, entropy, lse):
        # A policy-gradient-style loss on the [B, T] vectors, plus lse (z-loss style) and the entropy bonus.
        loss = -(logp * adv).sum() + 0.01 * (lse ** 2).sum()
        return loss - 0.1 * (entropy * coef).sum() if with_entropy else loss

    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, b))
    ref = reference(hr, wr, br, targets, temperature, None, None)
    objective(*ref).backward()
    hf, wf = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    bf = b.to(torch.float32).requires_grad_()
    logp, entropy, lse = fused_linear_logprobs(hf, wf, targets, temperature, return_entropy=True, return_lse=True,
                                               bias=bf)
    assert logp.shape == (3, 11) and logp.dtype == torch.float32
    vtol = 1e-5 * max(1.0, 1.0 / temperature) if dtype == torch.float32 else 2e-4
    for got, want in zip((logp, entropy, lse), ref):
        assert float((got.double() - want).abs().max()) <= vtol
    objective(logp.double(), entropy.double(), lse.double()).backward()
    gtol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel(hf.grad, hr.grad) <= gtol and rel(wf.grad, wr.grad) <= gtol and rel(bf.grad, br.grad) <= gtol
    ignored = targets == -100
    assert bool((logp[ignored] == 0).all() and (entropy[ignored] == 0).all())
    assert bool((hf.grad[ignored] == 0).all())


@pytest.mark.parametrize("softcap, logit_scale", [(5.0, None), (None, 0.5), (5.0, 2.0)])
def test_softcap_and_logit_scale(softcap, logit_scale, logits_path):
    h, w, b, targets = inputs(bias=False)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_entropy, _ = reference(hr, wr, None, targets, 0.8, softcap, logit_scale)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    logp, entropy = fused_linear_logprobs(hf, wf, targets, temperature=0.8, return_entropy=True, softcap=softcap,
                                          logit_scale=logit_scale)
    scale = max(1.0, (logit_scale or 1.0) / 0.8)
    assert float((logp.double() - ref_logp).abs().max()) <= 1e-5 * scale
    (logp.sum() + entropy.sum()).backward()
    assert rel(hf.grad, hr.grad) <= 1e-4 and rel(wf.grad, wr.grad) <= 1e-4


def test_only_logp_used_and_no_grad():
    """Only logp used: the other outputs' gradients are NULL (not computed); under no_grad, the forward alone."""
    h, w, b, targets = inputs(bias=False)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    reference(hr, wr, None, targets, 1.0, None, None)[0].sum().backward()
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    fused_linear_logprobs(hf, wf, targets).sum().backward()
    assert rel(hf.grad, hr.grad) <= 1e-4 and rel(wf.grad, wr.grad) <= 1e-4
    with torch.no_grad():
        logp = fused_linear_logprobs(hf, wf, targets)
    assert not logp.requires_grad
    assert float((logp.double() - reference(h, w, None, targets, 1.0, None, None)[0]).abs().max()) <= 1e-5


def _calls_made(monkeypatch) -> list:
    """The names of the library functions every Context calls from now on."""
    made = []
    original = Context.call

    def spy(self, function, *args, **kwargs):
        made.append(function)
        return original(self, function, *args, **kwargs)

    monkeypatch.setattr(Context, "call", spy)
    return made


def test_logits_kept_only_for_a_backward_within_half_the_budget(monkeypatch):
    """The forward keeps the [N, V] logits for the backward (fh_logprob_forward_keep, fh_logprob_backward_kept) when
    a gradient will be taken and they take at most half of the memory budget; under no_grad, or on a context whose
    budget is smaller, the plain pair: the backward recomputes them. Each path's gradient matches the reference."""
    h, w, b, targets = inputs(bias=False)  # N V 4 = 33 x 301 x 4 = 39732 bytes
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    reference(hr, wr, None, targets, 1.0, None, None)[0].sum().backward()
    made = _calls_made(monkeypatch)
    for budget, kept in ((None, True), (79464, True), (79463, False)):
        made.clear()
        context = Context(memory_budget=budget)
        hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
        fused_linear_logprobs(hf, wf, targets, context=context).sum().backward()
        assert rel(hf.grad, hr.grad) <= 1e-4 and rel(wf.grad, wr.grad) <= 1e-4
        expected = ["fh_logprob_forward_keep", "fh_logprob_backward_kept"] if kept else \
            ["fh_logprob_forward", "fh_logprob_backward"]
        assert [f for f in made if f.startswith("fh_logprob")] == expected, (budget, made)
        made.clear()
        with torch.no_grad():
            fused_linear_logprobs(hf, wf, targets, context=context)
        assert [f for f in made if f.startswith("fh_logprob")] == ["fh_logprob_forward"]
        context.close()


def test_flat_inputs_and_layout_hv():
    h, w, b, targets = inputs()
    logp = fused_linear_logprobs(h.float().reshape(-1, 24), w.float().t().contiguous(), targets.reshape(-1),
                                 bias=b.float(), layout="hv")
    assert logp.shape == (33,)
    assert float((logp.double() - reference(h, w, b, targets, 1.0, None, None)[0].reshape(-1)).abs().max()) <= 1e-5


def test_numpy_forward_and_gradients():
    """fusedhead.numpy.logprobs: the forward alone, and with upstream gradients the single call's gradients, against
    the float64 reference (same tolerances)."""
    import numpy as np
    import fusedhead.numpy as fhnp
    h, w, b, targets = inputs()
    g = [torch.randn(3, 11, dtype=torch.float64) for _ in range(3)]
    hr, wr, br = (t.clone().requires_grad_() for t in (h, w, b))
    ref = reference(hr, wr, br, targets, 0.7, None, None)
    sum(gi * r for gi, r in zip(g, ref)).sum().backward()
    args = (h.float().numpy(), w.float().numpy(), targets.numpy(), b.float().numpy())
    r = fhnp.logprobs(*args, temperature=0.7)
    assert r.dhidden is None and r.logp.shape == (3, 11)
    for got, want in zip((r.logp, r.entropy, r.lse), ref):
        assert np.abs(got - want.detach().numpy()).max() <= 1e-5 / 0.7
    r = fhnp.logprobs(*args, temperature=0.7, g_logp=g[0].float().numpy(), g_entropy=g[1].float().numpy(),
                      g_lse=g[2].float().numpy())
    for got, want in ((r.dhidden, hr.grad), (r.dweight, wr.grad), (r.dbias, br.grad)):
        assert rel(torch.from_numpy(got), want) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_rows(dtype, monkeypatch):
    """Context(batch_invariant=True): the same 100 tokens (with the same upstream gradients) inside batches of 100, 1000
    and 4096, among other tokens, some ignored, get bit-for-bit the same log-probs, entropies and hidden-state
    gradients, also where the batch's size switches the backward between the kept logits (100 and 1000 tokens: within
    half of the 32 MiB budget) and recomputed ones (4096)."""
    H, V, shared = 48, 3001, 100
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(V, H, generator=gen) * 0.3).to(dtype)
    rows = torch.randn(shared, H, generator=gen).to(dtype)
    row_targets = torch.randint(0, V, (shared,), generator=gen)
    row_targets[::9] = -100
    row_g = torch.randn(2, shared, generator=gen)
    made = _calls_made(monkeypatch)
    context = Context(batch_invariant=True, memory_budget=32 << 20)
    results = []
    for n, at in ((100, 0), (1000, 450), (4096, 2900)):
        h = torch.randn(n, H, generator=gen).to(dtype)
        targets = torch.randint(0, V, (n,), generator=gen)
        targets[torch.rand(n, generator=gen) < 0.15] = -100
        g = torch.randn(2, n, generator=gen)
        piece = slice(at, at + shared)
        h[piece], targets[piece], g[:, piece] = rows, row_targets, row_g
        h.requires_grad_()
        logp, entropy = fused_linear_logprobs(h, w, targets, temperature=0.9, return_entropy=True, context=context)
        (logp * g[0] + entropy * g[1]).sum().backward()
        results.append((logp[piece].detach(), entropy[piece].detach(), h.grad[piece]))
    context.close()
    assert "fh_logprob_backward_kept" in made and "fh_logprob_backward" in made
    for n, result in zip((1000, 4096), results[1:]):
        for name, got, first in zip(("logp", "entropy", "dx"), result, results[0]):
            assert torch.equal(got, first), f"{name}: the 100 rows differ between batches of 100 and {n}"
