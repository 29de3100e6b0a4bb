"""Gradient filtering through the binding: Context(grad_filter_eps=...) and filter_stats().

Tolerance of the filtered gradients against torch float64 (exact, unfiltered): the unfiltered one
(GRAD_RTOL_F64 * ||ref||) plus what filtering may drop, derived from eps. Filtering drops only softmax terms of
dU, the logits' gradient, with |dU_ij| < eps * s_i, s_i the row's scale (for cross-entropy with a mean over N
tokens, 1 / N), never a target's. So the dropped entries lie in S = {(i, j): j != y_i, |dU_ij| < eps s_i}, where
(no label smoothing) dU_ij is the softmax term itself, and |d dx_ik| <= sum_{j in S_i} |dU_ij| |W_jk|,
|d dW_jk| <= sum_{i: j in S_i} |x_ik| |dU_ij|: computed here from the float64 dU. The test asserts that this bound
is well below the gradient's own norm (it could fail), that filtering skipped a sizeable share of the work, and
that the loss is unchanged (the forward is not filtered).

With the tail estimate (grad_filter_tail "estimate", the default) the dropped entries are replaced by E, whose row i
sums to the row's dropped total r_i and whose entries share r_i's sign, so ||E||_F <= sqrt(sum_i r_i^2) <= R =
sqrt(sum_i (sum_{j in S_i} |dU_ij|)^2), and the change to dx and dW is bounded by R ||W||_2 and R ||X||_2 on top of
the bound above. On this peaked data the estimate also brings dx closer to the exact one than dropping does (the
point of it; 8x closer on the example's trained head, README).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedhead  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from conftest import GRAD_RTOL_F64, normwise  # noqa: E402

N, H, V = 64, 32, 4096
EPS = 1e-3


def peaked(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g) * 2.0
    w = torch.randn(V, H, generator=g) * 2.0  # logits of typical size 10: a peaked softmax
    y = torch.randint(0, V, (N,), generator=g)
    return x, w, y


def test_context_setting():
    with fusedhead.Context(grad_filter_eps=2.0 ** -12) as ctx:
        assert ctx.grad_filter_eps == 2.0 ** -12
        ctx.grad_filter_eps = 0.0
        assert ctx.grad_filter_eps == 0.0
        for bad in (-1e-9, 1.0, float("nan")):
            with pytest.raises(fusedhead.errors.InvalidParamValueError, match="grad_filter_eps"):
                ctx.grad_filter_eps = bad
        assert ctx.grad_filter_eps == 0.0
        assert ctx.filter_stats() == (0.0, 0.0)


def test_tail_setting():
    with fusedhead.Context(grad_filter_tail="drop") as ctx:
        assert ctx.grad_filter_tail == "drop"
        ctx.grad_filter_tail = "estimate"
        assert ctx.grad_filter_tail == "estimate"
        with pytest.raises(ValueError, match="grad_filter_tail"):
            ctx.grad_filter_tail = "keep"
        assert ctx.grad_filter_tail == "estimate"
    with fusedhead.Context() as ctx:
        assert ctx.grad_filter_tail == "estimate"


def test_settings_are_parameters():
    """Both are fh_params: eps real-valued (fh_context_set_real), the tail an integer, each with its bounds."""
    assert fusedhead.Context.bounds("grad_filter_eps") == (0.0, math.nextafter(1.0, 0.0))
    assert fusedhead.Context.bounds(fusedhead.Param.GRAD_FILTER_TAIL) == (0, 1)
    with fusedhead.Context() as ctx:
        ctx.set("grad_filter_eps", 2.0 ** -12)
        ctx.set("grad_filter_tail", 1)
        assert ctx.get("grad_filter_eps") == ctx.grad_filter_eps == 2.0 ** -12
        assert ctx.get("grad_filter_tail") == 1 and ctx.grad_filter_tail == "drop"
        with pytest.raises(fusedhead.errors.InvalidParamValueError, match="grad_filter_tail"):
            ctx.set("grad_filter_tail", 2)
        assert ctx.grad_filter_tail == "drop"


def test_default_context_setting():
    fusedhead.set_default_context_settings(grad_filter_eps=EPS)
    try:
        assert fusedhead.default_context().grad_filter_eps == EPS
    finally:
        fusedhead.set_default_context_settings(grad_filter_eps=None)
    assert fusedhead.default_context().grad_filter_eps == 0.0


def filtered_gradients(x, w, y, tile_rows, tail):
    ctx = fusedhead.Context(threads=1, tile_rows=tile_rows, grad_filter_eps=EPS, grad_filter_tail=tail)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fht.fused_linear_cross_entropy(xf, wf, y, context=ctx)
    loss.backward()
    return loss, xf.grad, wf.grad, ctx.filter_stats()


@pytest.mark.parametrize("tail", ["drop", "estimate"])
@pytest.mark.parametrize("tile_rows", [4, 0], ids=["row-blocks-of-4", "one-row-block"])
def test_filtered_gradients_within_the_derived_bound(tile_rows, tail):
    x, w, y = peaked(3)
    # The binding runs the single-call train step; a vocabulary column is skipped when no row of its row block
    # reaches eps there: 99.6% of the work in row blocks of 4 rows, 94% in the default one block of 64 rows.
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xd @ wd.T, y)
    ref.backward()
    loss, dx, dw, (gradient_flops, skipped) = filtered_gradients(x, w, y, tile_rows, tail)
    assert gradient_flops == 4.0 * N * H * V
    assert skipped / gradient_flops > 0.5, skipped / gradient_flops
    assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
    with torch.no_grad():
        du = (torch.softmax(xd @ wd.T, dim=1) - torch.nn.functional.one_hot(y, V).double()) / N
        droppable = (du.abs() < EPS / N) & (torch.nn.functional.one_hot(y, V) == 0)
        dropped = (du.abs() * droppable).numpy()
    bound_dx = np.linalg.norm(dropped @ np.abs(w.double().numpy()))
    bound_dw = np.linalg.norm(dropped.T @ np.abs(x.double().numpy()))
    if tail == "estimate":
        r = np.linalg.norm(dropped.sum(axis=1))
        bound_dx += r * np.linalg.norm(w.double().numpy(), 2)
        bound_dw += r * np.linalg.norm(x.double().numpy(), 2)
    for got, want, bound in ((dx, xd.grad, bound_dx), (dw, wd.grad, bound_dw)):
        want = want.numpy()
        norm = np.linalg.norm(want)
        assert bound < 0.1 * norm, (bound, norm)
        assert normwise(got.numpy(), want) * norm <= GRAD_RTOL_F64 * norm + bound
    if tail == "estimate":
        _, dx_dropped, _, _ = filtered_gradients(x, w, y, tile_rows, "drop")
        want = xd.grad.numpy()
        assert normwise(dx.numpy(), want) < normwise(dx_dropped.numpy(), want)
