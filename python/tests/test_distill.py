"""fusedhead's distillation head (forward KL, reverse KL, generalized JSD, plus a hard-label cross-entropy) through
fusedhead.torch and fusedhead.numpy, against the formulas of include/fusedhead.h ("Distillation": TRL's GKD
generalized_jsd_loss, Liger's fused linear JSD / distillation losses) written in torch float64 on materialised
logits, autograd for the gradients.

Tolerances (the issue's acceptance bounds, and test_preference.py's / conftest.py's fp32 bounds):
  - LOSS_TOL = 1e-5 relative for the loss and its soft / hard parts (fp32 inputs): the library runs fp32 GEMMs on
    the same fp32-representable inputs (about sqrt(H) * 6e-8 relative per logit) and keeps per-token statistics
    in double, but its per-element divergence terms (log p - log m, the mixture's log-add-exp) are formed in fp32
    (src/heads/distill.c), about 1e-7 relative of terms of order log V; D_i is O(0.1 - 1) on this data (independent
    random heads), so the relative error stays near 1e-6.
  - GRAD_TOL = 1e-4 normwise for the student's dx, dweight, dbias (fp32): dU is formed in fp32 from those fp32
    terms, then the fp32 gradient GEMMs (sums over V or N) add their rounding.
  - bf16 (test_bf16_*): against float64 on the same bf16 values (bf16 -> float64 is exact), test_bf16.py's bounds
    for the same reasons: the logits are exact bf16 products accumulated in f32, so the library's double loss is
    within LOSS_TOL (checked through fusedhead.numpy, which returns it unrounded); the torch loss is that value
    rounded once to bf16 (assert_rounds_from). Gradients: dU rounded once to bf16 before the bf16 GEMMs (the C
    tests allow 4e-3 normwise for that) plus bf16 output rounding (unit roundoff 2^-8 = 3.9e-3): GRAD_TOL_BF16 =
    8e-3 for bf16 gradients, 4e-3 for fp32 gradients of bf16 inputs (numpy grad_dtype fp32). dbias is a column
    sum of the f32 dU (never rounded to bf16): fp32 accuracy, 1e-5 (an fp32 bias).
FUSEDHEAD_TEST_REPORT=1 (with pytest -s) prints the largest errors measured over these cases.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusedhead  # noqa: E402
import fusedhead.numpy as fhnp  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from conftest import REPO_ROOT, normwise  # noqa: E402
from fusedhead import _core, _lib  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32: the acceptance bounds (see the module docstring)
GRAD_TOL_BF16, GRAD_TOL_BF16_FP32_OUT, DBIAS_TOL_BF16 = 8e-3, 4e-3, 1e-5  # bf16 inputs (module docstring)
ERRORS = {}  # the largest error seen per kind, for the __main__ report


@pytest.fixture(scope="module", autouse=True)
def report_errors():
    yield
    if os.environ.get("FUSEDHEAD_TEST_REPORT"):
        print("\nlargest errors:", {k: f"{v:.2e}" for k, v in sorted(ERRORS.items())})


def _record(kind: str, value: float) -> float:
    ERRORS[kind] = max(ERRORS.get(kind, 0.0), value)
    return value


# ---------------------------------------------------------------------------------------------------------
# The reference: the header's formulas (TRL's generalized_jsd_loss for the divergences) in float64
# ---------------------------------------------------------------------------------------------------------
def divergence_of_logits(zs, zt, divergence, beta, temperature):
    """D per token [N] of the student's and teacher's logits [N, V], in their dtype."""
    s_lp = F.log_softmax(zs / temperature, -1)  # log p (student)
    t_lp = F.log_softmax(zt / temperature, -1)  # log q (teacher)
    def kl(inp, target):  # KL(target || inp), per token, as TRL's F.kl_div(..., log_target=True)
        return F.kl_div(inp, target, reduction="none", log_target=True).sum(-1)

    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        return kl(s_lp, t_lp)  # KL(q || p)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        return kl(t_lp, s_lp)  # KL(p || q)
    b = torch.tensor(beta, dtype=zs.dtype)  # TRL: the mixture beta q + (1 - beta) p in log space
    m = torch.logsumexp(torch.stack([s_lp + torch.log(1 - b), t_lp + torch.log(b)]), dim=0)
    return beta * kl(m, t_lp) + (1 - beta) * kl(m, s_lp)


def reference(xs, Ws, bs, xt, Wt, bt, targets=None, *, divergence="jsd", beta=0.5, temperature=1.0,
              weight_soft_loss=1.0, weight_hard_loss=0.0, ignore_index=-100, reduction="mean"):
    """(loss, soft_loss, hard_loss, per-token loss [N]); xs [..., Hs], Ws [V, Hs], xt [..., Ht], Wt [V, Ht] float64
    (biases [V] or None), targets int64 [N] or None (every token counts). hard_loss is 0 when weight_hard_loss is
    0 (the library does not compute the cross-entropy then)."""
    V = Ws.shape[0]
    zs = F.linear(xs, Ws, bs).reshape(-1, V)
    zt = F.linear(xt, Wt, bt).reshape(-1, V)
    D = divergence_of_logits(zs, zt, divergence, beta, temperature)
    n = zs.shape[0]
    counted = torch.ones(n, dtype=torch.bool) if targets is None else targets.reshape(-1) != ignore_index
    ce = torch.zeros(n, dtype=torch.float64)
    if targets is not None and weight_hard_loss != 0:
        ce = F.cross_entropy(zs, torch.where(counted, targets.reshape(-1), 0), reduction="none")  # untempered
    zero = torch.zeros((), dtype=torch.float64)
    D, ce = torch.where(counted, D, zero), torch.where(counted, ce, zero)
    per_token = weight_soft_loss * D + weight_hard_loss * ce
    count = int(counted.sum())
    if reduction == "mean":
        reduce = (lambda v: v.sum() / count) if count else (lambda v: v.sum() * 0.0)  # noqa: E731
    else:  # sum; for none the library's soft / hard / loss scalars are the sums too
        reduce = lambda v: v.sum()  # noqa: E731
    return reduce(per_token), reduce(D), reduce(ce), per_token


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def _fp32(a):
    return np.asarray(a, dtype=np.float32).astype(np.float64)


def make_distill(seed=0, B=3, T=5, Hs=16, Ht=24, V=97, *, bias=False, ignore_index=-100, ignore=True):
    """fp32-representable float64 arrays: student hidden [B, T, Hs] and weight [V, Hs], teacher hidden [B, T, Ht]
    and weight [V, Ht] (a different hidden size), logits of standard deviation about 3 (teacher 2), biases,
    and int64 targets [B, T] with ignore_index at some positions (at least one token ignored, most counted)."""
    rng = np.random.default_rng(seed)
    d = dict(xs=_fp32(rng.standard_normal((B, T, Hs))), Ws=_fp32(rng.standard_normal((V, Hs)) * (3 / math.sqrt(Hs))),
             xt=_fp32(rng.standard_normal((B, T, Ht))), Wt=_fp32(rng.standard_normal((V, Ht)) * (2 / math.sqrt(Ht))))
    d["bs"] = _fp32(rng.standard_normal(V) * 0.5) if bias else None
    d["bt"] = _fp32(rng.standard_normal(V) * 0.5) if bias else None
    targets = rng.integers(0, V, (B, T)).astype(np.int64)
    if ignore:
        drop = rng.random((B, T)) < 0.25
        drop.flat[1] = True
        drop.flat[0] = False
        targets[drop] = ignore_index
    d["targets"] = targets
    return d


def f32(a, grad=False):
    return None if a is None else torch.tensor(a, dtype=torch.float32, requires_grad=grad)


def f64(a, grad=False):
    return None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def in_layout(W: np.ndarray, layout: str) -> np.ndarray:
    return W if layout == "vh" else np.ascontiguousarray(W.T)


def run_both(d, *, targets=True, upstream=1.0, student_layout="vh", teacher_layout="vh", context=None,
             hidden_2d=False, **opts):
    """(library loss, soft, hard, [dx, dW as [V, H], db]), (reference loss, soft, hard, grads) for the same data;
    gradients of upstream * loss ('none': of sum(upstream * per-token loss), upstream a [B, T] array)."""
    xs, bs = f32(d["xs"], True), f32(d["bs"], True)
    if hidden_2d:
        xs = f32(d["xs"].reshape(-1, d["xs"].shape[-1]), True)
    Ws = f32(in_layout(d["Ws"], student_layout), True)
    tg = torch.tensor(d["targets"]) if targets else None
    lib_tg = tg.reshape(-1) if hidden_2d and tg is not None else tg  # [N] targets beside a 2-D hidden
    loss, soft, hard = fht.fused_linear_distillation_loss(
        xs, Ws, f32(d["xt"]), f32(in_layout(d["Wt"], teacher_layout)), lib_tg, student_bias=bs,
        teacher_bias=f32(d["bt"]), student_layout=student_layout, teacher_layout=teacher_layout,
        return_soft_hard_loss=True, context=context, **opts)
    up = torch.as_tensor(upstream, dtype=torch.float32)
    (loss * up).sum().backward()
    grads = [xs.grad.reshape(d["xs"].shape), Ws.grad if student_layout == "vh" else Ws.grad.t(),
             None if bs is None else bs.grad]
    xs64, Ws64, bs64 = f64(d["xs"], True), f64(d["Ws"], True), f64(d["bs"], d["bs"] is not None)
    rloss, rsoft, rhard, rper = reference(xs64, Ws64, bs64, f64(d["xt"]), f64(d["Wt"]), f64(d["bt"]), tg, **opts)
    if opts.get("reduction") == "none":
        rloss = rper.view(d["targets"].shape)
    (rloss * up.double()).sum().backward()
    return (loss, soft, hard, grads), (rloss, rsoft, rhard, [xs64.grad, Ws64.grad, None if bs64 is None else bs64.grad])


def close(got: float, want: float, tol: float = LOSS_TOL, kind: str = "loss") -> bool:
    """|got - want| <= tol |want| (tol absolute where want is 0: a hard_loss of 0)."""
    err = abs(got - want) / (abs(want) if want != 0 else 1.0)
    return _record(kind, err) <= tol


def check(lib, ref, dtype=torch.float32):
    (loss, soft, hard, grads), (rloss, rsoft, rhard, rgrads) = lib, ref
    assert loss.dtype == dtype and soft.dtype == dtype and hard.dtype == dtype
    assert not soft.requires_grad and not hard.requires_grad
    if loss.dim() == 0:
        assert close(loss.item(), rloss.item()), (loss.item(), rloss.item())
    else:
        assert loss.shape == rloss.shape
        err = np.abs(loss.detach().double().numpy() - rloss.detach().numpy()).max() / rloss.abs().max().item()
        assert _record("per_token", err) <= LOSS_TOL, err
    assert close(soft.item(), rsoft.item(), kind="soft_hard"), (soft.item(), rsoft.item())
    assert close(hard.item(), rhard.item(), kind="soft_hard"), (hard.item(), rhard.item())
    for name, g, rg in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert (g is None) == (rg is None), name
        if g is not None:
            assert g.dtype == dtype
            assert _record("grad", normwise(g.double().numpy(), rg.numpy())) <= GRAD_TOL, name


# ---------------------------------------------------------------------------------------------------------
# Every divergence, with each group of options
# ---------------------------------------------------------------------------------------------------------
DIVERGENCES = {"forward_kl": dict(divergence="forward_kl"), "reverse_kl": dict(divergence="reverse_kl"),
               "jsd": dict(divergence="jsd"), "jsd_beta0.3": dict(divergence="jsd", beta=0.3),
               "jsd_beta0": dict(divergence="jsd", beta=0.0), "jsd_beta1": dict(divergence="jsd", beta=1.0)}
CONFIGS = {
    # no targets (every token counts), T = 1, mean, both weights [V, H]
    "plain": dict(targets=False),
    # temperature 2 with a hard loss (the untempered logits' own statistics), ignored tokens, both biases, the
    # student's weight [H, V], a 2-D student hidden, mean
    "tempered_hard_bias_hv": dict(temperature=2.0, weight_soft_loss=0.7, weight_hard_loss=0.4, bias=True,
                                  student_layout="hv", hidden_2d=True),
    # temperature 1 with a hard loss (shares the student's statistics), ignore_index -1, sum, the teacher's
    # weight [H, V], (loss * -2.5).backward(): backward scales the saved gradients
    "sum_hard_teacher_hv": dict(weight_hard_loss=1.0, ignore_index=-1, reduction="sum", teacher_layout="hv",
                                upstream=-2.5),
    # temperature 0.7, both weights [H, V], a bias, soft weight 0 (the hard loss alone)
    "hard_only_cold": dict(temperature=0.7, weight_soft_loss=0.0, weight_hard_loss=1.0, bias=True,
                           student_layout="hv", teacher_layout="hv"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("div", list(DIVERGENCES))
def test_matches_reference(div, config):
    opts = dict(DIVERGENCES[div], **CONFIGS[config])
    seed = list(DIVERGENCES).index(div) * 10 + list(CONFIGS).index(config)
    d = make_distill(seed, bias=opts.pop("bias", False), ignore_index=opts.get("ignore_index", -100))
    check(*run_both(d, **opts))


@pytest.mark.parametrize("div", ["forward_kl", "jsd_beta0.3"])
def test_reduction_none(div):
    """'none': per-token losses (0 at ignored tokens) and, in backward, fh_distill_forward_backward with the
    per-token upstream gradient; soft / hard are the sums over tokens."""
    d = make_distill(40, bias=True)
    up = np.random.default_rng(41).uniform(-2, 2, d["targets"].shape).astype(np.float32)
    lib, ref = run_both(d, upstream=up, reduction="none", temperature=1.5, weight_hard_loss=0.3,
                        **DIVERGENCES[div])
    check(lib, ref)
    assert lib[0].shape == d["targets"].shape
    assert bool((lib[0][torch.tensor(d["targets"]) == -100] == 0).all())


JSD_NEAR_TOL = 3e-9  # absolute per token: the README's "a few 1e-9", as torch's own fp32 (below)


@pytest.mark.parametrize("beta,temperature", [(0.5, 1.0), (0.1, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jsd_nearly_identical_heads(seed, beta, temperature):
    """The per-token JSD of a student and a teacher that nearly agree (D ~ 1e-6 per token) against float64 on the
    same fp32 logits, to JSD_NEAR_TOL absolute. The library forms each column's term from log(m / p) and log(m / q)
    near 0 with expm1 / log1p, so that the terms are O(p delta^2) (delta = log q - log p) and nothing cancels
    against a constant (include/fusedhead.h's formula summed per column in fp32 was 1e-8 off here). Its logits differ
    from torch's fp32 ones by GEMM rounding (~1e-7 relative), which moves D by ~delta 1e-7 ~ 1e-10. The same data
    through torch's own fp32 formula (the reference in float32) is printed for comparison, not asserted."""
    rng = np.random.default_rng(70 + seed)
    N, H, V = 16, 64, 32768
    x = _fp32(rng.standard_normal((N, H)))
    Ws = _fp32(rng.standard_normal((V, H)) * (3 / math.sqrt(H)))
    Wt = _fp32(Ws + rng.standard_normal((V, H)) * (3.5e-4 * temperature))  # log q - log p ~ 3e-3: D ~ 1e-6
    per_token = fht.fused_linear_distillation_loss(f32(x), f32(Ws), f32(x), f32(Wt), divergence="jsd", beta=beta,
                                                   temperature=temperature, reduction="none")
    zs, zt = F.linear(f32(x), f32(Ws)), F.linear(f32(x), f32(Wt))  # torch's fp32 logits
    ref = divergence_of_logits(zs.double(), zt.double(), "jsd", beta, temperature)
    assert 1e-7 < ref.mean().item() < 1e-5, ref.mean().item()  # the regime described
    err = (per_token.double() - ref).abs().max().item()
    torch_fp32 = divergence_of_logits(zs, zt, "jsd", beta, temperature)
    _record("jsd_near_identical_abs", err)
    _record("jsd_near_identical_abs_torch_fp32", (torch_fp32.double() - ref).abs().max().item())
    assert err <= JSD_NEAR_TOL, err


SCHEDULES = {  # n = B T = 32 rows of V = 517
    "one_block": dict(threads=1),  # fewer than 256 rows: one row block holding both heads' logits
    "row_blocks": dict(tile_rows=8, threads=2),  # an explicit tile_rows: 4 row blocks, on two threads
    # 32 rows of 2 x 517 floats do not fit: streams, 9 vocabulary tiles (one thread: streaming's many OpenMP
    # barriers cost a scheduler time slice each on a loaded 2-core machine)
    "streaming": dict(memory_budget=64 * 1024, tile_vocab=64, threads=1),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedules(schedule):
    """fh_distill_forward_backward's schedules (row blocks or streaming; jsd folds twice)."""
    d = make_distill(50, B=4, T=8, V=517, bias=True)
    with fusedhead.Context(**SCHEDULES[schedule]) as ctx:
        lib, ref = run_both(d, context=ctx, upstream=0.5, divergence="jsd", beta=0.3, temperature=1.7,
                            weight_hard_loss=0.5)
        check(lib, ref)
        with torch.no_grad():  # fh_distill_forward's streaming passes
            loss = fht.fused_linear_distillation_loss(f32(d["xs"]), f32(d["Ws"]), f32(d["xt"]), f32(d["Wt"]),
                                                      torch.tensor(d["targets"]), student_bias=f32(d["bs"]),
                                                      teacher_bias=f32(d["bt"]), beta=0.3, temperature=1.7,
                                                      weight_hard_loss=0.5, context=ctx)
    assert close(loss.item(), ref[0].item())


def test_all_ignored_and_empty():
    """Every token ignored: loss 0 and zero gradients ('mean' never NaN); N = 0: the same without a library call."""
    d = make_distill(60, bias=True)
    d["targets"][...] = -100
    (loss, soft, hard, grads), _ = run_both(d, weight_hard_loss=0.5)
    assert loss.item() == 0.0 and soft.item() == 0.0 and hard.item() == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)
    xs, Ws = torch.zeros(0, 16, requires_grad=True), f32(d["Ws"], True)
    loss = fht.fused_linear_distillation_loss(xs, Ws, torch.zeros(0, 24), f32(d["Wt"]))
    loss.backward()
    assert loss.item() == 0.0 and xs.grad.shape == (0, 16) and float(Ws.grad.abs().max()) == 0.0
    r = fhnp.distill_loss(np.zeros((0, 16), np.float32), d["Ws"].astype(np.float32), np.zeros((0, 24), np.float32),
                          d["Wt"].astype(np.float32), return_grads=True)
    assert r.loss == 0.0 and r.dhidden.shape == (0, 16) and not r.dweight.any()


# ---------------------------------------------------------------------------------------------------------
# Autograd: the teacher gets no gradient, no grad, partial gradients, modules, the weight-gradient buffer
# ---------------------------------------------------------------------------------------------------------
def test_teacher_gets_no_gradient():
    """Teacher tensors that require grad are detached: they get no .grad, and the student's gradients are those
    of the constant teacher. A teacher alone requiring grad needs no autograd at all."""
    d = make_distill(70, bias=True)
    xs, Ws, bs = f32(d["xs"], True), f32(d["Ws"], True), f32(d["bs"], True)
    xt, Wt, bt = f32(d["xt"], True), f32(d["Wt"], True), f32(d["bt"], True)
    teacher_graph = xt * 1.0  # the teacher's output as a teacher model in train mode would give it
    tg = torch.tensor(d["targets"])
    loss = fht.fused_linear_distillation_loss(xs, Ws, teacher_graph, Wt, tg, student_bias=bs, teacher_bias=bt,
                                              weight_hard_loss=0.2)
    loss.backward()
    assert xt.grad is None and Wt.grad is None and bt.grad is None
    xs2, Ws2, bs2 = f32(d["xs"], True), f32(d["Ws"], True), f32(d["bs"], True)
    loss2 = fht.fused_linear_distillation_loss(xs2, Ws2, f32(d["xt"]), f32(d["Wt"]), tg, student_bias=bs2,
                                               teacher_bias=f32(d["bt"]), weight_hard_loss=0.2)
    loss2.backward()
    assert loss.item() == loss2.item()
    for a, b in ((xs, xs2), (Ws, Ws2), (bs, bs2)):
        assert torch.equal(a.grad, b.grad)
    only_teacher = fht.fused_linear_distillation_loss(f32(d["xs"]), f32(d["Ws"]), xt, Wt, tg)
    assert only_teacher.grad_fn is None and not only_teacher.requires_grad


def test_no_grad_and_partial_grads():
    d = make_distill(71, bias=True)
    xs, Ws, bs = f32(d["xs"]), f32(d["Ws"], True), f32(d["bs"])
    args = (f32(d["xt"]), f32(d["Wt"]), torch.tensor(d["targets"]))
    opts = dict(student_bias=bs, divergence="reverse_kl", temperature=1.3, weight_hard_loss=0.6)
    with torch.no_grad():
        l0 = fht.fused_linear_distillation_loss(xs, Ws, *args, **opts)
    assert l0.grad_fn is None
    l1 = fht.fused_linear_distillation_loss(xs, Ws, *args, **opts)
    assert l1.item() == l0.item()
    l1.backward()
    assert xs.grad is None and bs.grad is None and Ws.grad is not None


def test_modules():
    """FusedLinearJSDLoss (Liger's LigerFusedLinearJSD names: jsd_beta, ignore_index, temperature; shift_labels
    only mask tokens) and FusedLinearDistillationLoss (every option) against the reference."""
    d = make_distill(72, bias=True)
    tg = torch.tensor(d["targets"])
    fn = fht.FusedLinearJSDLoss(jsd_beta=0.3, temperature=2.0)
    assert "jsd_beta=0.3" in repr(fn) and "temperature=2.0" in repr(fn)
    xs, Ws = f32(d["xs"], True), f32(d["Ws"], True)
    loss = fn(xs, Ws, f32(d["xt"]), f32(d["Wt"]), tg)
    loss.backward()
    xs64, Ws64 = f64(d["xs"], True), f64(d["Ws"], True)
    rloss = reference(xs64, Ws64, None, f64(d["xt"]), f64(d["Wt"]), None, tg, beta=0.3, temperature=2.0)[0]
    rloss.backward()
    assert close(loss.item(), rloss.item())
    assert normwise(xs.grad.numpy(), xs64.grad.numpy()) <= GRAD_TOL
    assert normwise(Ws.grad.numpy(), Ws64.grad.numpy()) <= GRAD_TOL
    opts = dict(divergence="forward_kl", temperature=1.5, weight_soft_loss=0.5, weight_hard_loss=0.5,
                reduction="sum")
    fn = fht.FusedLinearDistillationLoss(**opts, student_layout="hv", return_soft_hard_loss=True)
    assert all(f"{k}={v!r}" in repr(fn) for k, v in opts.items())
    xs, Wsh, bs = f32(d["xs"], True), f32(in_layout(d["Ws"], "hv"), True), f32(d["bs"], True)
    out = fn(xs, Wsh, f32(d["xt"]), f32(d["Wt"]), tg, bs, f32(d["bt"]))
    out[0].backward()
    xs64, Ws64, bs64 = f64(d["xs"], True), f64(d["Ws"], True), f64(d["bs"], True)
    ref = reference(xs64, Ws64, bs64, f64(d["xt"]), f64(d["Wt"]), f64(d["bt"]), tg, **opts)
    ref[0].backward()
    check((*out, [xs.grad, Wsh.grad.t(), bs.grad]), (*ref[:3], [xs64.grad, Ws64.grad, bs64.grad]))
    with pytest.raises(ValueError, match="divergence must be one of 'forward_kl', 'reverse_kl', 'jsd'"):
        fht.FusedLinearDistillationLoss(divergence="tvd")
    with pytest.raises(ValueError, match="layout"):
        fht.FusedLinearJSDLoss(student_layout="kv")


def test_training_loop_weight_buffer():
    """The student weight's gradient goes through the pooled buffer like the other losses': two micro-batches of
    loss / 2 per step against the reference; a gradient the caller kept survives the next step."""
    W = torch.nn.Parameter(f32(make_distill(80)["Ws"]))
    W64 = torch.nn.Parameter(f64(make_distill(80)["Ws"]))
    opt, opt64 = torch.optim.SGD([W], lr=0.1), torch.optim.SGD([W64], lr=0.1)
    kept = None
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        opt64.zero_grad(set_to_none=True)
        for micro in range(2):
            d = make_distill(81 + 2 * step + micro)
            tg = torch.tensor(d["targets"])
            (0.5 * fht.fused_linear_distillation_loss(f32(d["xs"]), W, f32(d["xt"]), f32(d["Wt"]), tg,
                                                      weight_hard_loss=0.5)).backward()
            (0.5 * reference(f64(d["xs"]), W64, None, f64(d["xt"]), f64(d["Wt"]), None, tg,
                             weight_hard_loss=0.5)[0]).backward()
        assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRAD_TOL
        if kept is not None:
            assert torch.equal(kept[0], kept[1])
        kept = (W.grad, W.grad.clone())
        opt.step()
        opt64.step()


# ---------------------------------------------------------------------------------------------------------
# NumPy
# ---------------------------------------------------------------------------------------------------------
def test_numpy_distill_loss():
    """fusedhead.numpy.distill_loss / distill_forward_backward: loss, parts, per-token losses and gradients of
    grad_output * loss against the reference; the same values as the torch front end; 'none' with per-token
    grad_output."""
    d = make_distill(90, bias=True)
    a = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v)
         for k, v in d.items()}
    opts = dict(divergence="jsd", beta=0.7, temperature=1.2, weight_hard_loss=0.3)
    ws_hv = np.ascontiguousarray(a["Ws"].T)
    r = fhnp.distill_forward_backward(a["xs"], ws_hv, a["xt"], a["Wt"], a["targets"], a["bs"], a["bt"],
                                      student_layout="hv", grad_output=-2.0, **opts)
    xs64, Ws64, bs64 = f64(d["xs"], True), f64(d["Ws"], True), f64(d["bs"], True)
    tg = torch.tensor(d["targets"])
    rloss, rsoft, rhard, rper = reference(xs64, Ws64, bs64, f64(d["xt"]), f64(d["Wt"]), f64(d["bt"]), tg, **opts)
    (-2.0 * rloss).backward()
    assert close(r.loss, rloss.item()) and close(r.soft_loss, rsoft.item()) and close(r.hard_loss, rhard.item())
    assert r.per_token_loss.shape == d["targets"].shape and r.per_token_loss.dtype == np.float32
    np.testing.assert_allclose(r.per_token_loss.ravel(), rper.detach().numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    assert r.dhidden.shape == d["xs"].shape and r.dweight.shape == ws_hv.shape
    for got, want in ((r.dhidden, xs64.grad), (r.dweight.T, Ws64.grad), (r.dbias, bs64.grad)):
        assert normwise(got, want.numpy()) <= GRAD_TOL
    fwd = fhnp.distill_loss(a["xs"], ws_hv, a["xt"], a["Wt"], a["targets"], a["bs"], a["bt"], student_layout="hv",
                            **opts)
    assert fwd.loss == pytest.approx(r.loss, rel=1e-12) and fwd.dhidden is None and fwd.dweight is None
    only_w = fhnp.distill_loss(a["xs"], ws_hv, a["xt"], a["Wt"], a["targets"], a["bs"], a["bt"],
                               student_layout="hv", return_grads=["weight"], **opts)
    assert only_w.dhidden is None and only_w.dbias is None and normwise(only_w.dweight, -0.5 * r.dweight) <= 1e-6
    with torch.no_grad():
        tl = fht.fused_linear_distillation_loss(f32(d["xs"]), f32(in_layout(d["Ws"], "hv")), f32(d["xt"]),
                                                f32(d["Wt"]), tg, student_bias=f32(d["bs"]), teacher_bias=f32(d["bt"]),
                                                student_layout="hv", **opts)
    assert tl.item() == pytest.approx(r.loss, rel=1e-7)
    # 'none': per-token losses, gradients of sum(g * l)
    g = np.random.default_rng(91).uniform(-1, 1, d["targets"].shape).astype(np.float32)
    rn = fhnp.distill_loss(a["xs"], a["Ws"], a["xt"], a["Wt"], a["targets"], reduction="none", return_grads=True,
                           grad_output=g, **opts)
    xs64, Ws64 = f64(d["xs"], True), f64(d["Ws"], True)
    rper = reference(xs64, Ws64, None, f64(d["xt"]), f64(d["Wt"]), None, tg, reduction="none", **opts)[3]
    (rper * torch.tensor(g.ravel(), dtype=torch.float64)).sum().backward()
    assert rn.loss.shape == d["targets"].shape
    np.testing.assert_allclose(rn.loss.ravel(), rper.detach().numpy(), rtol=LOSS_TOL, atol=LOSS_TOL)
    assert normwise(rn.dhidden, xs64.grad.numpy()) <= GRAD_TOL and normwise(rn.dweight, Ws64.grad.numpy()) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------------------
bf16 = pytest.mark.skipif(not fusedhead.bf16_available(), reason=f"bf16 calls are refused here: "
                                                                 f"{fusedhead.kernel_info().refusal}")
BF = torch.bfloat16


def bf16_data(seed):
    """make_distill's arrays rounded to bf16 (as float64 holding bf16 values) so both sides see the same values."""
    d = make_distill(seed, bias=True)
    for k in ("xs", "Ws", "xt", "Wt"):
        d[k] = torch.tensor(d[k]).to(BF).double().numpy()
    return d


def assert_rounds_from(got: torch.Tensor, ref: float, rtol: float = LOSS_TOL):
    """got (a bf16 scalar) is the bf16 rounding of a value within rtol |ref| of ref (rounding is monotone)."""
    tol = rtol * abs(ref)
    lo, hi = torch.tensor(ref - tol, dtype=torch.float64).to(BF), torch.tensor(ref + tol, dtype=torch.float64).to(BF)
    assert got.dtype == BF and bool(lo <= got) and bool(got <= hi), (got, ref)


@bf16
@pytest.mark.parametrize("teacher_dtype", [BF, torch.float32])
def test_bf16_torch(teacher_dtype):
    """bf16 student (and a bf16 or float32 teacher): the loss in bf16, rounded once from the reference's value;
    the student's gradients in bf16 within GRAD_TOL_BF16, the fp32 bias's at fp32 accuracy."""
    d = bf16_data(100)
    opts = dict(divergence="jsd", beta=0.4, temperature=1.5, weight_hard_loss=0.5)
    xs = torch.tensor(d["xs"]).to(BF).requires_grad_()
    Ws = torch.tensor(d["Ws"]).to(BF).requires_grad_()
    bs = f32(d["bs"], True)
    tg = torch.tensor(d["targets"])
    loss = fht.fused_linear_distillation_loss(xs, Ws, torch.tensor(d["xt"]).to(teacher_dtype),
                                              torch.tensor(d["Wt"]).to(teacher_dtype), tg, student_bias=bs,
                                              teacher_bias=f32(d["bt"]), **opts)
    (3.0 * loss).backward()
    xs64, Ws64, bs64 = f64(d["xs"], True), f64(d["Ws"], True), f64(d["bs"], True)
    rloss = reference(xs64, Ws64, bs64, f64(d["xt"]), f64(d["Wt"]), f64(d["bt"]), tg, **opts)[0]
    (3.0 * rloss).backward()
    assert_rounds_from(loss, rloss.item())
    assert xs.grad.dtype == BF and Ws.grad.dtype == BF and bs.grad.dtype == torch.float32
    assert _record("grad_bf16", normwise(xs.grad.double().numpy(), xs64.grad.numpy())) <= GRAD_TOL_BF16
    assert _record("grad_bf16", normwise(Ws.grad.double().numpy(), Ws64.grad.numpy())) <= GRAD_TOL_BF16
    assert _record("dbias_bf16", normwise(bs.grad.numpy(), bs64.grad.numpy())) <= DBIAS_TOL_BF16


@bf16
def test_bf16_numpy():
    """dtype="bf16" through fusedhead.numpy: the library's double loss within LOSS_TOL (not rounded), fp32
    gradients within GRAD_TOL_BF16_FP32_OUT, bf16-bit gradients (grad_dtype="bf16") within GRAD_TOL_BF16."""
    d = bf16_data(101)
    bits = lambda a: torch.tensor(a).to(BF).view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    opts = dict(divergence="reverse_kl", temperature=0.8, weight_hard_loss=1.0, reduction="sum")
    tg = torch.tensor(d["targets"])
    xs64, Ws64, bs64 = f64(d["xs"], True), f64(d["Ws"], True), f64(d["bs"], True)
    rloss = reference(xs64, Ws64, bs64, f64(d["xt"]), f64(d["Wt"]), f64(d["bt"]), tg, **opts)[0]
    rloss.backward()
    for grad_dtype, tol in ((None, GRAD_TOL_BF16_FP32_OUT), ("bf16", GRAD_TOL_BF16)):
        r = fhnp.distill_loss(bits(d["xs"]), bits(d["Ws"]), bits(d["xt"]), bits(d["Wt"]), d["targets"],
                              d["bs"].astype(np.float32), d["bt"].astype(np.float32), dtype="bf16",
                              return_grads=True, grad_dtype=grad_dtype, **opts)
        assert close(r.loss, rloss.item(), kind="loss_bf16")
        grads = [r.dhidden, r.dweight]
        if grad_dtype == "bf16":
            grads = [torch.from_numpy(g.view(np.int16)).view(BF).double().numpy() for g in grads]
        assert _record("grad_bf16", normwise(grads[0], xs64.grad.numpy())) <= tol
        assert _record("grad_bf16", normwise(grads[1], Ws64.grad.numpy())) <= tol


# ---------------------------------------------------------------------------------------------------------
# Errors: library statuses as their classes, outputs untouched, Python-side argument errors
# ---------------------------------------------------------------------------------------------------------
def test_library_errors():
    """The library's checks arrive as their FusedheadError classes with the library's message; a student's
    existing .grad is untouched by a failing call."""
    d = make_distill(110)
    xs, Ws = f32(d["xs"], True), f32(d["Ws"], True)
    Ws.grad = torch.full_like(Ws, 7.0)
    xt, Wt, tg = f32(d["xt"]), f32(d["Wt"]), torch.tensor(d["targets"])
    errors = fusedhead.errors
    cases = [
        (dict(teacher_weight=Wt[:-1]), errors.TeacherMismatchError, fusedhead.Status.ERR_TEACHER_MISMATCH,
         "the teacher has n = 15 and V = 96, the student n = 15 and V = 97"),
        (dict(teacher_input=xt[:, :-1]), errors.TeacherMismatchError, fusedhead.Status.ERR_TEACHER_MISMATCH,
         "the teacher has n = 12"),
        (dict(beta=1.5), errors.InvalidDistillOptionError, fusedhead.Status.ERR_INVALID_DISTILL_OPTION,
         "beta = 1.5 is outside [0, 1]"),
        (dict(beta=-0.1), errors.InvalidDistillOptionError, fusedhead.Status.ERR_INVALID_DISTILL_OPTION, "beta"),
        (dict(beta=float("nan")), errors.InvalidDistillOptionError, fusedhead.Status.ERR_INVALID_DISTILL_OPTION,
         "beta"),
        (dict(weight_hard_loss=-1.0), errors.InvalidDistillOptionError, fusedhead.Status.ERR_INVALID_DISTILL_OPTION,
         "weight_hard_loss = -1"),
        (dict(weight_soft_loss=float("inf")), errors.InvalidDistillOptionError,
         fusedhead.Status.ERR_INVALID_DISTILL_OPTION, "weight_soft_loss = inf"),
        (dict(temperature=0.0), errors.InvalidTemperatureError, fusedhead.Status.ERR_INVALID_TEMPERATURE,
         "temperature = 0"),
        (dict(temperature=-2.0), errors.InvalidTemperatureError, fusedhead.Status.ERR_INVALID_TEMPERATURE,
         "temperature = -2"),
        (dict(targets=None, weight_hard_loss=0.5), errors.NullPointerError, fusedhead.Status.ERR_NULL_POINTER,
         "weight_hard_loss = 0.5 needs them"),
    ]
    for change, cls, status, text in cases:
        args = dict(student_input=xs, student_weight=Ws, teacher_input=xt, teacher_weight=Wt, targets=tg)
        args.update({k: v for k, v in change.items() if k in args})
        opts = {k: v for k, v in change.items() if k not in args}
        with pytest.raises(cls) as e:
            fht.fused_linear_distillation_loss(**args, **opts)
        assert isinstance(e.value, ValueError) and e.value.status == status, change
        assert text in e.value.message and e.value.message in str(e.value), (change, e.value.message)
        assert e.value.function == "fh_distill_forward_backward"
    bad = tg.clone()
    bad[0, 0] = 97
    with pytest.raises(fusedhead.TargetOutOfRangeError, match=r"targets\[0\] = 97"):
        fht.fused_linear_distillation_loss(xs, Ws, xt, Wt, bad)
    with pytest.raises(errors.TeacherMismatchError) as e:  # the forward alone reports it too
        fhnp.distill_loss(d["xs"].astype(np.float32), d["Ws"].astype(np.float32), d["xt"].astype(np.float32),
                          d["Wt"][:-1].astype(np.float32))
    assert e.value.function == "fh_distill_forward"
    assert xs.grad is None and bool((Ws.grad == 7.0).all())


def test_outputs_untouched_on_error():
    """On an error the library writes none of its outputs (include/fusedhead.h): gradient buffers, the per-token
    loss, checked through fusedhead._core with sentinel-filled arrays."""
    d = make_distill(111)
    a = {k: np.ascontiguousarray(v, dtype=np.float32) for k in ("xs", "Ws", "xt", "Wt") for v in [d[k]]}
    xs = a["xs"].reshape(-1, a["xs"].shape[-1])
    xt = a["xt"].reshape(-1, a["xt"].shape[-1])
    view = lambda arr: _core.View(arr.ctypes.data, arr.shape, tuple(s // arr.itemsize for s in arr.strides))  # noqa
    student = _core.LinearHead(view(xs), view(a["Ws"]), None)
    targets = d["targets"].reshape(-1).copy()
    dx, dw = np.full(xs.shape, 3.0, np.float32), np.full(a["Ws"].shape, 3.0, np.float32)
    per_token = np.full(xs.shape[0], 3.0, np.float32)
    g = np.ones(1, np.float32)
    bad_cases = [(a["Wt"][:-1], {}), (a["Wt"], dict(beta=2.0)), (a["Wt"], dict(temperature=0.0))]
    for wt, opts in bad_cases:
        wt = np.ascontiguousarray(wt)
        problem = _core.DistillProblem(student, _core.LinearHead(view(xt), view(wt), None), view(targets),
                                       _core.distill_options(**opts))
        with fusedhead.Context(threads=1) as ctx:
            with pytest.raises(fusedhead.FusedheadValueError):
                problem.forward_backward(ctx, g.ctypes.data, student.grads(view(dx), view(dw)), per_token.ctypes.data)
            assert ctx.message
        assert (dx == 3.0).all() and (dw == 3.0).all() and (per_token == 3.0).all(), opts


def test_argument_errors():
    """Python-side checks: TypeError / ValueError naming the argument (and the head it belongs to)."""
    d = make_distill(112)
    xs, Ws, xt, Wt = f32(d["xs"]), f32(d["Ws"]), f32(d["xt"]), f32(d["Wt"])
    tg = torch.tensor(d["targets"])
    fn = fht.fused_linear_distillation_loss
    with pytest.raises(ValueError, match="divergence must be one of 'forward_kl', 'reverse_kl', 'jsd', got 'kl'"):
        fn(xs, Ws, xt, Wt, divergence="kl")
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none'"):
        fn(xs, Ws, xt, Wt, reduction="batchmean")
    with pytest.raises(TypeError, match="beta: expected a real number"):
        fn(xs, Ws, xt, Wt, beta="half")
    with pytest.raises(TypeError, match="ignore_index: expected an integer"):
        fn(xs, Ws, xt, Wt, ignore_index=-100.0)
    with pytest.raises(TypeError, match="teacher hidden: expected dtype torch.float32"):
        fn(xs, Ws, xt.double(), Wt)
    with pytest.raises(TypeError, match="student weight: .*one dtype"):
        fn(xs, Ws.bfloat16(), xt, Wt)
    with pytest.raises(ValueError, match=r"teacher weight: expected shape \[V, H\] = \[\*, 24\]"):
        fn(xs, Ws, xt, Wt[:, :-1])
    with pytest.raises(TypeError, match="targets: expected dtype torch.int64"):
        fn(xs, Ws, xt, Wt, tg.int())
    with pytest.raises(ValueError, match="targets: expected shape"):
        fn(xs, Ws, xt, Wt, tg[:, :-1])
    with pytest.raises(ValueError, match="teacher_input: expected as many tokens"):
        fn(xs, Ws, xt[:0], Wt)
    xs_np, ws_np = d["xs"].astype(np.float32), d["Ws"].astype(np.float32)
    xt_np, wt_np = d["xt"].astype(np.float32), d["Wt"].astype(np.float32)
    with pytest.raises(TypeError, match="teacher hidden: expected dtype float32"):
        fhnp.distill_loss(xs_np, ws_np, d["xt"], wt_np)
    with pytest.raises(ValueError, match="return_grads: expected names among"):
        fhnp.distill_loss(xs_np, ws_np, xt_np, wt_np, return_grads=["bias"])
    with pytest.raises(ValueError, match="grad_output and grad_dtype are only used with return_grads"):
        fhnp.distill_loss(xs_np, ws_np, xt_np, wt_np, grad_output=2.0)
    with pytest.raises(ValueError, match="grad_output: expected a scalar"):
        fhnp.distill_loss(xs_np, ws_np, xt_np, wt_np, return_grads=True, grad_output=np.ones(3, np.float32))


def test_header_enums_and_defaults(tmp_path):
    """fh_divergence's values match _lib.Divergence (compiled against the header; the structs' layouts and the
    statuses are checked by test_lib.py), and distill_options() defaults are fh_distill_options_init's."""
    init = _lib.fh_distill_options()
    assert fusedhead.load_library().fh_distill_options_init(init) == 0
    ours = _core.distill_options()
    assert [getattr(ours, f) for f, _ in init._fields_] == [getattr(init, f) for f, _ in init._fields_]
    assert (init.divergence, init.beta, init.temperature, init.weight_soft_loss, init.weight_hard_loss,
            init.ignore_index, init.reduction) == (2, 0.5, 1.0, 1.0, 0.0, -100, 0)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to check the enum values against the header")
    src = "#include <fusedhead.h>\n#include <stdio.h>\nint main(void) {\n" + "".join(
        f'  printf("%d\\n", (int)FH_DIVERGENCE_{m.name});\n' for m in _lib.Divergence) + "  return 0;\n}\n"
    (tmp_path / "divergence.c").write_text(src)
    subprocess.run([cc, "-std=c11", "-I", str(REPO_ROOT / "include"), str(tmp_path / "divergence.c"), "-o",
                    str(tmp_path / "divergence")], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "divergence")], check=True, capture_output=True, text=True).stdout
    assert [int(v) for v in out.split()] == [int(m) for m in _lib.Divergence]
