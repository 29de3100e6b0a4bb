"""fusedhead's top-k teacher distillation head through fusedhead.torch and fusedhead.numpy, against a float64
transcription of TRL's server-distillation loss (trl_distill_topk.py: ServerDistillationTrainer's forward KL on the
teacher's top-k at f2cd5771), the student's logits materialised and gradients by autograd.

Cases: ragged teacher rows (a varying number of trailing entries padded with -inf, a fully padded token), ignored
tokens, k = 1, 20, 256, with and without the tail, temperatures 1 and 0.7, the hard-label mix, every reduction.

Tolerances (the issue's acceptance bounds): LOSS_TOL = 1e-5 relative (max(1, |r|)) for the loss and its parts, and
per token: the library's logits are fp32 GEMMs of the same fp32 inputs (about sqrt(H) 6e-8 relative each) and its
log-sum-exps and sums are in double, so the loss is within ~1e-6 absolute (the C suite measures 6e-8 relative);
GRAD_TOL = 1e-4 normwise for dhidden, dweight, dbias: dU is formed in fp32 from fp32 log-sum-exps and exps, then two
fp32 GEMMs (the C suite measures 4.4e-7). bf16 inputs: against float64 on the same bf16 values, the loss within
LOSS_TOL (exact bf16 products accumulated in f32), gradients GRAD_TOL_BF16 = 8e-3 (dU rounded once to bf16 before
the gradient GEMMs, 2^-8, and the bf16 output's own rounding, 2^-8). Measured over test_numpy_against_trl's cases:
loss and per-token 4.0e-7, gradients 3.7e-7.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedhead  # noqa: E402
import fusedhead.numpy as fhnp  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
import trl_distill_topk as trl  # noqa: E402
from conftest import normwise  # noqa: E402

LOSS_TOL, GRAD_TOL, GRAD_TOL_BF16 = 1e-5, 1e-4, 8e-3
B, T, H, V = 3, 16, 32, 700
IGNORE = -100


def make_case(k: int, seed: int, pad: bool = True):
    """hidden [B, T, H], weight [V, H], bias [V], the teacher's [B, T, k] ids and log-probs (the k largest of a
    random log-softmax, in order; token (0, 3) fully padded, others with 0 .. k/3 trailing entries padded, ids 0
    there as TRL fills them), targets with the first 4 tokens of each sequence ignored (a prompt) and one more."""
    g = np.random.default_rng(seed)
    hidden = g.uniform(-1, 1, (B, T, H)).astype(np.float32)
    weight = (g.uniform(-1, 1, (V, H)) * 2.0 * np.sqrt(3.0 / H)).astype(np.float32)
    bias = g.uniform(-0.5, 0.5, V).astype(np.float32)
    logits = g.uniform(-3.5, 3.5, (B * T, V))
    lp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    order = np.argsort(-lp, axis=1)[:, :k]
    ids = order.astype(np.int64)
    logprobs = np.take_along_axis(lp, order, 1).astype(np.float32)
    if pad:
        for i in range(B * T):
            padded = k if i == 3 else int(g.integers(0, k // 3 + 1))
            if padded:
                logprobs[i, k - padded:] = -np.inf
                ids[i, k - padded:] = 0
    targets = g.integers(0, V, (B, T)).astype(np.int64)
    targets[:, :4] = IGNORE
    targets[1, 9] = IGNORE
    return hidden, weight, bias, ids.reshape(B, T, k), logprobs.reshape(B, T, k), targets


def reference(hidden, weight, bias, ids, logprobs, targets, grad_output=None, **options):
    """TRL's loss in float64 and its gradients (of grad_output * loss, per token for 'none')."""
    x = torch.tensor(hidden.reshape(-1, H), dtype=torch.float64, requires_grad=True)
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    tg = None if targets is None else torch.tensor(targets.reshape(-1))
    k = ids.shape[-1]
    loss, soft, hard, per_token = trl.distill_topk_loss(x, w, torch.tensor(ids.reshape(-1, k)),
                                                        torch.tensor(logprobs.reshape(-1, k)), tg, b, **options)
    if options.get("reduction") == "none":
        gout = torch.tensor(grad_output.reshape(-1), dtype=torch.float64)
        (loss * gout).sum().backward()
    else:
        (loss * (1.0 if grad_output is None else float(grad_output))).backward()
    grads = (x.grad.numpy().reshape(hidden.shape), w.grad.numpy(), None if b is None else b.grad.numpy())
    return loss.detach().numpy(), float(soft), float(hard), per_token.detach().numpy(), grads


def rel(f, r) -> float:
    return float(np.max(np.abs(np.asarray(f, np.float64) - r) / np.maximum(1.0, np.abs(r))))


CASES = [(k, tail, temperature, hard, reduction)
         for k in (1, 20, 256) for tail in (True, False)
         for temperature, hard, reduction in ((1.0, 0.0, "mean"), (0.7, 0.4, "sum"), (0.7, 0.0, "none"))]


@pytest.mark.parametrize("k,tail,temperature,hard,reduction", CASES)
def test_numpy_against_trl(k, tail, temperature, hard, reduction):
    hidden, weight, bias, ids, logprobs, targets = make_case(k, seed=k * 7 + tail)
    options = dict(add_tail=tail, temperature=temperature, weight_soft_loss=1.0 - hard, weight_hard_loss=hard,
                   reduction=reduction)
    g = np.random.default_rng(5).uniform(-1.5, 1.5, (B, T)).astype(np.float32) if reduction == "none" else 1.3
    r = fhnp.distill_topk_loss(hidden, weight, ids, logprobs, targets, bias, return_grads=True, grad_output=g,
                               **options)
    loss, soft, hard_part, per_token, (dx, dw, db) = reference(hidden, weight, bias, ids, logprobs, targets, g,
                                                               **options)
    assert rel(np.reshape(r.loss, -1), np.reshape(loss, -1)) <= LOSS_TOL
    assert rel(r.soft_loss, soft) <= LOSS_TOL and rel(r.hard_loss, hard_part) <= LOSS_TOL
    assert rel(r.per_token_loss.reshape(-1), per_token) <= LOSS_TOL
    assert normwise(r.dhidden, dx) <= GRAD_TOL
    assert normwise(r.dweight, dw) <= GRAD_TOL
    assert normwise(r.dbias, db) <= GRAD_TOL


@pytest.mark.parametrize("k,tail,reduction", [(1, True, "mean"), (20, False, "none"), (256, True, "sum")])
def test_torch_against_trl(k, tail, reduction):
    hidden, weight, bias, ids, logprobs, targets = make_case(k, seed=100 + k)
    x = torch.tensor(hidden, requires_grad=True)
    w = torch.tensor(weight, requires_grad=True)
    b = torch.tensor(bias, requires_grad=True)
    options = dict(add_tail=tail, temperature=0.7, weight_soft_loss=0.6, weight_hard_loss=0.4, reduction=reduction)
    loss = fht.fused_linear_distillation_topk_loss(x, w, torch.tensor(ids), torch.tensor(logprobs),
                                                   torch.tensor(targets), bias=b, **options)
    g = np.random.default_rng(9).uniform(-1.5, 1.5, (B, T)).astype(np.float32) if reduction == "none" else 0.8
    (loss * torch.tensor(g)).sum().backward()
    ref_loss, _, _, _, (dx, dw, db) = reference(hidden, weight, bias, ids, logprobs, targets, g, **options)
    assert rel(loss.detach().numpy().reshape(-1), np.asarray(ref_loss).reshape(-1)) <= LOSS_TOL
    assert normwise(x.grad.numpy(), dx) <= GRAD_TOL
    assert normwise(w.grad.numpy(), dw) <= GRAD_TOL
    assert normwise(b.grad.numpy(), db) <= GRAD_TOL


def test_bf16_against_trl():
    hidden, weight, bias, ids, logprobs, targets = make_case(20, seed=3)
    xb, wb = torch.tensor(hidden).bfloat16(), torch.tensor(weight).bfloat16()
    x, w = xb.clone().requires_grad_(True), wb.clone().requires_grad_(True)
    loss = fht.fused_linear_distillation_topk_loss(x, w, torch.tensor(ids), torch.tensor(logprobs),
                                                   torch.tensor(targets), temperature=0.7, weight_hard_loss=0.3)
    loss.backward()
    ref_loss, _, _, _, (dx, dw, _) = reference(xb.float().numpy(), wb.float().numpy(), None, ids, logprobs, targets,
                                               temperature=0.7, weight_hard_loss=0.3)
    assert abs(float(loss) - float(ref_loss)) <= 2 ** -8 * abs(float(ref_loss)) + LOSS_TOL  # the bf16 loss's rounding
    assert normwise(x.grad.float().numpy(), dx) <= GRAD_TOL_BF16
    assert normwise(w.grad.float().numpy(), dw) <= GRAD_TOL_BF16


def test_k1_without_tail_is_zero():
    """TRL's renormalised support of one entry: both sides log 1 = 0, so the loss and its gradient are 0 exactly."""
    hidden, weight, bias, ids, logprobs, targets = make_case(1, seed=1)
    r = fhnp.distill_topk_loss(hidden, weight, ids, logprobs, None, bias, add_tail=False, return_grads=True)
    assert r.loss == 0.0 and not np.any(r.dhidden) and not np.any(r.dweight) and not np.any(r.dbias)


def test_padded_token_counts_and_adds_zero():
    """A token with no valid entry contributes 0 and is counted in the mean (TRL's batchmean)."""
    hidden, weight, bias, ids, logprobs, targets = make_case(20, seed=2)
    r = fhnp.distill_topk_loss(hidden, weight, ids, logprobs, targets, bias, reduction="none")
    assert r.per_token_loss[0, 3] == 0.0
    mean = fhnp.distill_topk_loss(hidden, weight, ids, logprobs, targets, bias).loss
    assert abs(mean - r.per_token_loss.sum(dtype=np.float64) / np.count_nonzero(targets != IGNORE)) <= 1e-6 * mean


def test_refusals():
    hidden, weight, bias, ids, logprobs, targets = make_case(4, seed=4)
    bad = logprobs.copy()
    bad[1, 5, 2] = np.nan
    with pytest.raises(fusedhead.errors.InvalidDistillOptionError, match="logprobs"):
        fhnp.distill_topk_loss(hidden, weight, ids, bad, targets)
    bad_ids = ids.copy()
    bad_ids[2, 7, 0] = V
    with pytest.raises(fusedhead.errors.TargetOutOfRangeError, match="ids"):
        fhnp.distill_topk_loss(hidden, weight, bad_ids, logprobs, targets)
    with pytest.raises(ValueError, match="teacher_ids"):
        fhnp.distill_topk_loss(hidden, weight, ids[:, :5], logprobs, targets)
    with pytest.raises(TypeError, match="add_tail"):
        fhnp.distill_topk_loss(hidden, weight, ids, logprobs, targets, add_tail=2)
