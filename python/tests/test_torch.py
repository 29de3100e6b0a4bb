"""fusedhead.torch against torch: F.cross_entropy(F.linear(hidden, weight, bias), targets, ...) in float32 and
float64 (tolerances justified in conftest.py; gradcheck does not apply to an fp32 library, see there)."""
from __future__ import annotations

import threading
import zlib

import pytest

torch = pytest.importorskip("torch")

import fusedhead  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from fusedhead.torch import _tensors as fh_tensors  # noqa: E402
from conftest import (ENTROPY_ATOL, GRAD_RTOL_F32, GRAD_RTOL_F64, LOSS_RTOL_F32, LOSS_RTOL_F64,  # noqa: E402
                      make_data, normwise)
from reference import reference_entropy_correct, reference_logits, reference_loss  # noqa: E402

torch.manual_seed(0)

CASES = {
    "plain": dict(),
    "ignore": dict(ignore_frac=0.3),
    "ignore_index_is_a_class": dict(ignore_frac=0.3, ignore_index=7),
    "class_weights": dict(class_weights=True),
    "class_weights_ignore": dict(class_weights=True, ignore_frac=0.25),
    "label_smoothing": dict(label_smoothing=0.1),
    "label_smoothing_class_weights": dict(label_smoothing=0.2, class_weights=True, ignore_frac=0.2),
    "softcap": dict(softcap=4.0, logit_scale=6.0),
    "z_loss": dict(z_loss=0.01),
    "z_loss_class_weights_ignore": dict(z_loss=0.02, class_weights=True, ignore_frac=0.3),
    "bias": dict(bias=True),
    "everything": dict(bias=True, class_weights=True, ignore_frac=0.2, label_smoothing=0.1, softcap=5.0,
                       z_loss=1e-3, logit_scale=5.0),
    # ce_logit_scale is the option logit_scale (logit_scale above is the data's typical logit size)
    "logit_scale": dict(ce_logit_scale=0.5, ignore_frac=0.2),
    "logit_scale_softcap": dict(ce_logit_scale=2.5, softcap=4.0),
    "dft": dict(token_scaling=True, ignore_frac=0.3),
    "dft_everything": dict(bias=True, class_weights=True, ignore_frac=0.2, label_smoothing=0.1, softcap=5.0,
                           z_loss=1e-3, logit_scale=5.0, ce_logit_scale=1.5, token_scaling=True),
}
DATA_KEYS = ("bias", "class_weights", "ignore_frac", "ignore_index", "logit_scale", "layout")


def split(case):
    data = {k: v for k, v in case.items() if k in DATA_KEYS}
    opts = {k: v for k, v in case.items() if k not in DATA_KEYS and k != "ignore_frac"}
    if "ignore_index" in case:
        opts["ignore_index"] = case["ignore_index"]
    if "ce_logit_scale" in opts:
        opts["logit_scale"] = opts.pop("ce_logit_scale")
    return data, opts


def leaves(arrays, dtype, requires=(True, True, True)):
    x, w, t, b, cw = arrays
    X = torch.tensor(x, dtype=dtype, requires_grad=requires[0])
    W = torch.tensor(w, dtype=dtype, requires_grad=requires[1])
    B = None if b is None else torch.tensor(b, dtype=dtype, requires_grad=requires[2])
    CW = None if cw is None else torch.tensor(cw, dtype=dtype)
    return X, W, torch.from_numpy(t), B, CW


def run(fn, arrays, dtype, opts, upstream=None, requires=(True, True, True), **kw):
    """Loss and the gradients of (upstream * loss) for the leaves that require grad."""
    X, W, T, B, CW = leaves(arrays, dtype, requires)
    loss = fn(X, W, T, B, class_weights=CW, **opts, **kw)
    g = upstream if upstream is not None else torch.ones_like(loss)
    loss.backward(g.to(loss.dtype))
    grads = [None if p is None or p.grad is None else p.grad.double().numpy() for p in (X, W, B)]
    return loss.detach().double().numpy(), grads


def compare(arrays, opts, upstream=None, requires=(True, True, True), context=None, layout="vh"):
    got, got_g = run(fht.fused_linear_cross_entropy, arrays, torch.float32, opts, upstream, requires,
                     context=context, layout=layout)
    for dtype, lt, gt in ((torch.float32, LOSS_RTOL_F32, GRAD_RTOL_F32), (torch.float64, LOSS_RTOL_F64, GRAD_RTOL_F64)):
        ref, ref_g = run(reference_loss, arrays, dtype, opts, upstream, requires, layout=layout)
        assert got.shape == ref.shape
        assert normwise(got, ref) <= lt, (dtype, got, ref)
        for name, a, r in zip(("dhidden", "dweight", "dbias"), got_g, ref_g):
            assert (a is None) == (r is None), name
            if a is not None:
                assert normwise(a, r) <= gt, (dtype, name, normwise(a, r))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch(case, reduction):
    data, opts = split(CASES[case])
    # A seed fixed by the case's name: hash() of a str changes with every process (PYTHONHASHSEED), so the data did,
    # and with it whether the fp32 loss met the 1e-6 bound against float64 (dft-none: 6 seeds in 1000 at 1.1e-6 to
    # 1.4e-6, with BLIS's and oneDNN's fp32 GEMMs alike).
    seed = zlib.crc32(case.encode()) % 1000
    arrays = make_data(seed=seed, **data)
    n = arrays[0].shape[0]
    # 'none': a random per-token upstream gradient; 'mean'/'sum': a non-unit scalar (backward scales)
    upstream = (torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
                if reduction == "none" else torch.tensor(1.7, dtype=torch.float64))
    compare(arrays, dict(opts, reduction=reduction), upstream)


@pytest.mark.parametrize("case", ["everything", "dft_everything"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("schedule", ["small_tiles", "streaming"])
def test_tiling_and_schedules(case, reduction, schedule, request):
    """Several vocabulary tiles and row blocks; and a budget too small for the train step's row blocks, so
    fh_ce_forward_backward streams (forward, then backward)."""
    data, opts = split(CASES[case])
    arrays = make_data(seed=3, n=70, v=517, **data)
    ctx = request.getfixturevalue(schedule)
    compare(arrays, dict(opts, reduction=reduction), None, context=ctx)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_layout_hv(reduction):
    arrays = make_data(seed=5, bias=True, layout="hv", ignore_frac=0.2)
    compare(arrays, dict(reduction=reduction, label_smoothing=0.05), layout="hv")


def test_hidden_3d():
    B, T, H, V = 3, 11, 16, 200
    x, w, t, b, cw = make_data(seed=11, n=B * T, h=H, v=V, ignore_frac=0.2)
    x3, t3 = x.reshape(B, T, H), t.reshape(B, T)
    for reduction in ("mean", "none"):
        X = torch.tensor(x3, requires_grad=True)
        W = torch.tensor(w, requires_grad=True)
        loss = fht.fused_linear_cross_entropy(X, W, torch.from_numpy(t3), reduction=reduction)
        assert loss.shape == ((B, T) if reduction == "none" else ())
        loss.sum().backward()
        assert X.grad.shape == (B, T, H)
        X64 = torch.tensor(x3, dtype=torch.float64, requires_grad=True)
        W64 = torch.tensor(w, dtype=torch.float64, requires_grad=True)
        ref = reference_loss(X64, W64, torch.from_numpy(t3), reduction=reduction)
        ref.sum().backward()
        assert normwise(loss.detach().numpy(), ref.detach().numpy()) <= LOSS_RTOL_F64
        assert normwise(X.grad.numpy(), X64.grad.numpy()) <= GRAD_RTOL_F64
        assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRAD_RTOL_F64
    # flat targets [N] are accepted for [B, T, H] hidden
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x3), torch.from_numpy(w), torch.from_numpy(t))
    assert loss.shape == ()


def test_unbatched_hidden():
    x, w, t, _, _ = make_data(seed=12, n=1)
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x[0]), torch.from_numpy(w), torch.tensor(t[0]),
                                          reduction="none")
    ref = reference_loss(torch.from_numpy(x[0]).double(), torch.from_numpy(w).double(), torch.tensor(t[0]),
                         reduction="none")
    assert loss.shape == () and abs(loss.item() - ref.item()) <= LOSS_RTOL_F64 * abs(ref.item())


@pytest.mark.parametrize("requires", [(True, False, False), (False, True, True), (False, False, True),
                                      (True, True, False)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradients_only_where_required(requires, reduction, monkeypatch):
    """Frozen inputs get no gradient, and the library is not asked for it (NULL in fh_linear_grads)."""
    asked = []
    original = fh_tensors.TorchLinear.alloc_grads

    def spy(self, need_x, need_w, need_b):
        asked.append((need_x, need_w, need_b))
        return original(self, need_x, need_w, need_b)

    monkeypatch.setattr(fh_tensors.TorchLinear, "alloc_grads", spy)
    arrays = make_data(seed=21, bias=True, ignore_frac=0.1)
    upstream = torch.randn(arrays[0].shape[0], dtype=torch.float64) if reduction == "none" else None
    compare(arrays, dict(reduction=reduction, z_loss=1e-3), upstream, requires)
    assert asked == [requires]


def test_weight_frozen_no_dweight_buffer():
    x, w, t, _, _ = make_data(seed=22)
    X = torch.tensor(x, requires_grad=True)
    W = torch.tensor(w)  # frozen
    fht.fused_linear_cross_entropy(X, W, torch.from_numpy(t)).backward()
    assert W.grad is None and X.grad is not None


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_accumulation(reduction):
    """Two micro-batches: weight.grad accumulates across the two backward calls, as with any torch loss."""
    a1, a2 = make_data(seed=31, bias=True), make_data(seed=32, bias=True)
    W = torch.tensor(a1[1], requires_grad=True)
    B = torch.tensor(a1[3], requires_grad=True)
    W64 = torch.tensor(a1[1], dtype=torch.float64, requires_grad=True)
    B64 = torch.tensor(a1[3], dtype=torch.float64, requires_grad=True)
    for x, _, t, _, _ in (a1, a2):
        fht.fused_linear_cross_entropy(torch.from_numpy(x), W, torch.from_numpy(t), B, reduction=reduction).sum().backward()
        reference_loss(torch.from_numpy(x).double(), W64, torch.from_numpy(t), B64, reduction=reduction).sum().backward()
    assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRAD_RTOL_F64
    assert normwise(B.grad.numpy(), B64.grad.numpy()) <= GRAD_RTOL_F64


def test_retain_graph_backward_twice():
    """The saved train-step gradients are not modified by backward: a second backward adds the same again."""
    x, w, t, _, _ = make_data(seed=33)
    W = torch.tensor(w, requires_grad=True)
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x), W, torch.from_numpy(t))
    (2.0 * loss).backward(retain_graph=True)
    first = W.grad.clone()
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.allclose(W.grad, 2.0 * first, rtol=1e-6, atol=0)
    # upstream 1 on the first backward: the saved gradient itself is handed to autograd
    W2 = torch.tensor(w, requires_grad=True)
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x), W2, torch.from_numpy(t))
    for _ in range(3):
        loss.backward(retain_graph=True)
    assert torch.allclose(W2.grad, 1.5 * first, rtol=1e-6, atol=0)


def test_upstream_gradient_of_one_returns_saved_gradients():
    x, w, t, _, _ = make_data(seed=34)
    W = torch.tensor(w, requires_grad=True)
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x), W, torch.from_numpy(t), reduction="sum")
    loss.backward()
    W64 = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    reference_loss(torch.from_numpy(x).double(), W64, torch.from_numpy(t), reduction="sum").backward()
    assert normwise(W.grad.numpy(), W64.grad.numpy()) <= GRAD_RTOL_F64


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    """The library's documented behaviour: loss 0 and zero gradients (torch gives NaN for 'mean')."""
    x, w, t, _, _ = make_data(seed=41)
    t[:] = -100
    X = torch.tensor(x, requires_grad=True)
    W = torch.tensor(w, requires_grad=True)
    loss = fht.fused_linear_cross_entropy(X, W, torch.from_numpy(t), reduction=reduction, z_loss=1e-3,
                                          label_smoothing=0.1)
    loss.sum().backward()
    assert torch.all(loss == 0)
    assert torch.all(X.grad == 0) and torch.all(W.grad == 0)
    if reduction == "mean":
        assert torch.isnan(reference_loss(X.detach(), W.detach(), torch.from_numpy(t)))


def test_all_targets_weight_zero_mean_is_zero():
    x, w, t, _, cw = make_data(seed=42, class_weights=True)
    cw[t] = 0.0
    W = torch.tensor(w, requires_grad=True)
    loss = fht.fused_linear_cross_entropy(torch.from_numpy(x), W, torch.from_numpy(t),
                                          class_weights=torch.from_numpy(cw))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(W.grad == 0)


def test_no_tokens():
    H, V = 8, 50
    X = torch.zeros(0, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    B = torch.randn(V, requires_grad=True)
    T = torch.zeros(0, dtype=torch.int64)
    loss = fht.fused_linear_cross_entropy(X, W, T, B)
    loss.backward()
    assert loss.item() == 0.0 and X.grad.shape == (0, H) and torch.all(W.grad == 0) and torch.all(B.grad == 0)
    none = fht.fused_linear_cross_entropy(X, W, T, B, reduction="none")
    assert none.shape == (0,)
    none.sum().backward()


def test_no_grad_and_frozen_inputs_forward_only():
    arrays = make_data(seed=43, bias=True, ignore_frac=0.2)
    opts = dict(label_smoothing=0.1, z_loss=1e-3)
    X, W, T, B, _ = leaves(arrays, torch.float32)
    with_grad = fht.fused_linear_cross_entropy(X, W, T, B, **opts)
    with torch.no_grad():
        no_grad = fht.fused_linear_cross_entropy(X, W, T, B, **opts)
    assert no_grad.grad_fn is None and not no_grad.requires_grad
    frozen = fht.fused_linear_cross_entropy(X.detach(), W.detach(), T, B.detach(), **opts)
    assert frozen.grad_fn is None
    # the train step (row blocks) and the streaming forward agree to fp32 rounding
    assert abs(no_grad.item() - with_grad.item()) <= 1e-6 * abs(with_grad.item())
    assert abs(frozen.item() - with_grad.item()) <= 1e-6 * abs(with_grad.item())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss(reduction):
    arrays = make_data(seed=51, ignore_frac=0.3, class_weights=True)
    X, W, T, _, CW = leaves(arrays, torch.float32)
    loss, z = fht.fused_linear_cross_entropy(X, W, T, class_weights=CW, z_loss=0.01, label_smoothing=0.1,
                                             reduction=reduction, return_z_loss=True)
    assert not z.requires_grad and loss.requires_grad and z.shape == loss.shape
    X64, W64, _, _, CW64 = leaves(arrays, torch.float64)
    ref_loss, ref_z = reference_loss(X64, W64, T, class_weights=CW64, z_loss=0.01, label_smoothing=0.1,
                                     reduction=reduction, return_z_loss=True)
    assert normwise(z.numpy(), ref_z.detach().numpy()) <= LOSS_RTOL_F64
    assert normwise(loss.detach().numpy(), ref_loss.detach().numpy()) <= LOSS_RTOL_F64


# Options for the entropy and the correct count whose logits do not saturate the softcap (no near-ties of the argmax).
EXTRA_OUTPUT_CASES = {
    "plain": dict(),
    "logit_scale_softcap": dict(ce_logit_scale=2.5, softcap=30.0),
    "dft_everything": dict(bias=True, class_weights=True, ignore_frac=0.2, label_smoothing=0.1, softcap=30.0,
                           z_loss=1e-3, ce_logit_scale=1.5, token_scaling=True),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", list(EXTRA_OUTPUT_CASES))
def test_entropy_and_correct(case, reduction):
    """The entropy and correct-count outputs against float64 torch on the materialized logits, with the loss and its
    gradients as without them. Half the targets are set to the float64 argmax, so that the count is neither 0 nor
    all. Entropy: absolute 1e-5 per token (conftest ENTROPY_ATOL); the count exactly: the float64 top two logits of
    every row differ by more than 1e-5, ten times the fp32 logit error here (conftest), so no argmax can flip."""
    data, opts = split(EXTRA_OUTPUT_CASES[case])
    x, w, t, b, cw = make_data(seed=61, **data)
    X64, W64, _, B64, _ = leaves((x, w, t, b, cw), torch.float64)
    shape = dict(logit_scale=opts.get("logit_scale"), softcap=opts.get("softcap", 0.0))
    z = reference_logits(X64, W64, B64, **shape)
    top2 = z.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-5
    t[::2] = z.argmax(-1).numpy()[::2]
    t[t == -100] = -100
    X, W, T, B, CW = leaves((x, w, t, b, cw), torch.float32)
    out = fht.fused_linear_cross_entropy(X, W, T, B, class_weights=CW, reduction=reduction, return_entropy=True,
                                         return_correct=True, **opts)
    assert isinstance(out, fht.CrossEntropyOutput)
    assert out.entropy.dtype == torch.float32 and out.entropy.shape == T.shape and not out.entropy.requires_grad
    assert out.correct.dtype == torch.int64 and out.correct.shape == ()
    ref_entropy, ref_correct = reference_entropy_correct(X64, W64, T, B64, **shape)
    assert float((out.entropy.double() - ref_entropy).abs().max()) <= ENTROPY_ATOL
    assert 0 < ref_correct < len(t) and int(out.correct) == ref_correct
    # the loss and its gradients beside them, as ever (conftest's float64 tolerances)
    out.loss.sum().backward()
    X64, W64, _, B64, CW64 = leaves((x, w, t, b, cw), torch.float64)
    ref = reference_loss(X64, W64, T, B64, class_weights=CW64, reduction=reduction, **opts)
    ref.sum().backward()
    assert normwise(out.loss.detach().numpy(), ref.detach().numpy()) <= LOSS_RTOL_F64
    for got, want in ((X, X64), (W, W64)):
        assert normwise(got.grad.numpy(), want.grad.numpy()) <= GRAD_RTOL_F64
    # only one of them asked for: the other is None; under no_grad the same values
    with torch.no_grad():
        only = fht.fused_linear_cross_entropy(X, W, T, B, class_weights=CW, reduction=reduction, return_correct=True,
                                              **opts)
    assert only.entropy is None and int(only.correct) == ref_correct


def test_module():
    arrays = make_data(seed=61, bias=True, class_weights=True, ignore_frac=0.2)
    X, W, T, B, CW = leaves(arrays, torch.float32)
    module = fht.FusedLinearCrossEntropy(label_smoothing=0.1, class_weights=CW, z_loss=1e-3, softcap=8.0)
    assert "class_weights" in module.state_dict()
    assert "label_smoothing=0.1" in repr(module)
    loss = module(X, W, T, B)
    loss.backward()
    X64, W64, _, B64, CW64 = leaves(arrays, torch.float64)
    ref = reference_loss(X64, W64, T, B64, class_weights=CW64, label_smoothing=0.1, z_loss=1e-3, softcap=8.0)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= LOSS_RTOL_F64 * abs(ref.item())
    for a, r in ((X, X64), (W, W64), (B, B64)):
        assert normwise(a.grad.numpy(), r.grad.numpy()) <= GRAD_RTOL_F64
    # with an nn.Linear lm_head, and return_z_loss
    head = torch.nn.Linear(arrays[0].shape[1], arrays[1].shape[0])
    loss, z = fht.FusedLinearCrossEntropy(z_loss=1e-3, return_z_loss=True)(X, head.weight, T, head.bias)
    ref = reference_loss(X.detach(), head.weight.detach(), T, head.bias.detach(), z_loss=1e-3)
    assert abs(loss.item() - ref.item()) <= LOSS_RTOL_F32 * abs(ref.item())


def test_weight_classes_alias():
    arrays = make_data(seed=62, class_weights=True)
    X, W, T, _, CW = leaves(arrays, torch.float32, (False, False, False))
    a = fht.fused_linear_cross_entropy(X, W, T, weight_classes=CW)
    b = fht.fused_linear_cross_entropy(X, W, T, class_weights=CW)
    assert a.item() == b.item()
    with pytest.raises(ValueError, match="not both"):
        fht.fused_linear_cross_entropy(X, W, T, class_weights=CW, weight_classes=CW)


def test_strided_inputs_zero_copy_and_copies():
    """Row-padded hidden and a transposed weight view go to the library as they are; a hidden whose rows are
    not unit-stride, and a transposed [T, B, H] batch, are copied. All give torch's gradients."""
    x, w, t, _, _ = make_data(seed=71, h=20)
    X64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    W64 = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    reference_loss(X64, W64, torch.from_numpy(t)).backward()

    wide = torch.zeros(x.shape[0], 32)
    wide[:, :20] = torch.from_numpy(x)
    wide.requires_grad_()
    Xp = wide[:, :20]  # row stride 32
    W_hv = torch.tensor(w.T.copy(), requires_grad=True)  # [H, V] storage
    Wv = W_hv.t()  # a [V, H] view with strides (1, V)
    lin = fh_tensors.TorchLinear(Xp, Wv, None, "vh")
    assert lin.x.data_ptr() == Xp.data_ptr() and lin.weight.data_ptr() == Wv.data_ptr()
    fht.fused_linear_cross_entropy(Xp, Wv, torch.from_numpy(t)).backward()
    assert normwise(wide.grad[:, :20].numpy(), X64.grad.numpy()) <= GRAD_RTOL_F64
    assert torch.all(wide.grad[:, 20:] == 0)
    assert normwise(W_hv.grad.t().numpy(), W64.grad.numpy()) <= GRAD_RTOL_F64

    big = torch.zeros(x.shape[0], 40)
    big[:, ::2] = torch.from_numpy(x)
    big.requires_grad_()
    Xs = big[:, ::2]  # column stride 2: copied
    assert fh_tensors.TorchLinear(Xs, Wv, None, "vh").x.data_ptr() != Xs.data_ptr()
    fht.fused_linear_cross_entropy(Xs, Wv.detach(), torch.from_numpy(t)).backward()
    assert normwise(big.grad[:, ::2].numpy(), X64.grad.numpy()) <= GRAD_RTOL_F64

    # [T, B, H] storage seen as [B, T, H]: the reshape to [N, H] copies; targets are non-contiguous too
    x3 = torch.from_numpy(x[:36].reshape(4, 9, 20).transpose(1, 0, 2).copy()).transpose(0, 1).requires_grad_()
    t3 = torch.from_numpy(t[:36].reshape(4, 9).T.copy()).T
    fht.fused_linear_cross_entropy(x3, Wv.detach(), t3, reduction="sum").backward()
    X3 = x3.detach().double().requires_grad_()
    reference_loss(X3, W64.detach(), t3, reduction="sum").backward()
    assert x3.grad.shape == (4, 9, 20)
    assert normwise(x3.grad.numpy(), X3.grad.numpy()) <= GRAD_RTOL_F64


def test_threads_use_separate_default_contexts():
    arrays = make_data(seed=81, v=400)
    X, W, T, _, _ = leaves(arrays, torch.float32, (False, False, False))
    expected = fht.fused_linear_cross_entropy(X, W, T).item()
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(fht.fused_linear_cross_entropy(X, W, T).item())
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and results == [expected] * 15


# ------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def ok():
    x, w, t, b, cw = make_data(seed=91, bias=True, class_weights=True)
    return torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(t), torch.from_numpy(b), torch.from_numpy(cw)


def test_error_float64_input(ok):
    X, W, T, B, _ = ok
    with pytest.raises(TypeError, match=r"hidden: expected dtype torch.float32, got torch.float64"):
        fht.fused_linear_cross_entropy(X.double(), W, T)
    with pytest.raises(TypeError, match=r"weight: expected dtype torch.float32, got torch.bfloat16"):
        fht.fused_linear_cross_entropy(X, W.bfloat16(), T)
    with pytest.raises(TypeError, match="bias"):
        fht.fused_linear_cross_entropy(X, W, T, B.double())


def test_error_target_dtype(ok):
    X, W, T, _, _ = ok
    with pytest.raises(TypeError, match=r"targets: expected dtype torch.int64, got torch.int32"):
        fht.fused_linear_cross_entropy(X, W, T.int())


def test_error_shapes(ok):
    X, W, T, B, CW = ok
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, H\]"):
        fht.fused_linear_cross_entropy(X, W[:, :-1], T)
    with pytest.raises(ValueError, match=r"weight: expected shape \[H, V\]"):
        fht.fused_linear_cross_entropy(X, W, T, layout="hv")
    with pytest.raises(ValueError, match="targets: expected shape"):
        fht.fused_linear_cross_entropy(X, W, T[:-1])
    with pytest.raises(ValueError, match="bias: expected shape"):
        fht.fused_linear_cross_entropy(X, W, T, B[:-1])
    with pytest.raises(ValueError, match="class_weights: expected"):
        fht.fused_linear_cross_entropy(X, W, T, class_weights=CW[:-1])
    with pytest.raises(ValueError, match="reduction must be"):
        fht.fused_linear_cross_entropy(X, W, T, reduction="avg")
    with pytest.raises(ValueError, match="layout must be"):
        fht.fused_linear_cross_entropy(X, W, T, layout="kv")


def test_error_target_out_of_range_has_library_message(ok):
    X, W, T, _, _ = ok
    T = T.clone()
    T[3] = 1000
    Wp = W.clone().requires_grad_()
    with pytest.raises(fusedhead.TargetOutOfRangeError) as info:
        fht.fused_linear_cross_entropy(X, Wp, T)
    e = info.value
    assert e.status == 5 and e.status_name == "FH_ERR_TARGET_OUT_OF_RANGE"
    assert "targets[3] = 1000 is outside [0, 300)" in e.message and e.message in str(e)
    assert e.status_string == fusedhead.status_string(5)
    assert isinstance(e, ValueError) and isinstance(e, fusedhead.FusedheadError)
    T[3] = -5  # negative, not ignore_index
    with pytest.raises(fusedhead.TargetOutOfRangeError):
        fht.fused_linear_cross_entropy(X, W, T, reduction="none")


def test_error_options_from_library(ok):
    X, W, T, _, CW = ok
    with pytest.raises(fusedhead.errors.InvalidLabelSmoothingError, match="label_smoothing = 1.5"):
        fht.fused_linear_cross_entropy(X, W, T, label_smoothing=1.5)
    with pytest.raises(fusedhead.errors.InvalidSoftcapError):
        fht.fused_linear_cross_entropy(X, W, T, softcap=-1.0)
    with pytest.raises(fusedhead.errors.InvalidZLossError):
        fht.fused_linear_cross_entropy(X, W, T, z_loss=float("nan"))
    for scale, softcap in ((0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1e39, 0.0), (1e-3, 1e38)):
        with pytest.raises(fusedhead.errors.InvalidLogitScaleError, match="logit_scale"):
            fht.fused_linear_cross_entropy(X, W, T, logit_scale=scale, softcap=softcap)
    bad = CW.clone()
    bad[4] = -1.0
    with pytest.raises(fusedhead.errors.InvalidClassWeightError, match=r"class_weights\[4\]"):
        fht.fused_linear_cross_entropy(X, W, T, class_weights=bad)


def test_error_class_weights_requiring_grad(ok):
    X, W, T, _, CW = ok
    with pytest.raises(ValueError, match="class weights are not supported"):
        fht.fused_linear_cross_entropy(X, W.requires_grad_(), T, class_weights=CW.clone().requires_grad_())


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_nan_upstream_gradient_propagates_as_in_torch(ok, reduction):
    """A NaN upstream gradient propagates for every reduction, as in torch: with 'none', token 2's dx row and every
    dweight element are NaN, the other dx rows as with that token's upstream value 0 (the library itself refuses
    non-finite grad_output; the binding substitutes and poisons)."""
    X, W, T, _, _ = ok
    grads = {}
    for name in ("fused", "torch"):
        x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
        loss = (fht.fused_linear_cross_entropy(x, w, T, reduction=reduction) if name == "fused"
                else torch.nn.functional.cross_entropy(x @ w.T, T, reduction=reduction))
        g = torch.ones_like(loss)
        g.view(-1)[2 if reduction == "none" else 0] = float("nan")
        loss.backward(g)
        grads[name] = (x.grad, w.grad)
    for ours, theirs in zip(grads["fused"], grads["torch"]):
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
        finite = ~torch.isnan(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], rtol=GRAD_RTOL_F32, atol=1e-6)
    if reduction == "none":
        assert torch.isnan(grads["fused"][0][2]).all() and not torch.isnan(grads["fused"][0][3]).any()


def test_error_not_a_tensor(ok):
    X, W, T, _, _ = ok
    with pytest.raises(TypeError, match="hidden: expected a torch.Tensor"):
        fht.fused_linear_cross_entropy(X.numpy(), W, T)
    with pytest.raises(TypeError, match="class_weights: expected a torch.Tensor"):
        fht.fused_linear_cross_entropy(X, W, T, class_weights=[1.0] * W.shape[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_error_cuda(ok):  # pragma: no cover
    X, W, T, _, _ = ok
    with pytest.raises(ValueError, match="runs on the CPU"):
        fht.fused_linear_cross_entropy(X.cuda(), W, T)


def test_error_meta_device(ok):
    """Any non-CPU device is refused with the same message (CUDA may be unavailable here)."""
    X, W, T, _, _ = ok
    with pytest.raises(ValueError, match="runs on the CPU; got a tensor on meta"):
        fht.fused_linear_cross_entropy(X.to("meta"), W, T)


@pytest.mark.parametrize("hidden, vocab", [(0, 10), (3, 0)])
def test_zero_sizes_raise_the_library_error(hidden, vocab):
    """A zero H or V is the library's InvalidSizeError with its message, in every front end (not an error about a
    reshape or strides from the array library)."""
    x, w, t = torch.randn(4, hidden), torch.randn(vocab, hidden), torch.zeros(4, dtype=torch.long)
    message = f"sizes must be >= 1: hidden = {hidden}, vocab = {vocab}"
    for call in (lambda: fht.fused_linear_cross_entropy(x, w, t), lambda: fht.fused_linear_logprobs(x, w, t),
                 lambda: fusedhead.numpy.cross_entropy(x.numpy(), w.numpy(), t.numpy())):
        with pytest.raises(fusedhead.errors.InvalidSizeError, match=message):
            call()


def test_zero_k_raises_the_library_error():
    x, w = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(fusedhead.errors.InvalidDistillOptionError, match="the teacher's k = 0 is outside"):
        fht.fused_linear_distillation_topk_loss(x, w, torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0))
