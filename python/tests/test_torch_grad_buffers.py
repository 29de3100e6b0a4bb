"""fusedhead.torch's recycled weight-gradient buffers under autograd's rules: training loops (zero_grad both
ways, micro-batch accumulation, scaled losses), tied weights, retained graphs, torch.autograd.grad, hooks and
threads, each against torch's materialized computation (F.linear + F.cross_entropy, or TRL's GRPO loss) in
float64. Tolerance: normwise GRAD_RTOL_F64 = 1e-5 on every gradient (conftest.py: fp32 GEMM rounding against
a float64 reference on the same inputs; a sum of two micro-batches or a scaled copy adds at most a rounding of
the same size). GRPO: test_grpo.py's GRAD_TOL = 1e-4 (its coefficients scale fp32 log-prob errors). The
checks that a gradient the caller still holds is never overwritten compare bit for bit:
nothing may write to it at all.
"""
from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusedhead.torch as fht  # noqa: E402
from conftest import GRAD_RTOL_F64, make_data, normwise  # noqa: E402
from reference import reference_loss  # noqa: E402
from test_grpo import GRAD_TOL as GRPO_GRAD_TOL, make_grpo, trl_reference  # noqa: E402

N, H, V = 29, 16, 211


def batches(count, seed, n=N):
    """count micro-batches (hidden float32, targets) sharing the shapes H, V."""
    out = []
    for i in range(count):
        x, _, t, _, _ = make_data(seed=seed + i, n=n, h=H, v=V, ignore_frac=0.1)
        out.append((torch.from_numpy(x), torch.from_numpy(t)))
    return out


def weights(seed):
    """The same weight as a float32 Parameter (fusedhead) and a float64 Parameter (the torch reference)."""
    w = make_data(seed=seed, n=1, h=H, v=V)[1]
    return torch.nn.Parameter(torch.tensor(w)), torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))


def assert_grad_close(got, ref):
    assert got is not None and ref is not None
    assert normwise(got.detach().numpy(), ref.detach().numpy()) <= GRAD_RTOL_F64


@pytest.mark.parametrize("scale", [1.0, 0.5], ids=["loss", "loss_over_k"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_loop(set_to_none, reduction, scale):
    """Three steps of two micro-batches each (backward twice before zero_grad), optimizer.zero_grad either way;
    scale 0.5 is gradient accumulation's loss / k (backward scales the saved gradient into a second buffer).
    The gradient of the previous step, kept by the caller, must survive the next step untouched."""
    W, W64 = weights(1)
    opt, opt64 = torch.optim.SGD([W], lr=0.1), torch.optim.SGD([W64], lr=0.1)
    kept = None
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        opt64.zero_grad(set_to_none=set_to_none)
        for x, t in batches(2, seed=10 * step):
            (fht.fused_linear_cross_entropy(x, W, t, reduction=reduction).sum() * scale).backward()
            (reference_loss(x.double(), W64, t, reduction=reduction).sum() * scale).backward()
        assert_grad_close(W.grad, W64.grad)
        if kept is not None:
            assert torch.equal(kept[0], kept[1])
        if set_to_none:  # zero_grad(set_to_none=False) zeroes this same tensor in place: the caller's choice
            kept = (W.grad, W.grad.clone())


def test_dweight_buffer_recycled_only_when_free():
    """What the pool is for: with zero_grad(set_to_none=True) .grad is the same memory every step (no fresh
    pages to fault in); a .grad the caller keeps is never handed out again."""
    W, _ = weights(2)
    (x, t), = batches(1, seed=20)
    ptrs = []
    for _ in range(3):
        W.grad = None
        fht.fused_linear_cross_entropy(x, W, t).backward()
        ptrs.append(W.grad.data_ptr())
    assert len(set(ptrs)) == 1
    kept, snapshot = W.grad, W.grad.clone()
    W.grad = None
    fht.fused_linear_cross_entropy(x, W, t, reduction="sum").backward()
    assert W.grad.data_ptr() != kept.data_ptr() and torch.equal(kept, snapshot)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset")
@pytest.mark.parametrize("scale", [1.0, 0.5], ids=["loss", "loss_over_k"])
def test_step_holds_one_weight_gradient(scale):
    """A train step after the first allocates no weight-sized memory: the pool's buffers (the gradient, and its
    scaled copy for loss / k) and the kept .grad are all it needs. Measured as the peers benchmark does, by the peak
    RSS (VmHWM) above the RSS before the step. The weight (36 MiB) is above glibc's 32 MiB mmap ceiling, so a
    weight-sized temporary is fresh pages that count: autograd's zero gradients for the step's non-differentiable
    outputs (the saved dweight among them) were one."""
    v, h = 9216, 1024
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(v, h) * 0.03)
    x = torch.randn(8, h, requires_grad=True)
    t = torch.randint(0, v, (8,))
    weight_kib = v * h * 4 // 1024
    W.grad = torch.zeros_like(W)  # kept and zeroed in place, as the peers benchmark does (never a pool buffer)

    def step():
        W.grad.zero_()
        (fht.fused_linear_cross_entropy(x, W, t) * scale).backward()

    for _ in range(2):  # the pool's buffers, the workspace and .grad, as in any training run
        step()
    base = _rss_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    step()
    assert _rss_kib("VmHWM:") - base < weight_kib // 2


@pytest.mark.parametrize("set_to_none", [True, False])
def test_tied_embedding_and_lm_head(set_to_none):
    """One Parameter as the input embedding and the lm_head: autograd sums both gradients (it may add in
    place into the one this library returned) before accumulating into .grad."""
    E, E64 = weights(3)
    opt, opt64 = torch.optim.SGD([E], lr=0.1), torch.optim.SGD([E64], lr=0.1)
    ids = torch.randint(0, V, (2, N))
    for step in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        opt64.zero_grad(set_to_none=set_to_none)
        for b in range(2):
            targets = torch.roll(ids[b], -1)
            fht.fused_linear_cross_entropy(torch.tanh(F.embedding(ids[b], E)), E, targets).backward()
            reference_loss(torch.tanh(F.embedding(ids[b], E64)), E64, targets).backward()
        assert_grad_close(E.grad, E64.grad)


def test_retain_graph_interleaved_with_a_new_step():
    """A retained graph keeps its saved gradient: a second forward meanwhile gets another buffer, and later
    backward calls through either graph see their own gradients."""
    W, W64 = weights(4)
    (x1, t1), (x2, t2) = batches(2, seed=40)
    loss1 = fht.fused_linear_cross_entropy(x1, W, t1)
    ref1 = reference_loss(x1.double(), W64, t1)
    loss1.backward(retain_graph=True)
    ref1.backward(retain_graph=True)
    loss2 = fht.fused_linear_cross_entropy(x2, W, t2)
    ref2 = reference_loss(x2.double(), W64, t2)
    (3.0 * loss2).backward()
    (3.0 * ref2).backward()
    (0.5 * loss1).backward(retain_graph=True)  # scaled into a copy: the saved gradient stays as it was
    (0.5 * ref1).backward(retain_graph=True)
    loss1.backward()
    ref1.backward()
    assert_grad_close(W.grad, W64.grad)


def test_autograd_grad_without_dot_grad():
    """torch.autograd.grad hands the gradient to the caller (nothing in .grad); held across later steps it
    stays as it was."""
    W, W64 = weights(5)
    held = []
    for x, t in batches(3, seed=50):
        for reduction in ("mean", "none"):
            g, = torch.autograd.grad(fht.fused_linear_cross_entropy(x, W, t, reduction=reduction).sum(), [W])
            r, = torch.autograd.grad(reference_loss(x.double(), W64, t, reduction=reduction).sum(), [W64])
            assert_grad_close(g, r)
            held.append((g, g.clone()))
    assert W.grad is None
    assert all(torch.equal(g, snapshot) for g, snapshot in held)


def test_hooks_on_the_weight():
    """Tensor hooks see the gradient before accumulation; one that keeps it keeps it unchanged, one that
    returns a new gradient replaces it."""
    W, W64 = weights(6)
    seen = []
    W.register_hook(lambda g: seen.append((g, g.clone())))
    W.register_hook(lambda g: 2.0 * g)
    W64.register_hook(lambda g: 2.0 * g)
    for step, (x, t) in enumerate(batches(3, seed=60)):
        W.grad = None
        W64.grad = None
        fht.fused_linear_cross_entropy(x, W, t).backward()
        reference_loss(x.double(), W64, t).backward()
        assert_grad_close(W.grad, W64.grad)
        assert_grad_close(seen[-1][0], W64.grad / 2.0)
    assert len(seen) == 3 and all(torch.equal(g, snapshot) for g, snapshot in seen)


def test_no_tokens_after_a_step_gives_zero_gradient():
    """N = 0 skips the library: the recycled buffer (holding the previous gradient) must be zeroed."""
    W, _ = weights(7)
    (x, t), = batches(1, seed=70)
    fht.fused_linear_cross_entropy(x, W, t).backward()
    W.grad = None
    fht.fused_linear_cross_entropy(x[:0], W, t[:0]).backward()
    assert torch.count_nonzero(W.grad) == 0


def test_weight_replaced_by_another_shape():
    """weight.data of another shape (a resized vocabulary): the pool's buffer of the old size is replaced."""
    W, _ = weights(8)
    (x, t), = batches(1, seed=80)
    fht.fused_linear_cross_entropy(x, W, t).backward()
    grown = make_data(seed=81, n=1, h=H, v=V + 37)[1]
    W.data = torch.tensor(grown)
    W.grad = None
    W64 = torch.tensor(grown, dtype=torch.float64, requires_grad=True)
    fht.fused_linear_cross_entropy(x, W, t, reduction="sum").backward()
    reference_loss(x.double(), W64, t, reduction="sum").backward()
    assert W.grad.shape == (V + 37, H)
    assert_grad_close(W.grad, W64.grad)


def test_threads_sharing_a_weight():
    """Concurrent steps on one weight each get a buffer no other step is using."""
    W, W64 = weights(9)
    data = batches(3, seed=90)
    expected = [torch.autograd.grad(reference_loss(x.double(), W64, t), [W64])[0] for x, t in data]
    errors = []

    def work(i):
        try:
            x, t = data[i]
            for _ in range(10):
                g, = torch.autograd.grad(fht.fused_linear_cross_entropy(x, W, t), [W])
                if normwise(g.numpy(), expected[i].numpy()) > GRAD_RTOL_F64:
                    errors.append((i, normwise(g.numpy(), expected[i].numpy())))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grpo_training_loop(set_to_none):
    """GRPO's train step saves its gradients the same way: two micro-batches per step, zero_grad either way,
    a scaled loss, against TRL's loss in float64; a kept gradient survives the next step."""
    base = make_grpo(seed=11)
    W = torch.nn.Parameter(torch.tensor(base["W"], dtype=torch.float32))
    W64 = torch.nn.Parameter(torch.tensor(base["W"]))
    opt, opt64 = torch.optim.SGD([W], lr=0.1), torch.optim.SGD([W64], lr=0.1)
    kept = None
    for step in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        opt64.zero_grad(set_to_none=set_to_none)
        for micro in range(2):
            d = make_grpo(seed=20 + 2 * step + micro)
            f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
            f64 = torch.tensor
            opts = dict(loss_type="dapo", beta=0.04, temperature=0.7)
            loss, _ = fht.fused_linear_grpo_loss(f32(d["h"]), W, torch.tensor(d["ids"]), f32(d["mask"]),
                                                 f32(d["A"]), None, f32(d["old"]), f32(d["ref"]), **opts)
            (0.5 * loss).backward()
            ref, _, _ = trl_reference(f64(d["h"]), W64, None, torch.tensor(d["ids"]), f64(d["mask"]), f64(d["A"]),
                                      f64(d["old"]), f64(d["ref"]), **opts)
            (0.5 * ref).backward()
        assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRPO_GRAD_TOL
        if kept is not None:
            assert torch.equal(kept[0], kept[1])
        if set_to_none:
            kept = (W.grad, W.grad.clone())
