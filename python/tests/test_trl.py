"""fusedhead.trl against TRL's own code (TRL 1.16.0, python/requirements-test.txt): the per-token function every
trainer's fused LM head calls (trl.kernels.ChunkedLogProbFunction) against fusedhead's stand-in on the same inputs
(the trainers end to end: test_trl_trainers.py). Skipped without TRL (Debian's interpreter).

Tolerances: conftest's float32 ones (both sides fp32): log-probs and entropy 1e-5 relative to their size, gradients
normwise 1e-4 (GRAD_RTOL_F32).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not importable (python/requirements-test.txt installs it)")
trl = pytest.importorskip("trl", reason="trl not importable (python/requirements-test.txt installs it)")
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

import fusedhead.trl as fhtrl  # noqa: E402
from conftest import GRAD_RTOL_F32, normwise  # noqa: E402


@pytest.fixture(autouse=True)
def unpatched():
    fhtrl.unpatch()
    yield
    fhtrl.unpatch()


@pytest.mark.parametrize("head", ["plain", "bias_scale", "softcap_scale"])
def test_per_token_function_matches_trl(head, recwarn):
    g = torch.Generator().manual_seed(3)
    n, h, v = 40, 32, 3001
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.3).requires_grad_() if head != "plain" else None
    targets = torch.randint(0, v, (n,), generator=g)
    softcap = 3.0 if head == "softcap_scale" else None
    scale = 1.0 if head == "plain" else 0.5
    outputs = ("entropy", "mean_logits", "is_top1")
    fhtrl.patch()
    want = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.7, 32768, softcap, scale, outputs)
    got = fhtrl.FusedheadLogProbFunction.apply(hidden, weight, bias, targets, 0.7, 32768, softcap, scale, outputs)
    for name, a, b in zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), got, want):
        assert (a is None) == (b is None), name
        if b is None:
            continue
        if b.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            assert float((a.double() - b.double()).abs().max()) <= 1e-5 * float(b.abs().max()), name
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    w = torch.linspace(-1, 1, n)
    grads_got = torch.autograd.grad((got[0] * w).sum() + 0.3 * got[1].sum(), leaves)
    grads_want = torch.autograd.grad((want[0] * w).sum() + 0.3 * want[1].sum(), leaves)
    for a, b in zip(grads_got, grads_want):
        assert normwise(a.numpy(), b.numpy()) <= GRAD_RTOL_F32
    # softcapped mean_logits has no fusedhead form: TRL's own forward computes it, said once
    assert any("mean_logits" in str(w.message) for w in recwarn.list) == (softcap is not None)
    if softcap is not None:
        fhtrl.patch(strict=True)
        with pytest.raises(fhtrl.NotRoutedError, match="mean_logits"):
            fhtrl.FusedheadLogProbFunction.apply(hidden, weight, bias, targets, 0.7, 32768, softcap, scale, outputs)


def test_float16_goes_to_trl_loudly():
    fhtrl.patch()
    x, w = torch.randn(4, 8, dtype=torch.float16), torch.randn(50, 8, dtype=torch.float16)
    t = torch.randint(0, 50, (4,))
    with pytest.warns(fhtrl.RoutingWarning, match="float16"):
        logp = fhtrl.FusedheadLogProbFunction.apply(x, w, None, t, 1.0, 32768, None, 1.0, ())[0]
    assert logp.shape == (4,)
