"""fusedhead.torch.causal_lm_loss against a float64 transcription of Hugging Face transformers' ForCausalLMLoss
(src/transformers/loss/loss_utils.py at 0114da07ec0e101b420a923dedeb6032b6ac3a44) on materialized logits, with
autograd through hidden, weight and bias.

Tolerances: conftest's float64 ones (loss 1e-6 relative, gradients 1e-5 normwise: fusedhead's fp32 GEMM rounding;
dividing by num_items_in_batch is exact scaling); bf16 inputs: test_bf16.py's (the loss, float32 here and never
rounded to bf16, 1e-5; bf16 gradients 8e-3 normwise, the rounding of dU and of the outputs to bf16).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fusedhead  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from fusedhead.torch import _tensors as fh_tensors  # noqa: E402
from conftest import GRAD_RTOL_F64, LOSS_RTOL_F64, normwise  # noqa: E402

B, T, H, V = 3, 13, 24, 257


def hf_for_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """ForCausalLMLoss and fixed_cross_entropy, line for line (logits already float64: .float() would narrow them)."""
    if shift_labels is None:
        # Shift so that tokens < n predict n
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def reference(hidden, weight, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
              final_logit_softcapping=None, logit_scale=None, bias=None):
    """The models' logits (lm_head, Cohere's logit_scale, Gemma 2's final softcapping), then the loss."""
    logits = F.linear(hidden, weight, bias)
    if logit_scale is not None:
        logits = logits * logit_scale
    if final_logit_softcapping is not None:
        logits = torch.tanh(logits / final_logit_softcapping) * final_logit_softcapping
    return hf_for_causal_lm_loss(logits, labels, weight.shape[0], num_items_in_batch, ignore_index, shift_labels)


def make_batch(seed, logit_size=3.0):
    """hidden [B, T, H] (logits of typical size logit_size), weight [V, H], bias [V], labels [B, T] with runs of
    -100: a masked prompt at the start of each sequence and padding at the end of the last two."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (logit_size / H ** 0.5)
    bias = torch.randn(V, generator=g) * 0.5
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :3] = -100
    labels[1, -4:] = -100
    labels[2, -2:] = -100
    return hidden, weight, bias, labels


CASES = {
    "labels": dict(),
    "labels_sum_over_items_int": dict(num_items_in_batch=61),
    "labels_sum_over_items_tensor": dict(num_items_in_batch=torch.tensor(29)),
    "shift_labels": dict(shift="given"),
    "shift_labels_items": dict(shift="given", num_items_in_batch=torch.tensor(40)),
    "softcap": dict(final_logit_softcapping=4.0, logit_size=8.0),
    "logit_scale": dict(logit_scale=0.25, logit_size=8.0),
    "logit_scale_softcap": dict(logit_scale=2.0, final_logit_softcapping=5.0),
    "bias": dict(bias=True),
    "everything": dict(bias=True, final_logit_softcapping=30.0, logit_scale=1.5, num_items_in_batch=45,
                       ignore_index=-1),
}


def arguments(case, hidden, weight, bias, labels):
    """The case's keyword arguments (ignore_index moved into the labels too; given shift_labels: the labels' own
    shift by hand, and other labels passed beside them, which both must ignore)."""
    kw = {k: v for k, v in case.items() if k not in ("shift", "bias", "logit_size")}
    ignore = kw.get("ignore_index", -100)
    labels = torch.where(labels == -100, torch.tensor(ignore), labels)
    if case.get("shift") == "given":
        kw["shift_labels"] = torch.cat([labels[:, 1:], torch.full((B, 1), ignore)], dim=1)
        labels = torch.zeros_like(labels)  # not read
    if case.get("bias"):
        kw["bias"] = bias
    return labels, kw


@pytest.mark.parametrize("name", list(CASES))
def test_matches_hugging_face(name, monkeypatch):
    case = CASES[name]
    hidden, weight, bias, labels = make_batch(seed=len(name), logit_size=case.get("logit_size", 3.0))
    labels, kw = arguments(case, hidden, weight, bias, labels)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    # hidden reaches the library as a view of the caller's tensor: the shift is on the labels only
    seen = []
    init = fh_tensors.TorchLinear.__init__

    def spy(self, *args):
        init(self, *args)
        seen.append(self.x.data_ptr())

    monkeypatch.setattr(fh_tensors.TorchLinear, "__init__", spy)
    loss = fht.causal_lm_loss(leaves[0], leaves[1], labels, **dict(kw, bias=leaves[2] if "bias" in kw else None))
    monkeypatch.undo()
    assert seen == [leaves[0].data_ptr()]
    ref = reference(leaves64[0], leaves64[1], labels, **dict(kw, bias=leaves64[2] if "bias" in kw else None))
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(loss.item() - ref.item()) <= LOSS_RTOL_F64 * abs(ref.item())
    loss.backward()
    ref.backward()
    for got, want in zip(leaves, leaves64):
        if want.grad is None:  # the bias when the case has none
            assert got.grad is None
            continue
        assert normwise(got.grad.numpy(), want.grad.numpy()) <= GRAD_RTOL_F64


def test_shift_labels_need_no_labels():
    hidden, weight, _, labels = make_batch(seed=2)
    shifted = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)
    a = fht.causal_lm_loss(hidden, weight, labels)
    b = fht.causal_lm_loss(hidden, weight, None, shift_labels=shifted)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="labels"):
        fht.causal_lm_loss(hidden, weight, None)


def test_all_ignored_mean_is_zero():
    """The one difference from Hugging Face (torch gives NaN for a mean over no token): 0, and zero gradients."""
    hidden, weight, _, labels = make_batch(seed=3)
    hidden.requires_grad_()
    loss = fht.causal_lm_loss(hidden, weight, torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and not bool(hidden.grad.any())


def test_bf16_inputs():
    """bf16 hidden and weight (the reference on their float64 values): the loss in float32 (Hugging Face upcasts the
    logits), gradients in bf16. Tolerances of test_bf16.py (module docstring there)."""
    if not fusedhead.bf16_available():
        pytest.skip(f"bf16 calls are refused here: {fusedhead.kernel_info().refusal}")
    from test_bf16 import DBIAS_RTOL_BF16, GRAD_RTOL_BF16, LOSS_RTOL_BF16
    hidden, weight, bias, labels = make_batch(seed=4)
    leaves = [hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16).requires_grad_(),
              bias.clone().requires_grad_()]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    kw = dict(num_items_in_batch=torch.tensor(30), final_logit_softcapping=30.0, logit_scale=1.5)
    loss = fht.causal_lm_loss(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
    ref = reference(leaves64[0], leaves64[1], labels, bias=leaves64[2], **kw)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= LOSS_RTOL_BF16 * abs(ref.item())
    loss.backward()
    ref.backward()
    assert leaves[0].grad.dtype == torch.bfloat16 and leaves[1].grad.dtype == torch.bfloat16
    for got, want, tol in zip(leaves, leaves64, (GRAD_RTOL_BF16, GRAD_RTOL_BF16, DBIAS_RTOL_BF16)):
        assert normwise(got.grad.double().numpy(), want.grad.numpy()) <= tol
