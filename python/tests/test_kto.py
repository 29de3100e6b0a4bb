"""fusedhead's KTO head through fusedhead.torch and fusedhead.numpy, against a float64 transcription of TRL's
KTOTrainer._compute_loss (trl_kto.py) on materialised logits, autograd for the gradients.

Tolerances (test_preference.py's LOSS_TOL and GRAD_TOL, through its check()): the library runs fp32 GEMMs on the
same fp32 inputs and keeps per-token and per-sequence values in double, so its token log-probs err by about 1e-7
relative and a sequence log-prob, a sum of T of them, by about T times that in absolute terms. Each sequence's loss
is a sigmoid of beta times such a sum (slope at most beta / 4, times the weight), so the loss and the metrics are
compared at relative 1e-5 (metrics also absolute 1e-5: margins and kl can be near 0), the float32 per-sequence
outputs at rtol 1e-5, and the gradients normwise at 1e-4 (measured over test_matches_trl: loss 4e-8 relative,
gradients 2e-7 normwise). Masks are TRL's 0/1 completion masks, ragged: a masked prompt token in some rows, right
padding in others (targets -100 there: TRL's ignored tokens), one sequence fully masked.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusedhead  # noqa: E402
import fusedhead.numpy as fhnp  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from conftest import normwise  # noqa: E402
from test_preference import check, f32, f64  # noqa: E402  (the same outputs: loss, metrics, logps, rewards)
from trl_kto import kto_loss as trl_kto_loss  # noqa: E402
LABELS = np.array([True, False, True, True, False, False, True])


def _fp32(a):
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def make_batch(seed=0, T=7, H=16, V=97, *, bias=False, layout="vh", beta_scale=1.0):
    """fp32-representable float64 arrays: hidden [B, T, H], weight, targets with -100 at masked positions, a ragged
    0/1 mask (the last sequence fully masked), labels; reference log-probs of a model near the policy (per token
    the policy's plus noise, per sequence their sums plus noise), and the KL completions: other hidden states with
    their own targets and masks, whose summed log-probs under the policy and under a noisy reference give the
    KL log-ratios."""
    B = len(LABELS)
    rng = np.random.default_rng(seed)
    d = {"layout": layout, "labels": LABELS.copy()}
    d["h"] = _fp32(rng.standard_normal((B, T, H)))
    d["W"] = _fp32(rng.standard_normal((V, H)) * (3.0 / math.sqrt(H)))
    d["b"] = _fp32(rng.standard_normal(V) * 0.5) if bias else None
    mask = np.ones((B, T))
    for s in range(B):
        mask[s, :rng.integers(0, 2)] = 0.0
        mask[s, rng.integers(3, T + 1):] = 0.0
    mask[-1] = 0.0
    d["mask"] = mask
    targets = rng.integers(0, V, (B, T)).astype(np.int64)
    d["targets"] = np.where(mask > 0, targets, -100)
    with torch.no_grad():
        lp = F.log_softmax(F.linear(torch.tensor(d["h"]), torch.tensor(d["W"])), -1)
        lp = lp.gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1).numpy()
        kl_h = torch.tensor(_fp32(rng.standard_normal((B, T, H))))
        kl_targets = torch.tensor(rng.integers(0, V, (B, T)))
        kl_lp = F.log_softmax(F.linear(kl_h, torch.tensor(d["W"])), -1).gather(-1, kl_targets.unsqueeze(-1))
        kl_policy = (kl_lp.squeeze(-1) * torch.tensor(mask)).sum(-1).numpy()
    d["ref_per_token_logps"] = _fp32(lp + 0.3 * beta_scale * rng.standard_normal(lp.shape))
    d["ref_logps"] = _fp32((lp * mask).sum(-1) + 2.0 * beta_scale * rng.standard_normal(B))
    d["kl_policy_logps"] = _fp32(kl_policy)
    d["kl_ref_logps"] = _fp32(kl_policy - rng.uniform(-0.5, 2.5, B))  # log-ratios of mean ~1: kl > 0
    d["kl_logratios"] = _fp32(d["kl_policy_logps"] - d["kl_ref_logps"])
    return d


def _references(d, ref):
    return {"ref_logps": d["ref_logps"]} if ref == "sequence" else {"ref_per_token_logps": d["ref_per_token_logps"]}


def _kl_arguments(d, kl, loss_type):
    """The library's KL keyword arguments and the transcription's: TRL's value, or the log-ratios (the transcription
    gets TRL's two summed log-probs and forms the value as TRL does)."""
    if loss_type == "apo_zero_unpaired":
        return {}, {}
    if kl == "value":
        value = max(float(np.mean(d["kl_logratios"])), 0.0)
        return {"kl": value}, {"kl": value}
    return ({"kl_logratios": f32(d["kl_logratios"])},
            {"kl_policy_logps": f64(d["kl_policy_logps"]), "kl_ref_logps": f64(d["kl_ref_logps"])})


def run_both(d, ref="sequence", kl="logratios", upstream=1.0, hidden_2d=False, **opts):
    """(library output, grads), (transcription output, grads); grads of upstream * loss, weight's as [V, H]."""
    lib_kl, trl_kl = _kl_arguments(d, kl, opts.get("loss_type", "kto"))
    h = f32(d["h"])
    if hidden_2d:
        h = h.reshape(-1, h.shape[-1])
    W = f32(d["W"] if d["layout"] == "vh" else np.ascontiguousarray(d["W"].T))
    b = f32(d["b"])
    h, W, b = (None if t is None else t.requires_grad_() for t in (h, W, b))
    out = fht.fused_linear_kto_loss(h, W, torch.tensor(d["targets"]), f32(d["mask"]), torch.tensor(d["labels"]),
                                    bias=b, layout=d["layout"], **{k: f32(v) for k, v in _references(d, ref).items()},
                                    **lib_kl, **opts)
    (out.loss * upstream).backward()
    grads = [h.grad.reshape(d["h"].shape), W.grad if d["layout"] == "vh" else W.grad.t(),
             None if b is None else b.grad]
    h64, W64, b64 = f64(d["h"], True), f64(d["W"], True), f64(d["b"], d["b"] is not None)
    rout = trl_kto_loss(F.linear(h64, W64, b64), torch.tensor(d["targets"]), f64(d["mask"]),
                        torch.tensor(d["labels"]), **{k: f64(v) for k, v in _references(d, ref).items()}, **trl_kl,
                        **opts)
    (rout[0] * upstream).backward()
    return (out, grads), (rout, [h64.grad, W64.grad, None if b64 is None else b64.grad])


CASES = [("kto", ref, kl) for ref in ("sequence", "token") for kl in ("value", "logratios")] + \
        [("apo_zero_unpaired", ref, None) for ref in ("sequence", "token")]


@pytest.mark.parametrize("loss_type, ref, kl", CASES, ids=[f"{t}-{r}-{k}" for t, r, k in CASES])
def test_matches_trl(loss_type, ref, kl):
    d = make_batch(seed=len(loss_type) + len(ref))
    check(*run_both(d, ref, kl, loss_type=loss_type))


@pytest.mark.parametrize("layout, bias", [("vh", True), ("hv", False), ("hv", True)])
def test_options_layouts_bias_upstream(layout, bias):
    """TRL's options away from their defaults (beta 0.5, weights 1.33 / 0.7), both layouts, a bias, an upstream
    gradient other than 1, a 2-D hidden."""
    d = make_batch(seed=7, layout=layout, bias=bias, beta_scale=0.3)
    check(*run_both(d, "token", "logratios", upstream=-0.6, hidden_2d=layout == "hv", beta=0.5,
                    desirable_weight=1.33, undesirable_weight=0.7))
    check(*run_both(d, "sequence", None, loss_type="apo_zero_unpaired", beta=0.5, undesirable_weight=2.0))


def test_one_sided_batches_and_clamped_kl():
    """Only desirable sequences: TRL logs no rejected metric and no margin (and the transcription's losses are
    those of the chosen ones only); only undesirable ones likewise; KL log-ratios with a negative mean: kl 0."""
    d = make_batch(seed=3)
    d["labels"] = np.ones(len(LABELS), bool)
    lib, ref = run_both(d, "sequence", "logratios")
    check(lib, ref)
    assert "rewards/rejected" not in lib[0].metrics and "rewards/margins" not in lib[0].metrics
    d["labels"] = np.zeros(len(LABELS), bool)
    d["kl_ref_logps"] = d["kl_policy_logps"] + 1.0
    d["kl_logratios"] = _fp32(d["kl_policy_logps"] - d["kl_ref_logps"])
    lib, ref = run_both(d, "token", "logratios")
    check(lib, ref)
    assert lib[0].metrics["kl"] == 0.0 and "logps/chosen" not in lib[0].metrics


def test_kl_logratios_from_fused_logprobs():
    """The documented route to the KL input: the KL completions' per-token log-probs from fused_linear_logprobs
    (no gradient), summed under their mask, minus the reference's, as kl_logratios; the transcription computes
    TRL's kl from the same completions in float64."""
    d = make_batch(seed=11)
    rng = np.random.default_rng(5)
    B, T, H = d["h"].shape
    kl_h = _fp32(rng.standard_normal((B, T, H)))
    kl_targets = rng.integers(0, d["W"].shape[0], (B, T)).astype(np.int64)
    kl_mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
    with torch.no_grad():
        logp = fht.fused_linear_logprobs(f32(kl_h), f32(d["W"]), torch.tensor(np.where(kl_mask > 0, kl_targets, -100)))
        policy = (logp.double() * torch.tensor(kl_mask)).sum(-1).numpy()
        lp64 = F.log_softmax(F.linear(torch.tensor(kl_h), torch.tensor(d["W"])), -1)
        policy64 = (lp64.gather(-1, torch.tensor(kl_targets).unsqueeze(-1)).squeeze(-1) * torch.tensor(kl_mask)).sum(-1)
    ref_kl = _fp32(policy64.numpy() - rng.uniform(-1.0, 2.0, B))
    d["kl_logratios"] = _fp32(policy - ref_kl)
    d["kl_policy_logps"], d["kl_ref_logps"] = _fp32(policy64.numpy()), ref_kl
    check(*run_both(d, "sequence", "logratios", beta=0.3))


def test_numpy_front_end_matches_torch():
    """fusedhead.numpy.kto_loss on the same arrays: the same values and gradients as fusedhead.torch (both call
    fh_kto_forward_backward; bit-identical), bool and uint8 labels alike."""
    d = make_batch(seed=2, bias=True)
    (out, grads), _ = run_both(d, "token", "value", desirable_weight=1.2)
    kl = max(float(np.mean(d["kl_logratios"])), 0.0)
    for labels in (d["labels"], d["labels"].astype(np.uint8)):
        r = fhnp.kto_loss(d["h"].astype(np.float32), d["W"].astype(np.float32), d["targets"],
                          d["mask"].astype(np.float32), labels, d["b"].astype(np.float32),
                          ref_per_token_logps=d["ref_per_token_logps"].astype(np.float32), kl=kl, return_grads=True,
                          desirable_weight=1.2)
        assert r.loss == pytest.approx(out.loss.item(), rel=1e-7) and r.metrics == pytest.approx(out.metrics)
        np.testing.assert_array_equal(r.sequence_logps, out.logps.numpy())
        np.testing.assert_array_equal(r.rewards, out.rewards.numpy())
        for g, want in zip((r.dhidden, r.dweight, r.dbias), grads):
            np.testing.assert_array_equal(g, want.numpy())
        fwd = fhnp.kto_loss(d["h"].astype(np.float32), d["W"].astype(np.float32), d["targets"],
                            d["mask"].astype(np.float32), labels, d["b"].astype(np.float32),
                            ref_per_token_logps=d["ref_per_token_logps"].astype(np.float32), kl=kl,
                            desirable_weight=1.2)
        assert fwd.loss == r.loss and fwd.dhidden is None
        np.testing.assert_array_equal(fwd.per_token_logp, r.per_token_logp)


def test_module_and_no_grad():
    d = make_batch(seed=4)
    loss_fn = fht.FusedLinearKTOLoss(beta=0.2, desirable_weight=1.5)
    assert "beta=0.2" in repr(loss_fn)
    h, W = f32(d["h"]).requires_grad_(), f32(d["W"]).requires_grad_()
    out = loss_fn(h, W, torch.tensor(d["targets"]), f32(d["mask"]), torch.tensor(d["labels"]),
                  ref_logps=f32(d["ref_logps"]), kl=torch.tensor(0.25))
    out.loss.backward()
    assert h.grad is not None and W.grad is not None and out.metrics["kl"] == 0.25
    with torch.no_grad():
        again = loss_fn(h, W, torch.tensor(d["targets"]), f32(d["mask"]), torch.tensor(d["labels"]),
                        ref_logps=f32(d["ref_logps"]), kl=0.25)
    assert again.loss.item() == out.loss.item() and not again.loss.requires_grad


def test_errors_name_their_argument():
    d = make_batch(seed=1)
    args = (f32(d["h"]), f32(d["W"]), torch.tensor(d["targets"]), f32(d["mask"]))
    labels = torch.tensor(d["labels"])
    with pytest.raises(fusedhead.FusedheadError, match="kl"):  # kto without its KL input
        fht.fused_linear_kto_loss(*args, labels, ref_logps=f32(d["ref_logps"]))
    with pytest.raises(fusedhead.FusedheadError, match="reference"):
        fht.fused_linear_kto_loss(*args, labels, kl=0.1)
    with pytest.raises(fusedhead.FusedheadError, match="apo_zero_unpaired"):
        fht.fused_linear_kto_loss(*args, labels, ref_logps=f32(d["ref_logps"]), kl=0.1, loss_type="apo_zero_unpaired")
    with pytest.raises(ValueError, match="labels"):
        fht.fused_linear_kto_loss(*args, labels.long() * 2, ref_logps=f32(d["ref_logps"]), kl=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        fht.fused_linear_kto_loss(*args, labels, ref_logps=f32(d["ref_logps"]), kl=0.1, loss_type="sigmoid")
    with pytest.raises(ValueError, match="ref_logps"):
        fht.fused_linear_kto_loss(*args, labels, ref_logps=f32(d["ref_logps"][:-1]), kl=0.1)


@pytest.mark.skipif(not fusedhead.bf16_available(), reason="bf16 calls are refused here")
def test_bf16_matches_trl():
    """bf16 hidden and weight ([H, V] layout), bf16 reference log-probs (converted, as a bf16 model gives them),
    against the transcription in float64 on the same bf16 values. The loss comes back in bf16 (one rounding: within
    2^-8, bf16's unit roundoff, of the library's value, itself within 1e-5 of the reference); metrics, log-probs and
    rewards are the library's double / fp32 values (1e-5, as in fp32: the logits are exact bf16 products accumulated
    in f32); the bf16 gradients carry dZ's rounding to bf16 and their own (test_bf16.py's GRAD_RTOL_BF16 = 8e-3
    normwise)."""
    d = make_batch(seed=9)
    h = torch.tensor(d["h"], dtype=torch.bfloat16, requires_grad=True)
    W = torch.tensor(d["W"].T, dtype=torch.bfloat16, requires_grad=True)
    ref_tok = torch.tensor(d["ref_per_token_logps"], dtype=torch.bfloat16)
    out = fht.fused_linear_kto_loss(h, W, torch.tensor(d["targets"]), f32(d["mask"]), torch.tensor(d["labels"]),
                                    ref_per_token_logps=ref_tok, kl_logratios=f32(d["kl_logratios"]), layout="hv")
    assert out.loss.dtype == torch.bfloat16 and out.logps.dtype == torch.float32
    out.loss.backward()
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().t().contiguous().requires_grad_()
    rloss, rmetrics, rlogps, rrewards = trl_kto_loss(
        F.linear(h64, W64), torch.tensor(d["targets"]), f64(d["mask"]), torch.tensor(d["labels"]),
        ref_per_token_logps=ref_tok.double(), kl_policy_logps=f64(d["kl_policy_logps"]),
        kl_ref_logps=f64(d["kl_ref_logps"]))
    rloss.backward()
    assert abs(out.loss.double().item() - rloss.item()) <= (2.0 ** -8 + 1e-5) * abs(rloss.item())
    assert set(out.metrics) == set(rmetrics)
    for k in rmetrics:
        assert out.metrics[k] == pytest.approx(rmetrics[k], rel=1e-5, abs=1e-5), k
    for got, want in ((out.logps, rlogps), (out.rewards, rrewards)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert normwise(h.grad.double().numpy(), h64.grad.numpy()) <= 8e-3
    assert normwise(W.grad.double().t().numpy(), W64.grad.numpy()) <= 8e-3
