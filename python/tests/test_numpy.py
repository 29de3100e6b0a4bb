"""fusedhead.numpy: the split and single-call APIs, outputs, zero-copy views and argument errors. The
reference is float64 torch when available (tolerances: conftest.py), else a float64 NumPy implementation."""
from __future__ import annotations

import numpy as np
import pytest

import fusedhead
import fusedhead.numpy as fhnp
from conftest import ENTROPY_ATOL, GRAD_RTOL_F64, LOSS_RTOL_F64, make_data, normwise


def np_reference(x, w, t, b=None, *, layout="vh", ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 class_weights=None, softcap=0.0, z_loss=0.0, logit_scale=None, token_scaling=False):
    """float64 NumPy: loss, per-token loss, logp, lse, argmax, entropy, correct count, and the gradients of the loss
    (upstream 1 / ones) with respect to x, w (in w's layout) and b. token_scaling (DFT): each token's loss and its
    gradient times p(target), a constant."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    W = w if layout == "vh" else w.T  # [V, H]
    m = 1.0 if logit_scale is None else logit_scale
    u = x @ W.T + (0 if b is None else b.astype(np.float64))
    z = softcap * np.tanh(m * u / softcap) if softcap else m * u
    top = z.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(z - top).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    n, v = z.shape
    keep = t != ignore_index
    ts = np.where(keep, t, 0)
    cw = np.ones(v) if class_weights is None else class_weights.astype(np.float64)
    wy = cw[ts] * keep
    logp = (z[np.arange(n), ts] - lse) * keep
    eps = label_smoothing
    ce = -(1 - eps) * wy * logp + eps / v * ((cw[None, :] * (lse[:, None] - z)).sum(axis=1)) * keep
    zl = z_loss * lse ** 2 * keep
    onehot = np.zeros_like(z)
    onehot[np.arange(n), ts] = 1
    dce = ((1 - eps) * wy[:, None] + eps / v * cw.sum() * keep[:, None]) * p - (1 - eps) * wy[:, None] * onehot \
        - eps / v * cw[None, :] * keep[:, None]
    dzl = 2 * z_loss * lse[:, None] * p * keep[:, None]
    if token_scaling:
        scale = np.exp(logp)
        ce, zl, dce, dzl = ce * scale, zl * scale, dce * scale[:, None], dzl * scale[:, None]
    if reduction == "mean":
        sw, cnt = wy.sum(), keep.sum()
        loss = ce.sum() / sw + zl.sum() / cnt
        dz = dce / sw + dzl / cnt
    else:
        loss = ce.sum() + zl.sum() if reduction == "sum" else ce + zl
        dz = dce + dzl
    dz = dz * (m * (1 - np.tanh(m * u / softcap) ** 2) if softcap else m)
    dx, dW, db = dz @ W, dz.T @ x, dz.sum(axis=0)
    entropy = -(p * (z - lse[:, None])).sum(axis=1) * keep
    return dict(loss=loss, per_token_loss=ce + zl, logp=logp, lse=lse, argmax=z.argmax(axis=1), dhidden=dx,
                dweight=dW if layout == "vh" else dW.T, dbias=db, entropy=entropy,
                correct=int(((z.argmax(axis=1) == t) & keep).sum()))


# ce_logit_scale: the option logit_scale (make_data's logit_scale is the data's typical logit size)
OPTION_SETS = [
    dict(),
    dict(ignore_frac=0.3, label_smoothing=0.1, class_weights=True),
    dict(bias=True, softcap=5.0, z_loss=1e-3, ignore_frac=0.2),
    dict(ce_logit_scale=0.5, ignore_frac=0.2, token_scaling=True),
    dict(bias=True, softcap=30.0, ce_logit_scale=2.0, z_loss=1e-3, label_smoothing=0.1, class_weights=True,
         ignore_frac=0.2, token_scaling=True),
]


def _data_and_opts(spec, seed, **extra):
    spec = dict(spec, **extra)
    data_keys = ("bias", "class_weights", "ignore_frac", "layout", "logit_scale")
    x, w, t, b, cw = make_data(seed=seed, **{k: spec[k] for k in data_keys if k in spec})
    opts = {k: v for k, v in spec.items() if k not in data_keys}
    if "ce_logit_scale" in opts:
        opts["logit_scale"] = opts.pop("ce_logit_scale")
    return x, w, t, b, dict(opts, class_weights=cw)


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("spec", range(len(OPTION_SETS)))
def test_cross_entropy_matches_float64(spec, reduction, layout):
    x, w, t, b, opts = _data_and_opts(OPTION_SETS[spec], seed=spec, layout=layout)
    ref = np_reference(x, w, t, b, layout=layout, reduction=reduction, **opts)
    r = fhnp.cross_entropy(x, w, t, b, layout=layout, reduction=reduction, return_grads=True, return_entropy=True,
                           **opts)
    # the entropy within conftest's ENTROPY_ATOL; the count exactly where the argmaxes agree (asserted below)
    assert np.abs(r.entropy - ref["entropy"]).max() <= ENTROPY_ATOL and r.entropy.shape == t.shape
    assert isinstance(r.correct, int) and r.correct == ref["correct"]
    if reduction == "none":
        assert isinstance(r.loss, np.ndarray) and r.loss.shape == t.shape
    else:
        assert isinstance(r.loss, float)
    assert normwise(r.loss, ref["loss"]) <= LOSS_RTOL_F64
    assert normwise(r.per_token_loss, ref["per_token_loss"]) <= LOSS_RTOL_F64
    assert normwise(r.lse, ref["lse"]) <= 1e-6
    assert normwise(r.per_token_logp, ref["logp"]) <= 1e-5
    assert np.array_equal(r.argmax, ref["argmax"])
    for name in ("dhidden", "dweight", "dbias"):
        got = getattr(r, name)
        if name == "dbias" and b is None:
            assert got is None
            continue
        assert got.shape == ref[name].shape
        assert normwise(got, ref[name]) <= GRAD_RTOL_F64, name
    # forward only: the same loss, no gradients; no entropy unless asked for
    f = fhnp.cross_entropy(x, w, t, b, layout=layout, reduction=reduction, **opts)
    assert f.dhidden is None and normwise(f.loss, ref["loss"]) <= LOSS_RTOL_F64
    assert f.entropy is None and f.correct == ref["correct"]


def test_cross_entropy_matches_torch():
    torch = pytest.importorskip("torch")
    from reference import reference_loss

    x, w, t, b, opts = _data_and_opts(OPTION_SETS[2], seed=7)
    r = fhnp.cross_entropy(x, w, t, b, return_grads=True, **opts)
    X = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    W = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    B = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    opts.pop("class_weights")
    loss = reference_loss(X, W, torch.from_numpy(t), B, **opts)
    loss.backward()
    assert abs(r.loss - loss.item()) <= LOSS_RTOL_F64 * abs(loss.item())
    for got, ref in ((r.dhidden, X), (r.dweight, W), (r.dbias, B)):
        assert normwise(got, ref.grad.numpy()) <= GRAD_RTOL_F64


@pytest.mark.parametrize("spec", [1, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_split_matches_single_call(spec, reduction, small_tiles):
    """Set 4 has DFT: the split backward recomputes the target logits for p_y."""
    x, w, t, b, opts = _data_and_opts(OPTION_SETS[spec], seed=3, bias=True)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(t.shape).astype(np.float32) if reduction == "none" else 0.7
    for ctx in (None, small_tiles):
        f = fhnp.forward(x, w, t, b, reduction=reduction, context=ctx, **opts)
        grads = fhnp.backward(x, w, t, b, lse=f.lse, grad_output=g, reduction=reduction, context=ctx, **opts)
        fb = fhnp.forward_backward(x, w, t, b, grad_output=g, reduction=reduction, context=ctx, **opts)
        assert normwise(f.loss, fb.loss) <= 1e-6
        assert np.array_equal(f.argmax, fb.argmax)
        for name in ("dhidden", "dweight", "dbias"):
            assert normwise(getattr(grads, name), getattr(fb, name)) <= 1e-5, name
        # gradients are linear in grad_output
        ones = fhnp.forward_backward(x, w, t, b, reduction=reduction, context=ctx, **opts)
        if reduction != "none":
            assert normwise(fb.dweight, 0.7 * ones.dweight) <= 1e-6


def test_wrt_and_accumulate():
    x, w, t, b, opts = _data_and_opts(dict(bias=True), seed=4)
    f = fhnp.forward(x, w, t, b)
    only_w = fhnp.backward(x, w, t, b, lse=f.lse, wrt=["weight"])
    assert only_w.dhidden is None and only_w.dbias is None and only_w.dweight.shape == w.shape
    full = fhnp.backward(x, w, t, b, lse=f.lse)
    dx = np.full_like(x, np.nan)  # beta 0 overwrites even NaN
    dw = np.zeros_like(w)
    db = np.zeros_like(b)
    out = fhnp.backward(x, w, t, b, lse=f.lse, dhidden=dx, dweight=dw, dbias=db)
    assert out.dhidden is dx and out.dweight is dw and np.all(np.isfinite(dx))
    fhnp.backward(x, w, t, b, lse=f.lse, dhidden=dx, dweight=dw, dbias=db, accumulate=True)
    for got, ref in ((dx, full.dhidden), (dw, full.dweight), (db, full.dbias)):
        assert normwise(got, 2 * ref) <= 1e-6
    # the train step accumulates too (gradient accumulation over micro-batches)
    fhnp.forward_backward(x, w, t, b, dweight=dw, wrt=["weight"], accumulate=True)
    assert normwise(dw, 3 * full.dweight) <= 1e-6
    with pytest.raises(ValueError, match="accumulate=True needs the dweight array"):
        fhnp.forward_backward(x, w, t, b, wrt=["weight"], accumulate=True)
    with pytest.raises(ValueError, match="'bias' requested but bias is None"):
        fhnp.backward(x, w, t, lse=f.lse, wrt=["bias"])
    with pytest.raises(ValueError, match="unknown names"):
        fhnp.backward(x, w, t, lse=f.lse, wrt=["logits"])
    with pytest.raises(ValueError, match="given but 'weight' is not in wrt"):
        fhnp.backward(x, w, t, lse=f.lse, wrt=["hidden"], dweight=dw)


def test_zero_copy_strided_views():
    """A row-padded hidden (slice of a wider array), a Fortran-ordered weight and a transposed weight view go
    to the library as they are; dweight comes back with the weight's strides."""
    x, w, t, _, _ = make_data(seed=5, h=20)
    ref = np_reference(x, w, t)
    wide = np.zeros((x.shape[0], 33), np.float32)
    wide[:, 3:23] = x
    xp = wide[:, 3:23]
    wf = np.asfortranarray(w)
    r = fhnp.cross_entropy(xp, wf, t, return_grads=True)
    assert r.dweight.strides == wf.strides
    assert normwise(r.dweight, ref["dweight"]) <= GRAD_RTOL_F64
    assert normwise(r.dhidden, ref["dhidden"]) <= GRAD_RTOL_F64
    # a weight slice with gaps between rows
    wbig = np.zeros((w.shape[0], 25), np.float32)
    wbig[:, :20] = w
    ws = wbig[:, :20]
    r2 = fhnp.cross_entropy(x, ws, t, return_grads=True)
    assert r2.dweight.strides == ws.strides and normwise(r2.dweight, ref["dweight"]) <= GRAD_RTOL_F64
    # dhidden into a row-padded array of the caller's
    dwide = np.zeros((x.shape[0], 40), np.float32)
    g = fhnp.backward(x, w, t, lse=r.lse, dhidden=dwide[:, 5:25], wrt=["hidden"])
    assert normwise(dwide[:, 5:25], ref["dhidden"]) <= GRAD_RTOL_F64 and np.all(dwide[:, :5] == 0)
    assert g.dhidden.base is not None


def test_hidden_3d_and_flat_targets():
    x, w, t, _, _ = make_data(seed=6, n=24, ignore_frac=0.2)
    ref = np_reference(x, w, t, reduction="none")
    r = fhnp.cross_entropy(x.reshape(4, 6, -1), w, t.reshape(4, 6), reduction="none", return_grads=True)
    assert r.loss.shape == (4, 6) and r.lse.shape == (4, 6) and r.dhidden.shape == (4, 6, x.shape[1])
    assert normwise(r.loss.ravel(), ref["loss"]) <= LOSS_RTOL_F64
    r2 = fhnp.cross_entropy(x.reshape(4, 6, -1), w, t)  # flat targets [N]
    assert normwise(r2.loss, np_reference(x, w, t)["loss"]) <= LOSS_RTOL_F64


def test_all_ignored_and_empty():
    x, w, t, b, _ = make_data(seed=8, bias=True)
    t[:] = -100
    r = fhnp.cross_entropy(x, w, t, b, return_grads=True, z_loss=1e-3)
    assert r.loss == 0.0 and r.z_loss == 0.0
    assert not r.dhidden.any() and not r.dweight.any() and not r.dbias.any()
    assert not r.per_token_loss.any() and not r.per_token_logp.any()
    e = fhnp.cross_entropy(x[:0], w, t[:0], b, return_grads=True)
    assert e.loss == 0.0 and e.dhidden.shape == (0, x.shape[1]) and not e.dweight.any() and not e.dbias.any()
    with pytest.raises(ValueError, match="weight"):
        fhnp.cross_entropy(x[:0], w[:, :-1], t[:0])


def test_workspace_size_and_caller_workspace():
    x, w, t, _, _ = make_data(seed=9)
    ctx = fusedhead.Context(threads=1)
    need = fhnp.workspace_size(x, w, t, context=ctx)
    need_train = fhnp.workspace_size(x, w, t, context=ctx, train_step=True)
    assert need > 0 and need_train > 0
    ctx.set_workspace(np.empty(need - 1, np.uint8))
    with pytest.raises(fusedhead.errors.WorkspaceTooSmallError) as info:
        fhnp.forward(x, w, t, context=ctx)
    assert info.value.status == 20 and "workspace" in info.value.message
    assert isinstance(info.value, MemoryError)
    ctx.set_workspace(bytearray(max(need, need_train)))
    fhnp.forward(x, w, t, context=ctx)
    fhnp.forward_backward(x, w, t, context=ctx)
    ctx.set_workspace(None)
    fhnp.forward(x, w, t, context=ctx)


# ------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def data():
    x, w, t, b, cw = make_data(seed=10, bias=True, class_weights=True)
    return x, w, t, b, cw


def test_error_dtypes(data):
    x, w, t, b, _ = data
    with pytest.raises(TypeError, match=r"hidden: expected dtype float32 in native byte order, got <f8"):
        fhnp.cross_entropy(x.astype(np.float64), w, t)
    with pytest.raises(TypeError, match=r"weight: expected dtype float32.*float16"):
        fhnp.cross_entropy(x, w.astype(np.float16), t)
    with pytest.raises(TypeError, match=r"targets: expected dtype int64.*int32"):
        fhnp.cross_entropy(x, w, t.astype(np.int32))
    with pytest.raises(TypeError, match="byte order"):
        fhnp.cross_entropy(x.astype(">f4"), w, t)
    with pytest.raises(TypeError, match="hidden: expected a numpy.ndarray"):
        fhnp.cross_entropy(x.tolist(), w, t)
    with pytest.raises(TypeError, match="bias"):
        fhnp.cross_entropy(x, w, t, b.astype(np.float64))


def test_error_shapes_and_layouts(data):
    x, w, t, b, cw = data
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, H\] = \[\*, 24\].*got \[300, 23\]"):
        fhnp.cross_entropy(x, w[:, :23], t)
    with pytest.raises(ValueError, match=r"weight: expected shape \[H, V\]"):
        fhnp.cross_entropy(x, w, t, layout="hv")
    with pytest.raises(ValueError, match=r"targets: expected shape \[37\]"):
        fhnp.cross_entropy(x, w, t[:-1])
    with pytest.raises(ValueError, match=r"bias: expected shape \[V\] = \[300\]"):
        fhnp.cross_entropy(x, w, t, b[:-1])
    with pytest.raises(ValueError, match="class_weights"):
        fhnp.cross_entropy(x, w, t, class_weights=cw[:10])
    with pytest.raises(ValueError, match="reduction must be"):
        fhnp.cross_entropy(x, w, t, reduction="average")
    with pytest.raises(ValueError, match="grad_output: expected a scalar"):
        fhnp.cross_entropy(x, w, t, return_grads=True, grad_output=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="grad_output"):
        fhnp.cross_entropy(x, w, t, reduction="none", return_grads=True, grad_output=np.ones(3, np.float32))


def test_error_contiguity(data):
    x, w, t, _, _ = data
    with pytest.raises(ValueError, match=r"hidden: expected rows with unit element stride"):
        fhnp.cross_entropy(np.asfortranarray(x), w, t)
    with pytest.raises(ValueError, match="targets: expected a C-contiguous"):
        fhnp.cross_entropy(x[:19], w, np.stack([t, t], axis=1)[:19, 0])  # targets with stride 2
    with pytest.raises(ValueError, match="weight: expected positive"):
        fhnp.cross_entropy(x, w[::-1], t)
    x3 = np.zeros((5, 4, x.shape[1]), np.float32).transpose(1, 0, 2)
    with pytest.raises(ValueError, match="cannot be flattened"):
        fhnp.cross_entropy(x3, w, np.zeros((4, 5), np.int64))
    f = fhnp.forward(x, w, t)
    with pytest.raises(ValueError, match="dweight: expected the weight's shape"):
        fhnp.backward(x, w, t, lse=f.lse, dweight=np.asfortranarray(np.zeros_like(w)))
    with pytest.raises(fusedhead.errors.OverlappingBuffersError, match="overlaps an input"):
        fhnp.backward(x, w, t, lse=f.lse, dhidden=x)


def test_error_target_out_of_range(data):
    x, w, t, b, _ = data
    t = t.copy()
    t[3] = 1000
    dw = np.ones_like(w)
    f = fhnp.forward(x, w, np.where(t == 1000, 0, t))
    with pytest.raises(fusedhead.TargetOutOfRangeError) as info:
        fhnp.backward(x, w, t, lse=f.lse, dweight=dw, accumulate=True)
    assert info.value.status == 5
    assert "targets[3] = 1000 is outside [0, 300) and is not ignore_index (-100)" in str(info.value)
    assert np.all(dw == 1)  # on error no output is modified
    with pytest.raises(fusedhead.TargetOutOfRangeError):
        fhnp.cross_entropy(x, w, t, ignore_index=1000 - 1)


def test_error_options(data):
    x, w, t, _, cw = data
    with pytest.raises(fusedhead.errors.InvalidLabelSmoothingError) as info:
        fhnp.cross_entropy(x, w, t, label_smoothing=1.5)
    assert info.value.status == 11 and "1.5" in info.value.message
    bad = cw.copy()
    bad[7] = np.inf
    with pytest.raises(fusedhead.errors.InvalidClassWeightError, match=r"class_weights\[7\]"):
        fhnp.cross_entropy(x, w, t, class_weights=bad)
    with pytest.raises(fusedhead.errors.InvalidZLossError):
        fhnp.cross_entropy(x, w, t, z_loss=-1.0)
    with pytest.raises(fusedhead.errors.InvalidLogitScaleError) as info:
        fhnp.cross_entropy(x, w, t, logit_scale=0.0)
    assert info.value.status == 53 and "logit_scale = 0" in info.value.message
    with pytest.raises(fusedhead.errors.InvalidLogitScaleError, match="softcap / logit_scale"):
        fhnp.cross_entropy(x, w, t, softcap=1e-37, logit_scale=1e3)
    with pytest.raises(TypeError, match="logit_scale"):
        fhnp.cross_entropy(x, w, t, logit_scale="large")
    with pytest.raises(fusedhead.errors.InvalidGradOutputError):
        fhnp.cross_entropy(x, w, t, return_grads=True, grad_output=float("inf"))
