"""fusedhead.torch GRPO bindings against TRL's GRPOTrainer._compute_loss written in torch float64 (logits
materialised, autograd for the gradients).

Tolerances: the library stores per-token values in fp32 and runs fp32 BLIS GEMMs (statistics and reductions in
double); against a float64 reference on the same fp32 inputs that gives loss errors of a few 1e-7 relative, so
loss and metrics are compared at rel/abs 1e-5 and gradients normwise at 1e-4 (as conftest.py's fp32 bounds;
the GRPO coefficients multiply fp32 log-prob errors by ratios and advantages of order 1, and the GSPO
sequence mean spreads them over a row).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusedhead  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from conftest import normwise  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")


# ---------------------------------------------------------------------------------------------------------
# TRL's _compute_loss in float64
# ---------------------------------------------------------------------------------------------------------
def trl_reference(h, W, b, ids, mask, A, old, ref, *, loss_type="grpo", importance_sampling_level="token",
                  temperature=1.0, epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0,
                  sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, num_items_in_batch=None,
                  max_completion_length=None, entropy_coef=0.0):
    """(loss, metrics dict, per-token logp) following TRL GRPOTrainer._compute_loss; h, W, b float64 leaves."""
    eh = epsilon_low if epsilon_high is None else epsilon_high
    Bn, Tn = ids.shape
    logits = F.linear(h, W, b) / temperature
    logsm = F.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropies = -(logsm.exp() * logsm).sum(-1)
    old_ = logp.detach() if old is None else old
    log_ratio = logp - old_
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:  # GSPO: gradient through the mean
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    Au = A.unsqueeze(1)
    if loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=eh).detach()
        per_token = -clamped * Au * logp
    elif loss_type == "sapo":
        tau = torch.where(Au > 0, torch.full_like(Au, sapo_temperature_pos), torch.full_like(Au, sapo_temperature_neg))
        per_token = (-torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * Au).expand_as(logp)
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eh)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * Au, coef_2 * Au)
    if beta != 0.0:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    m = mask
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (Bn * (max_completion_length or Tn))
    else:
        nib = num_items_in_batch if num_items_in_batch is not None else m.sum().clamp(min=1.0)
        loss = (per_token * m).sum() / nib
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (m * entropies).sum() / m.sum().clamp(min=1.0)

    def masked_batch_mean(x):
        return x.mean() if x.shape[1] == 1 else (x * m).sum() / m.sum()

    metrics = {"entropy": masked_batch_mean(entropies.detach()).item()}
    if beta != 0.0:
        metrics["kl"] = masked_batch_mean(kl.detach()).item()
    if loss_type in CLIPPED:
        lo = (coef_1 < 1 - epsilon_low) & (Au < 0)
        hi = (coef_1 > 1 + eh) & (Au > 0)
        metrics["clip_ratio/low_mean"] = masked_batch_mean(lo.double()).item()
        metrics["clip_ratio/high_mean"] = masked_batch_mean(hi.double()).item()
        metrics["clip_ratio/region_mean"] = masked_batch_mean((lo | hi).double()).item()
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_batch_mean(((coef_1 > eh) & (Au > 0)).double()).item()
    return loss, metrics, logp.detach()


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def make_grpo(seed=0, B=4, T=7, H=16, V=97, *, bias=False, old=True, ref=True, layout="vh", temperature=0.7):
    """fp32-representable data as float64 numpy; row 1 of the mask is all zero, others random 0/1 tails."""
    rng = np.random.default_rng(seed)
    d = {}
    d["h"] = rng.standard_normal((B, T, H)).astype(np.float32).astype(np.float64)
    d["W"] = (rng.standard_normal((V, H)) * (3.0 / math.sqrt(H))).astype(np.float32).astype(np.float64)
    d["b"] = (rng.standard_normal(V) * 0.5).astype(np.float32).astype(np.float64) if bias else None
    d["ids"] = rng.integers(0, V, (B, T)).astype(np.int64)
    mask = np.ones((B, T))
    for r in range(B):
        mask[r, rng.integers(2, T + 1):] = 0  # right padding
    mask[1] = 0.0
    d["mask"] = mask
    A = rng.standard_normal(B)
    A[0] = abs(A[0]) + 0.1  # both signs present
    A[2] = -abs(A[2]) - 0.1
    d["A"] = A.astype(np.float32).astype(np.float64)
    # old / ref: the current log-probs (bias left out) plus noise, so that ratios straddle the clip range
    with torch.no_grad():
        lp = F.log_softmax(F.linear(torch.tensor(d["h"]), torch.tensor(d["W"])) / temperature, -1)
        lp = lp.gather(-1, torch.tensor(d["ids"]).unsqueeze(-1)).squeeze(-1).numpy()
    d["old"] = (lp + 0.3 * rng.standard_normal((B, T))).astype(np.float32).astype(np.float64) if old else None
    d["ref"] = (lp + 0.3 * rng.standard_normal((B, T))).astype(np.float32).astype(np.float64) if ref else None
    d["layout"] = layout
    return d


def run_both(d, upstream=1.0, **opts):
    """(library loss, metrics, logp, grads), (reference loss, metrics, logp, grads); grads of upstream*loss."""
    t32 = lambda a: None if a is None else torch.tensor(a, dtype=torch.float32)  # noqa: E731
    t64 = lambda a, g=False: None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=g)  # noqa
    ids = torch.tensor(d["ids"])
    # library (float32)
    h = t32(d["h"]).requires_grad_()
    Wl = d["W"] if d["layout"] == "vh" else np.ascontiguousarray(d["W"].T)
    W = t32(Wl).requires_grad_()
    b = None if d["b"] is None else t32(d["b"]).requires_grad_()
    loss, metrics, logp = fht.fused_linear_grpo_loss(h, W, ids, t32(d["mask"]), t32(d["A"]), b, t32(d["old"]),
                                                     t32(d["ref"]), layout=d["layout"],
                                                     return_per_token_logps=True, **opts)
    (loss * upstream).backward()
    lib_grads = [h.grad, W.grad if d["layout"] == "vh" else W.grad.t(), None if b is None else b.grad]
    # reference (float64)
    h64, W64, b64 = t64(d["h"], True), t64(d["W"], True), t64(d["b"], d["b"] is not None)
    rloss, rmetrics, rlogp = trl_reference(h64, W64, b64, ids, t64(d["mask"]), t64(d["A"]), t64(d["old"]),
                                           t64(d["ref"]), **opts)
    (rloss * upstream).backward()
    ref_grads = [h64.grad, W64.grad, None if b64 is None else b64.grad]
    return (loss, metrics, logp, lib_grads), (rloss, rmetrics, rlogp, ref_grads)


def check(lib, ref, mask):
    loss, metrics, logp, grads = lib
    rloss, rmetrics, rlogp, rgrads = ref
    assert loss.item() == pytest.approx(rloss.item(), rel=LOSS_TOL, abs=LOSS_TOL)
    assert set(metrics) == set(rmetrics), (metrics, rmetrics)
    for k in rmetrics:
        assert metrics[k] == pytest.approx(rmetrics[k], rel=LOSS_TOL, abs=LOSS_TOL), k
    m = mask > 0
    np.testing.assert_allclose(logp.numpy()[m], rlogp.numpy()[m], rtol=LOSS_TOL, atol=LOSS_TOL)
    for g, rg in zip(grads, rgrads):
        assert (g is None) == (rg is None)
        if g is not None:
            assert normwise(g.numpy(), rg.numpy()) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# Every loss type x importance-sampling level x old logps x beta
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on_policy"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, level, with_old, beta):
    d = make_grpo(seed=2 * LOSS_TYPES.index(loss_type) + (level == "sequence"), old=with_old, ref=beta != 0.0, bias=beta != 0.0)
    lib, ref = run_both(d, loss_type=loss_type, importance_sampling_level=level, temperature=0.7, beta=beta)
    check(lib, ref, d["mask"])


OPTION_CASES = {
    "delta": dict(loss_type="grpo", delta=1.2, epsilon_high=0.28),
    "delta_gspo": dict(loss_type="bnpo", delta=1.1, importance_sampling_level="sequence"),
    "epsilon_alias": dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.3),
    "cispo_cap": dict(loss_type="cispo", epsilon_high=1.1),
    "sapo_taus": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, beta=0.1),
    "num_items": dict(loss_type="dapo", num_items_in_batch=40.0),
    "num_items_tensor": dict(loss_type="cispo", num_items_in_batch=torch.tensor(33)),
    "max_completion_length": dict(loss_type="dr_grpo", max_completion_length=16),
    "entropy_coef": dict(loss_type="grpo", entropy_coef=0.01, beta=0.04),
    "entropy_coef_gspo": dict(loss_type="sapo", entropy_coef=0.05, importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("case", list(OPTION_CASES), ids=list(OPTION_CASES))
def test_options(case):
    opts = dict(OPTION_CASES[case])
    d = make_grpo(seed=7, bias=True)
    plain = dict(opts)
    if "epsilon" in plain:
        plain["epsilon_low"] = plain.pop("epsilon")
    tensor_items = isinstance(plain.get("num_items_in_batch"), torch.Tensor)
    if tensor_items:
        plain["num_items_in_batch"] = float(plain["num_items_in_batch"])
    lib, ref = run_both(d, temperature=0.7, **plain)
    check(lib, ref, d["mask"])
    if tensor_items or "epsilon" in opts:  # the alias / tensor form gives the same result
        alias_loss, _ = fht.fused_linear_grpo_loss(*_inputs32(d), temperature=0.7, **opts)
        assert alias_loss.item() == lib[0].item()


def _inputs32(d):
    f = lambda a: None if a is None else torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return (f(d["h"]), f(d["W"]), torch.tensor(d["ids"]), f(d["mask"]), f(d["A"]), f(d["b"]), f(d["old"]),
            f(d["ref"]))


def test_layout_hv_and_upstream_scale():
    d = make_grpo(seed=3, bias=True, layout="hv")
    lib, ref = run_both(d, upstream=-2.5, loss_type="dapo", importance_sampling_level="sequence", beta=0.04,
                        temperature=0.7)
    check(lib, ref, d["mask"])


def test_no_grad_and_partial_grads():
    d = make_grpo(seed=5, bias=True)
    h, W, ids, mask, A, b, old, ref = _inputs32(d)
    opts = dict(loss_type="bnpo", beta=0.04, temperature=0.7)
    with torch.no_grad():
        l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, **opts)
    W.requires_grad_()
    l1, m1 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, **opts)
    assert l0.item() == l1.item() and m0 == m1
    l1.backward()
    assert h.grad is None and W.grad is not None
    # bool / integer masks are converted; the module form gives the same
    l2, _ = fht.FusedLinearGRPOLoss(**opts)(h, W, ids, mask.bool(), A, b, old, ref)
    l3, _ = fht.fused_linear_grpo_loss(h, W, ids, mask.long(), A, b, old, ref, **opts)
    assert l2.item() == l1.item() == l3.item()


def test_masked_padding_ids_out_of_range():
    """Ids of masked-out tokens need not be valid (TRL pads with pad_token_id); logp there is 0."""
    d = make_grpo(seed=11)
    h, W, ids, mask, A, b, old, ref = _inputs32(d)
    l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, beta=0.04)
    bad = ids.clone()
    bad[mask == 0] = -100
    l1, m1, logp = fht.fused_linear_grpo_loss(h, W, bad, mask, A, b, old, ref, beta=0.04,
                                              return_per_token_logps=True)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    assert torch.all(logp[mask == 0] == 0)


def test_context_and_numpy_api():
    d = make_grpo(seed=13, bias=True)
    h, W, ids, mask, A, b, old, ref = _inputs32(d)
    opts = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04, temperature=0.7)
    l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, **opts)
    with fusedhead.Context(tile_rows=8, tile_vocab=32, threads=1) as ctx:
        l1, m1 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, context=ctx, **opts)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    import fusedhead.numpy as fhnp
    r = fhnp.grpo_loss(h.numpy(), W.numpy(), ids.numpy(), mask.numpy(), A.numpy(), b.numpy(), old.numpy(),
                       ref.numpy(), return_grads=True, **opts)
    assert r.loss == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    assert r.metrics == pytest.approx(m0, rel=1e-6, abs=1e-7)
    h.requires_grad_()
    fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, **opts)[0].backward()
    assert normwise(r.dhidden, h.grad.numpy()) <= 1e-6 and r.dweight.shape == W.shape


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
def test_errors():
    d = make_grpo(seed=17)
    h, W, ids, mask, A, b, old, ref = _inputs32(d)
    with pytest.raises(TypeError, match="hidden: expected dtype torch.float32"):
        fht.fused_linear_grpo_loss(h.double(), W, ids, mask, A)
    with pytest.raises(TypeError, match="completion_ids"):
        fht.fused_linear_grpo_loss(h, W, ids.int(), mask, A)
    with pytest.raises(TypeError, match="advantages"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A.double())
    with pytest.raises(ValueError, match="completion_ids: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids[:, :-1], mask, A)
    with pytest.raises(ValueError, match="completion_mask: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask[:-1], A)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A[:-1])
    with pytest.raises(ValueError, match="old_per_token_logps: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, None, old.t())
    with pytest.raises(ValueError, match="hidden: expected \\[B, T, H\\]"):
        fht.fused_linear_grpo_loss(h.reshape(-1, h.shape[-1]), W, ids, mask, A)
    with pytest.raises(ValueError, match="weight: expected shape"):
        fht.fused_linear_grpo_loss(h, W[:, :-1], ids, mask, A)
    with pytest.raises(ValueError, match="loss_type"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, importance_sampling_level="tok")
    # the library's own checks: exception carries its status and message
    with pytest.raises(fusedhead.FusedheadValueError) as e:
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, beta=0.04)
    assert e.value.message and "ref" in e.value.message.lower()
    with pytest.raises(fusedhead.errors.InvalidGRPOOptionError) as e:
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, epsilon_low=-0.5)
    assert e.value.message
    with pytest.raises(fusedhead.errors.InvalidTemperatureError):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, temperature=0.0)
    bad = ids.clone()
    bad[0, 0] = 10_000  # masked-in token out of range
    with pytest.raises(fusedhead.TargetOutOfRangeError):
        fht.fused_linear_grpo_loss(h, W.requires_grad_(), bad, mask, A)
    neg = mask.clone()
    neg[0, 0] = -1.0
    with pytest.raises(fusedhead.errors.InvalidMaskError):
        fht.fused_linear_grpo_loss(h, W, ids, neg, A)
