"""fusedhead's preference heads (DPO, ORPO, SimPO, CPO) through fusedhead.torch and fusedhead.numpy, against
the formulas of include/fusedhead.h (TRL's DPOTrainer, CPOTrainer and ORPOTrainer) written in torch float64 on
materialised logits, autograd for the gradients.

Tolerances (LOSS_TOL, GRAD_TOL, as test_grpo.py's and conftest.py's fp32 bounds): the library runs fp32 GEMMs on
the same fp32 inputs and keeps per-token and per-sequence values in double, so its token log-probs err by about
1e-7 relative (the logits' fp32 rounding) and a sequence log-prob, a sum of T of them, by about T times that in
absolute terms. The pair losses are smooth functions of differences of those sums with slopes of order beta and
1 / (1 - exp l) (ORPO), so the loss and the metrics are compared at relative 1e-5 (metrics also absolute 1e-5:
margins and log-odds can be near 0), the float32 per-sequence outputs at rtol 1e-5, and the gradients (the
pairs' coefficients times the fp32 GEMMs' dZ) normwise at 1e-4. Measured over the cases below: loss 5e-7
relative at most, metrics 3e-7, gradients 3e-7 normwise.

The reference clamps a sequence's token count at 1, as the header does, where TRL would divide by zero (its NLL
is TRL's cross-entropy, so the chosen half always keeps tokens); the data keep at least two tokens per sequence
except where a test says otherwise, and masks of 0/1 (TRL's), the header's fractional weights untested here.
bf16 inputs are compared in test_bf16.py (skipped there without a bf16 provider).
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

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
# This file checks dpo at TRL v0.28.0's semantics (the reference below); test_preference_trl.py the current ones.
LEGACY = "trl_0_28"


def preference(*args, **kw):
    """fusedhead.torch.fused_linear_preference_loss with dpo at TRL v0.28.0's semantics."""
    kw.setdefault("dpo_semantics", LEGACY)
    return fht.fused_linear_preference_loss(*args, **kw)


def numpy_preference(*args, **kw):
    """fusedhead.numpy.preference_loss with dpo at TRL v0.28.0's semantics."""
    kw.setdefault("dpo_semantics", LEGACY)
    return fhnp.preference_loss(*args, **kw)
# (loss, loss_type) pairs TRL has: DPOTrainer all four, CPOTrainer all but robust, SimPO and ORPO their own
COMBOS = [("dpo", t) for t in ("sigmoid", "hinge", "ipo", "robust")] + \
         [("cpo", t) for t in ("sigmoid", "hinge", "ipo")] + [("simpo", "sigmoid"), ("orpo", "sigmoid")]
REFS = ("none", "sequence", "token")
CASES = [(loss, loss_type, ref) for loss, loss_type in COMBOS for ref in REFS if loss == "dpo" or ref == "none"]
HINGE_BETA = 1.0  # the kink at u = 1 / beta = 1 lies inside the data's margins (test_hinge_data_covers_both_sides)


# ---------------------------------------------------------------------------------------------------------
# The reference: TRL's losses and metrics in float64
# ---------------------------------------------------------------------------------------------------------
def reference(h, W, b, targets, mask, *, loss="dpo", loss_type="sigmoid", beta=0.1, label_smoothing=0.0,
              simpo_gamma=0.5, rpo_alpha=None, cpo_alpha=1.0, ref_logps=None, ref_per_token_logps=None,
              dpo_semantics=LEGACY):
    """(loss, metrics dict, sequence log-probs [2B], rewards [2B]); h [2B, T, H], W [V, H], b [V] float64 leaves,
    targets [2B, T] (any value where mask is 0), mask [2B, T] of 0/1. dpo at TRL v0.28.0's semantics only."""
    assert dpo_semantics == LEGACY, "this reference is TRL v0.28.0's DPO (trl_dpo.py has the current one)"
    rows = targets.shape[0]
    B, ls = rows // 2, label_smoothing
    logits = F.linear(h, W, b)
    valid = mask > 0
    logp = F.log_softmax(logits, -1).gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    averaged = loss in ("simpo", "orpo") or loss_type == "ipo"  # TRL's average_log_prob / ipo's mean
    count = mask.sum(-1).clamp(min=1.0) if averaged else torch.ones(rows, dtype=mask.dtype)
    seq = (logp * mask).sum(-1) / count
    if ref_per_token_logps is not None:
        ref = (ref_per_token_logps * mask).sum(-1) / count
    else:
        ref = ref_logps if ref_logps is not None else torch.zeros(rows, dtype=seq.dtype)
    c, r = seq[:B], seq[B:]
    # TRL's NLL: cross-entropy of the chosen half, ignore_index where the mask is 0
    labels = torch.where(valid[:B], targets[:B], -100)
    nll = F.cross_entropy(logits[:B].flatten(0, 1), labels.flatten(), ignore_index=-100)

    def margin_loss(u):
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * u) * (1 - ls) - F.logsigmoid(-beta * u) * ls
        if loss_type == "robust":
            return (-F.logsigmoid(beta * u) * (1 - ls) + F.logsigmoid(-beta * u) * ls) / (1 - 2 * ls)
        if loss_type == "hinge":
            return torch.relu(1 - beta * u)
        return (u - 1 / (2 * beta)) ** 2  # ipo

    metrics = {}
    if loss == "dpo":
        rewards = beta * (seq - ref).detach()
        value = margin_loss((c - ref[:B]) - (r - ref[B:])).mean()
        if rpo_alpha:
            value = value + rpo_alpha * nll
            metrics["nll_loss"] = nll.item()
    elif loss in ("cpo", "simpo"):
        rewards = beta * seq.detach()
        u = c - r - (simpo_gamma / beta if loss == "simpo" else 0.0)
        value = margin_loss(u).mean() + cpo_alpha * nll
        metrics["nll_loss"] = nll.item() if cpo_alpha != 0 else 0.0
    else:  # orpo
        rewards = beta * seq.detach()
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        value = nll - (beta * ratio).mean()
        metrics.update({"nll_loss": nll.item(), "log_odds_ratio": ratio.mean().item(),
                        "log_odds_chosen": log_odds.mean().item()})
    rc, rr = rewards[:B], rewards[B:]
    z = logits.detach()
    metrics.update({"rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(),
                    "rewards/accuracies": (rc > rr).double().mean().item(),
                    "rewards/margins": (rc - rr).mean().item(), "logps/chosen": c.mean().item(),
                    "logps/rejected": r.mean().item()})
    # DPOTrainer's logits means are masked; CPOTrainer's and ORPOTrainer's take every token of the half.
    tokens = valid if loss == "dpo" else torch.ones_like(valid)
    metrics.update({"logits/chosen": z[:B][tokens[:B]].mean().item(), "logits/rejected": z[B:][tokens[B:]].mean().item()})
    return value, metrics, seq.detach(), rewards


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def _fp32(a):
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def make_pairs(seed=0, B=3, T=7, H=16, V=97, *, bias=False, layout="vh", ref_noise=0.6):
    """fp32-representable float64 arrays: hidden [2B, T, H], weight, targets and a 0/1 mask with a masked prompt
    token in some rows and right padding in others (at least two tokens per sequence); reference log-probs of a
    model near the policy: per token the policy's (bias left out) plus noise of std ref_noise, per sequence
    their sums plus noise of T * ref_noise."""
    rng = np.random.default_rng(seed)
    d = {"layout": layout}
    d["h"] = _fp32(rng.standard_normal((2 * B, T, H)))
    d["W"] = _fp32(rng.standard_normal((V, H)) * (3.0 / math.sqrt(H)))
    d["b"] = _fp32(rng.standard_normal(V) * 0.5) if bias else None
    d["targets"] = rng.integers(0, V, (2 * B, T)).astype(np.int64)
    mask = np.ones((2 * B, T))
    for s in range(2 * B):
        mask[s, :rng.integers(0, 2)] = 0.0
        mask[s, rng.integers(3, T + 1):] = 0.0
    d["mask"] = mask
    with torch.no_grad():
        lp = F.log_softmax(F.linear(torch.tensor(d["h"]), torch.tensor(d["W"])), -1)
        lp = lp.gather(-1, torch.tensor(d["targets"]).unsqueeze(-1)).squeeze(-1).numpy()
    d["ref_per_token_logps"] = _fp32(lp + ref_noise * rng.standard_normal(lp.shape))
    d["ref_logps"] = _fp32((lp * mask).sum(-1) + T * ref_noise * rng.standard_normal(2 * B))
    return d


def references(d, ref: str) -> dict:
    """The dpo reference keyword arguments for ref = "none", "sequence" or "token"."""
    return {"none": {}, "sequence": {"ref_logps": d["ref_logps"]},
            "token": {"ref_per_token_logps": d["ref_per_token_logps"]}}[ref]


def f32(a):
    return None if a is None else torch.tensor(a, dtype=torch.float32)


def f64(a, grad=False):
    return None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def library_inputs(d, hidden_2d=False):
    """float32 leaves requiring grad: hidden (2-D [2B*T, H] if asked), weight in d's layout, bias."""
    h = f32(d["h"])
    if hidden_2d:
        h = h.reshape(-1, h.shape[-1])
    W = f32(d["W"] if d["layout"] == "vh" else np.ascontiguousarray(d["W"].T))
    b = f32(d["b"])
    return [None if t is None else t.requires_grad_() for t in (h, W, b)]


def run_both(d, ref="none", upstream=1.0, hidden_2d=False, context=None, **opts):
    """(library output, grads), (reference output, grads); grads of upstream * loss, weight's as [V, H]."""
    refs = references(d, ref)
    h, W, b = library_inputs(d, hidden_2d)
    out = preference(h, W, torch.tensor(d["targets"]), f32(d["mask"]), bias=b,
                                           layout=d["layout"], context=context,
                                           **{k: f32(v) for k, v in refs.items()}, **opts)
    (out.loss * upstream).backward()
    grads = [h.grad.reshape(d["h"].shape), W.grad if d["layout"] == "vh" else W.grad.t(),
             None if b is None else b.grad]
    h64, W64, b64 = f64(d["h"], True), f64(d["W"], True), f64(d["b"], d["b"] is not None)
    rout = reference(h64, W64, b64, torch.tensor(d["targets"]), f64(d["mask"]),
                     **{k: f64(v) for k, v in refs.items()}, **opts)
    (rout[0] * upstream).backward()
    return (out, grads), (rout, [h64.grad, W64.grad, None if b64 is None else b64.grad])


def check(lib, ref):
    (out, grads), ((rloss, rmetrics, rlogps, rrewards), rgrads) = lib, ref
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert abs(out.loss.item() - rloss.item()) <= LOSS_TOL * abs(rloss.item()), (out.loss.item(), rloss.item())
    assert set(out.metrics) == set(rmetrics), (out.metrics, rmetrics)
    for k in rmetrics:
        assert out.metrics[k] == pytest.approx(rmetrics[k], rel=LOSS_TOL, abs=LOSS_TOL), k
    for got, want in ((out.logps, rlogps), (out.rewards, rrewards)):
        assert got.dtype == torch.float32 and not got.requires_grad
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    for g, rg in zip(grads, rgrads):
        assert (g is None) == (rg is None)
        if g is not None:
            assert normwise(g.numpy(), rg.numpy()) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# Every loss and loss_type; dpo with each kind of reference
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss, loss_type, ref", CASES, ids=["-".join(c) for c in CASES])
def test_matches_reference(loss, loss_type, ref):
    """Only dpo takes reference log-probs."""
    d = make_pairs(seed=COMBOS.index((loss, loss_type)))
    lib, rf = run_both(d, ref, loss=loss, loss_type=loss_type, beta=HINGE_BETA if loss_type == "hinge" else 0.1)
    check(lib, rf)


def test_hinge_data_covers_both_sides():
    """The hinge cases above see pairs on both sides of the kink (else relu's zero side goes untested)."""
    for loss in ("dpo", "cpo"):
        d = make_pairs(seed=COMBOS.index((loss, "hinge")))
        for ref in REFS if loss == "dpo" else ("none",):
            refs = {k: f64(v) for k, v in references(d, ref).items()}
            _, _, seq, _ = reference(f64(d["h"]), f64(d["W"]), None, torch.tensor(d["targets"]), f64(d["mask"]),
                                     loss=loss, **refs)
            base = refs.get("ref_logps")
            if "ref_per_token_logps" in refs:
                base = (refs["ref_per_token_logps"] * f64(d["mask"])).sum(-1)
            u = seq - (base if base is not None else 0.0)
            active = 1 - HINGE_BETA * (u[:3] - u[3:]) > 0
            assert bool(active.any()) and not bool(active.all()), (loss, ref, u)


OPTION_CASES = {
    "dpo_label_smoothing": dict(loss="dpo", label_smoothing=0.2, ref="token"),
    "dpo_robust_label_smoothing": dict(loss="dpo", loss_type="robust", label_smoothing=0.3, ref="sequence"),
    "dpo_rpo_alpha": dict(loss="dpo", rpo_alpha=0.7, ref="token"),
    "dpo_ipo_rpo_alpha": dict(loss="dpo", loss_type="ipo", rpo_alpha=1.0, ref="sequence"),
    "dpo_beta": dict(loss="dpo", beta=0.8),
    "cpo_label_smoothing": dict(loss="cpo", label_smoothing=0.1, beta=0.3),
    "cpo_alpha_zero": dict(loss="cpo", cpo_alpha=0.0),
    "cpo_alpha": dict(loss="cpo", loss_type="ipo", cpo_alpha=0.3),
    "cpo_hinge_ignores_smoothing": dict(loss="cpo", loss_type="hinge", beta=HINGE_BETA, label_smoothing=0.2),
    "simpo_gamma_smoothing": dict(loss="simpo", simpo_gamma=1.5, beta=2.0, label_smoothing=0.1),
    "simpo_paper": dict(loss="simpo", cpo_alpha=0.0, beta=2.5, simpo_gamma=0.3),
    "orpo_beta": dict(loss="orpo", beta=0.25),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_bias_layouts(case):
    """Each option, with a bias and the [H, V] layout in turn."""
    opts = dict(OPTION_CASES[case])
    index = list(OPTION_CASES).index(case)
    d = make_pairs(seed=100 + index, bias=index % 2 == 0, layout="hv" if index % 3 == 0 else "vh")
    lib, rf = run_both(d, opts.pop("ref", "none"), **opts)
    check(lib, rf)


@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_hidden_2d_bias_hv_and_upstream_scale(loss):
    """hidden as [2B*T, H], a bias, the [H, V] layout and (loss * 3).backward(): gradients scaled by 3."""
    d = make_pairs(seed=7, bias=True, layout="hv")
    lib, rf = run_both(d, "token" if loss == "dpo" else "none", upstream=3.0, hidden_2d=True, loss=loss,
                       rpo_alpha=0.5)
    check(lib, rf)


SCHEDULES = {  # T = 7, so a pair is 14 rows; n = 2B T = 42 rows of V = 517
    "one_block": {},  # n < 256 rows: the whole batch in one row block
    "pair_blocks": dict(tile_rows=28),  # blocks of two pairs (an explicit tile_rows is honoured)
    "streaming": dict(memory_budget=64 * 1024, tile_vocab=64),  # fewer than n full rows fit: streams, 9 tiles
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedules_and_negative_upstream(schedule):
    """fh_preference_forward_backward's schedules (src/plan/plan.c: row blocks need min(n, 256) full-vocabulary rows
    in the budget, or an explicit tile_rows of whole pairs; otherwise it streams) give the reference's answers,
    here with an upstream gradient of -2.5 and two threads."""
    d = make_pairs(seed=8, bias=True, V=517)
    with fusedhead.Context(threads=2, **SCHEDULES[schedule]) as ctx:
        lib, rf = run_both(d, upstream=-2.5, context=ctx, loss="simpo", simpo_gamma=0.7, cpo_alpha=0.5)
    check(lib, rf)


def test_empty_sequence_and_masked_targets():
    """A sequence with no unmasked token has l = 0 (the header's max(count, 1)); targets under the mask are not
    read (TRL pads with -100 or the pad id): the same loss with -100 there."""
    d = make_pairs(seed=9)
    d["mask"][4] = 0.0  # a rejected sequence
    lib, rf = run_both(d, "sequence", loss="dpo", loss_type="ipo")
    check(lib, rf)
    assert lib[0].logps[4].item() == 0.0
    padded = np.where(d["mask"] > 0, d["targets"], -100)
    h, W, _ = library_inputs(d)
    out = preference(h, W, torch.tensor(padded), f32(d["mask"]), loss="dpo",
                                           loss_type="ipo", ref_logps=f32(d["ref_logps"]))
    assert out.loss.item() == lib[0].loss.item()


# ---------------------------------------------------------------------------------------------------------
# Metrics: what TRL logs for each loss
# ---------------------------------------------------------------------------------------------------------
COMMON = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
          "logps/rejected", "logits/chosen", "logits/rejected"}


@pytest.mark.parametrize("loss, opts, extra", [
    ("dpo", {}, set()),
    ("dpo", dict(rpo_alpha=0.5), {"nll_loss"}),
    ("cpo", {}, {"nll_loss"}),
    ("cpo", dict(cpo_alpha=0.0), {"nll_loss"}),
    ("simpo", dict(cpo_alpha=0.0), {"nll_loss"}),
    ("orpo", {}, {"nll_loss", "log_odds_ratio", "log_odds_chosen"}),
])
def test_metric_keys(loss, opts, extra):
    """DPOTrainer logs nll_loss only with rpo_alpha; CPOTrainer always, 0 when cpo_alpha is 0; ORPOTrainer adds
    the log odds. The values follow TRL's definitions (checked against the reference above)."""
    d = make_pairs(seed=12)
    h, W, _ = library_inputs(d)
    with torch.no_grad():
        out = preference(h, W, torch.tensor(d["targets"]), f32(d["mask"]), loss=loss, **opts)
    assert set(out.metrics) == COMMON | extra
    if opts.get("cpo_alpha") == 0.0:
        assert out.metrics["nll_loss"] == 0.0
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())
    B = d["targets"].shape[0] // 2
    rewards = out.rewards.double()
    assert out.metrics["rewards/accuracies"] == pytest.approx((rewards[:B] > rewards[B:]).double().mean().item())


# ---------------------------------------------------------------------------------------------------------
# Autograd: no grad, partial gradients, modules, the weight-gradient buffer
# ---------------------------------------------------------------------------------------------------------
def test_no_grad_and_partial_grads():
    d = make_pairs(seed=13, bias=True)
    h, W, b = (t.detach() for t in library_inputs(d))
    args = (torch.tensor(d["targets"]), f32(d["mask"]))
    opts = dict(loss="dpo", ref_per_token_logps=f32(d["ref_per_token_logps"]), rpo_alpha=0.3, bias=b)
    with torch.no_grad():
        out0 = preference(h, W.requires_grad_(), *args, **opts)
    assert out0.loss.grad_fn is None
    out1 = preference(h, W, *args, **opts)
    assert out1.loss.item() == out0.loss.item() and out1.metrics == out0.metrics
    assert torch.equal(out1.logps, out0.logps) and torch.equal(out1.rewards, out0.rewards)
    out1.loss.backward()
    assert h.grad is None and b.grad is None and W.grad is not None
    # bool and integer masks are converted to float32
    for m in (args[1].bool(), args[1].long()):
        assert preference(h, W, args[0], m, **opts).loss.item() == out0.loss.item()


@pytest.mark.parametrize("module, loss, opts", [
    (fht.FusedLinearDPOLoss, "dpo", dict(beta=0.2, loss_type="robust", label_smoothing=0.1, rpo_alpha=0.5,
                                         dpo_semantics=LEGACY)),
    (fht.FusedLinearORPOLoss, "orpo", dict(beta=0.3)),
    (fht.FusedLinearSimPOLoss, "simpo", dict(beta=2.0, simpo_gamma=1.0, label_smoothing=0.05, cpo_alpha=0.0)),
    (fht.FusedLinearCPOLoss, "cpo", dict(beta=0.2, loss_type="hinge", label_smoothing=0.0, cpo_alpha=0.5)),
], ids=["dpo", "orpo", "simpo", "cpo"])
def test_modules(module, loss, opts):
    """Each module (TRL's option names) against the reference, with a bias; dpo's with a reference."""
    d = make_pairs(seed=14, bias=True)
    h, W, b = library_inputs(d)
    fn = module(**opts)
    assert all(f"{k}={v!r}" in repr(fn) for k, v in opts.items())
    refs = references(d, "sequence" if loss == "dpo" else "none")
    out = fn(h, W, torch.tensor(d["targets"]), f32(d["mask"]), b, **{k: f32(v) for k, v in refs.items()})
    out.loss.backward()
    h64, W64, b64 = f64(d["h"], True), f64(d["W"], True), f64(d["b"], True)
    rout = reference(h64, W64, b64, torch.tensor(d["targets"]), f64(d["mask"]), loss=loss,
                     **{k: f64(v) for k, v in refs.items()}, **opts)
    rout[0].backward()
    check((out, [h.grad, W.grad, b.grad]), (rout, [h64.grad, W64.grad, b64.grad]))
    with pytest.raises(ValueError, match="loss_type must be one of"):
        fht.FusedLinearCPOLoss(loss_type="simpo")
    with pytest.raises(ValueError, match="layout"):
        module(layout="kv")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_loop_weight_buffer(set_to_none):
    """The weight gradient goes through the pooled buffer like CE's and GRPO's: two micro-batches of loss / 2 per
    step, zero_grad either way, against the reference; a gradient the caller kept survives the next step."""
    W = torch.nn.Parameter(f32(make_pairs(seed=15)["W"]))
    W64 = torch.nn.Parameter(f64(make_pairs(seed=15)["W"]))
    opt, opt64 = torch.optim.SGD([W], lr=0.1), torch.optim.SGD([W64], lr=0.1)
    kept = None
    for step in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        opt64.zero_grad(set_to_none=set_to_none)
        for micro in range(2):
            d = make_pairs(seed=16 + 2 * step + micro)
            out = preference(f32(d["h"]), W, torch.tensor(d["targets"]), f32(d["mask"]),
                                                   loss="cpo")
            (0.5 * out.loss).backward()
            (0.5 * reference(f64(d["h"]), W64, None, torch.tensor(d["targets"]), f64(d["mask"]), loss="cpo")[0]
             ).backward()
        assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRAD_TOL
        if kept is not None:
            assert torch.equal(kept[0], kept[1])
        if set_to_none:
            kept = (W.grad, W.grad.clone())
        opt.step()
        opt64.step()


# ---------------------------------------------------------------------------------------------------------
# NumPy
# ---------------------------------------------------------------------------------------------------------
def test_numpy_preference_loss():
    """fusedhead.numpy.preference_loss: the same values as the torch front end, per-token log-probs and
    gradients of grad_output * loss against the reference, [2B, T, H] and [2B*T, H] hidden."""
    d = make_pairs(seed=17, bias=True, layout="hv")
    a = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v)
         for k, v in d.items()}
    w = np.ascontiguousarray(a["W"].T)
    opts = dict(loss="dpo", loss_type="sigmoid", beta=0.2, rpo_alpha=0.4)
    r = numpy_preference(a["h"], w, a["targets"], a["mask"], a["b"], None, a["ref_per_token_logps"],
                             layout="hv", return_grads=True, grad_output=-2.0, **opts)
    h64, W64, b64 = f64(d["h"], True), f64(d["W"], True), f64(d["b"], True)
    rloss, rmetrics, rseq, rrewards = reference(h64, W64, b64, torch.tensor(d["targets"]), f64(d["mask"]),
                                                ref_per_token_logps=f64(d["ref_per_token_logps"]), **opts)
    (-2.0 * rloss).backward()
    assert abs(r.loss - rloss.item()) <= LOSS_TOL * abs(rloss.item())
    assert r.metrics == pytest.approx(rmetrics, rel=LOSS_TOL, abs=LOSS_TOL)
    np.testing.assert_allclose(r.sequence_logps, rseq.numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    np.testing.assert_allclose(r.rewards, rrewards.numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    with torch.no_grad():
        lp = F.log_softmax(F.linear(h64, W64, b64), -1).gather(-1, torch.tensor(d["targets"]).unsqueeze(-1))
    assert r.per_token_logp.shape == d["targets"].shape
    np.testing.assert_allclose(r.per_token_logp, lp.squeeze(-1).numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    assert r.dhidden.shape == d["h"].shape and r.dweight.shape == w.shape
    for got, want in ((r.dhidden, h64.grad), (r.dweight.T, W64.grad), (r.dbias, b64.grad)):
        assert normwise(got, want.numpy()) <= GRAD_TOL
    flat = numpy_preference(a["h"].reshape(-1, a["h"].shape[-1]), w, a["targets"], a["mask"], a["b"], None,
                                a["ref_per_token_logps"], layout="hv", return_grads=["weight"], **opts)
    assert flat.loss == pytest.approx(r.loss, rel=1e-12) and flat.dhidden is None
    assert normwise(flat.dweight, -0.5 * r.dweight) <= 1e-6
    h, W, b = library_inputs(d)
    out = preference(h, W, torch.tensor(d["targets"]), f32(d["mask"]), bias=b, layout="hv",
                                           ref_per_token_logps=f32(d["ref_per_token_logps"]), **opts)
    assert out.loss.item() == pytest.approx(r.loss, rel=1e-7) and out.metrics == pytest.approx(r.metrics)


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
def test_library_errors():
    """The library's checks arrive as their FusedheadError classes with the library's message."""
    d = make_pairs(seed=18)
    h, W = (t.detach() for t in library_inputs(d)[:2])
    tg, m = torch.tensor(d["targets"]), f32(d["mask"])
    errors = fusedhead.errors
    cases = [
        (dict(beta=-0.1), errors.InvalidPreferenceOptionError, "beta"),
        (dict(beta=float("nan")), errors.InvalidPreferenceOptionError, "beta"),
        (dict(label_smoothing=0.7), errors.InvalidPreferenceOptionError, "label_smoothing"),
        (dict(loss_type="robust", label_smoothing=0.5), errors.InvalidPreferenceOptionError, "robust"),
        (dict(rpo_alpha=-1.0), errors.InvalidPreferenceOptionError, "rpo_alpha"),
        (dict(loss="orpo", loss_type="hinge"), errors.InvalidPreferenceOptionError, "orpo has no loss_type hinge"),
        (dict(loss="cpo", loss_type="robust"), errors.InvalidPreferenceOptionError, "cpo has no loss_type robust"),
        (dict(loss="simpo", ref_logps=f32(d["ref_logps"])), errors.InvalidPreferenceOptionError, "only dpo"),
        (dict(ref_logps=f32(d["ref_logps"]), ref_per_token_logps=f32(d["ref_per_token_logps"])),
         errors.InvalidPreferenceOptionError, "at most one"),
    ]
    for opts, cls, text in cases:
        with pytest.raises(cls) as e:
            preference(h, W, tg, m, **opts)
        assert e.value.status == fusedhead.Status.ERR_INVALID_PREFERENCE_OPTION
        assert text in e.value.message and e.value.message in str(e.value), (opts, e.value.message)
    bad = tg.clone()
    bad[0, 3] = 10_000  # an unmasked target out of range (make_pairs leaves position 3 in every sequence)
    with pytest.raises(fusedhead.TargetOutOfRangeError, match="targets"):
        preference(h, W.requires_grad_(), bad, m)
    neg = m.clone()
    neg[1, 1] = -1.0
    with pytest.raises(fusedhead.errors.InvalidMaskError, match="mask"):
        preference(h, W, tg, neg)


def test_argument_errors():
    """Python-side checks: TypeError / ValueError naming the argument."""
    d = make_pairs(seed=19)
    h, W = (t.detach() for t in library_inputs(d)[:2])
    tg, m = torch.tensor(d["targets"]), f32(d["mask"])
    fn = fht.fused_linear_preference_loss
    with pytest.raises(ValueError, match="loss must be one of 'dpo', 'orpo', 'simpo', 'cpo', got 'kto'"):
        fn(h, W, tg, m, loss="kto")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        fn(h, W, tg, m, loss_type="kto_pair")
    with pytest.raises(TypeError, match="beta: expected a real number"):
        fn(h, W, tg, m, beta="0.1x")
    with pytest.raises(TypeError, match="hidden: expected dtype torch.float32"):
        fn(h.double(), W, tg, m)
    with pytest.raises(TypeError, match="targets: expected dtype torch.int64"):
        fn(h, W, tg.int(), m)
    with pytest.raises(ValueError, match=r"targets: expected \[2B, T\]"):
        fn(h[:-1], W, tg[:-1], m[:-1])  # an odd number of sequences
    with pytest.raises(ValueError, match=r"hidden: expected \[2B, T, H\]"):
        fn(h[:, :-1], W, tg, m)
    with pytest.raises(ValueError, match=r"mask: expected shape \[2B, T\]"):
        fn(h, W, tg, m[:, :-1])
    with pytest.raises(TypeError, match="mask: expected a torch.Tensor"):
        fn(h, W, tg, d["mask"])
    with pytest.raises(ValueError, match=r"ref_logps: expected shape \[2B\]"):
        fn(h, W, tg, m, ref_logps=f32(d["ref_logps"])[:-1])
    with pytest.raises(TypeError, match="ref_logps: expected dtype torch.float32"):
        fn(h, W, tg, m, ref_logps=f64(d["ref_logps"]))
    with pytest.raises(ValueError, match=r"ref_per_token_logps: expected shape \[2B, T\]"):
        fn(h, W, tg, m, ref_per_token_logps=f32(d["ref_per_token_logps"]).t())
    with pytest.raises(ValueError, match="weight: expected shape"):
        fn(h, W[:, :-1], tg, m)
    a = lambda t: t.numpy()  # noqa: E731
    with pytest.raises(ValueError, match=r"hidden: expected \[2B, T, H\]"):
        numpy_preference(a(h)[:, 1:], a(W), d["targets"], a(m))
    with pytest.raises(TypeError, match="mask: expected dtype float32"):
        numpy_preference(a(h), a(W), d["targets"], d["mask"])
    with pytest.raises(ValueError, match="return_grads"):
        numpy_preference(a(h), a(W), d["targets"], a(m), return_grads=["bias"])
