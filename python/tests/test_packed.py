"""Packed sequences (cu_seqlens) through fusedhead.torch and fusedhead.numpy: GRPO, the preference heads and KTO over
packed rows against the same calls over the [B, T] rows of the same sequences, padded (which test_grpo.py,
test_preference.py and test_kto.py hold to float64 transcriptions of TRL).

Every call runs on a batch-invariant context: the library then fixes its tiles independently of N
(docs/correctness.md, "Batch invariance"), so a packed row's log-prob and dhidden row are the padded row's bit for
bit, and the loss, metrics and per-sequence outputs the same numbers (each the same sum of the same terms in the same
order: the padding adds exact zeros). dweight sums the same terms over other row blocks: normwise 1e-6 (fp32
summation order over a few dozen rows; 5e-8 seen). ORPO's and CPO's logits means are TRL's over every padded position,
padding included, and are not compared. The C suite `packed` covers every loss type, bf16 and the default contexts.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedhead  # noqa: E402
import fusedhead.errors  # noqa: E402
import fusedhead.numpy as fhnp  # noqa: E402
import fusedhead.torch as fht  # noqa: E402
from fusedhead.torch import _ops  # noqa: E402
from conftest import normwise  # noqa: E402

H, V, T = 16, 61, 9
DWEIGHT_TOL = 1e-6


def _batch(sequences: int, seed: int):
    """Padded [S, T] inputs (hidden random in the padding, ids -100 and mask 0 there, a masked token inside some
    sequences) and the packed rows of the same sequences: lengths 1 .. T, the first T."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[T], rng.integers(1, T + 1, sequences - 1)])
    d = dict(lengths=lengths, cu=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    d["hidden"] = rng.standard_normal((sequences, T, H)).astype(np.float32)
    d["weight"] = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    inside = np.arange(T)[None, :] < lengths[:, None]
    mask = inside.astype(np.float32)
    mask[lengths > 3, 1] = 0.0
    d["mask"] = mask
    d["ids"] = np.where(inside, rng.integers(0, V, (sequences, T)), -100).astype(np.int64)
    d["logps_a"] = rng.uniform(-3.0, -0.5, (sequences, T)).astype(np.float32)
    d["logps_b"] = rng.uniform(-3.0, -0.5, (sequences, T)).astype(np.float32)
    d["per_sequence"] = rng.uniform(-1.5, 1.5, sequences).astype(np.float32)
    d["labels"] = rng.integers(0, 2, sequences).astype(bool)
    d["rows"] = inside.reshape(-1)  # which padded rows the packed rows are, in order
    return d


def _packed(d, name):
    """The padded per-token array's packed rows."""
    a = d[name]
    return a.reshape(-1, *a.shape[2:])[d["rows"]]


def _context():
    return fusedhead.Context(batch_invariant=True)


def _torch_pair(d, call):
    """call(hidden, weight, packed, context) on the padded and the packed inputs: (result, hidden.grad,
    weight.grad) for each, the loss's backward run."""
    runs = []
    for packed in (False, True):
        h = torch.tensor(_packed(d, "hidden") if packed else d["hidden"], requires_grad=True)
        w = torch.tensor(d["weight"], requires_grad=True)
        out = call(h, w, packed, _context())
        out[0].backward()
        runs.append((out, h.grad.numpy(), w.grad.numpy()))
    return runs


def _check_rows(d, padded, packed, what):
    """The packed rows of a per-token array (or dhidden) are the padded one's rows, bit for bit."""
    padded = np.asarray(padded).reshape(len(d["rows"]), -1)[d["rows"]]
    np.testing.assert_array_equal(np.asarray(packed).reshape(padded.shape), padded, err_msg=what)


def _check_gradients(d, padded, packed):
    _check_rows(d, padded[1], packed[1], "dhidden")
    assert normwise(packed[2], padded[2]) <= DWEIGHT_TOL


def _token(d, name, packed):
    return torch.tensor(_packed(d, name) if packed else d[name])


@pytest.mark.parametrize("options", [
    dict(loss_type="dapo"),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    dict(loss_type="dr_grpo", max_completion_length=T + 2, vllm_importance_sampling_mode="sequence_truncate"),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.5, entropy_coef=0.01),
], ids=["dapo", "grpo-gspo-kl", "dr_grpo-is", "bnpo-mask-entropy"])
@pytest.mark.parametrize("leading_one", [False, True], ids=["NH", "1NH"])
def test_grpo_packed_equals_padded(options, leading_one):
    d = _batch(7, 1)

    def call(h, w, packed, context):
        if packed and leading_one:
            h = h.unsqueeze(0)
        shape = (1, -1) if packed and leading_one else (-1,) if packed else (len(d["lengths"]), T)
        tok = lambda name: _token(d, name, packed).reshape(shape)  # noqa: E731
        return fht.fused_linear_grpo_loss(
            h, w, tok("ids"), tok("mask"), torch.tensor(d["per_sequence"]), old_per_token_logps=tok("logps_a"),
            ref_per_token_logps=tok("logps_b"), sampling_per_token_logps=tok("logps_b"), return_per_token_logps=True,
            context=context, cu_seqlens=torch.tensor(d["cu"]) if packed else None, **options)

    padded, packed = _torch_pair(d, call)
    assert packed[0][0].item() == padded[0][0].item()
    assert packed[0][1] == padded[0][1]
    assert packed[0][2].shape == ((1, len(d["rows"].nonzero()[0])) if leading_one else (d["cu"][-1],))
    _check_rows(d, padded[0][2].numpy(), packed[0][2].numpy(), "per-token log-probs")
    _check_gradients(d, padded, packed)


def test_grpo_packed_over_a_support():
    """GRPO's log-probs over each token's support (padded [.., k] ids), packed: the padded call's."""
    d = _batch(6, 7)
    first = np.where(d["ids"] >= 0, d["ids"], 0)  # each token's id in its support, then 3 others, then padding
    support = np.stack([(first + 7 * j) % V for j in range(4)] + [np.full_like(first, -1)], axis=-1)

    def call(h, w, packed, context):
        ids = torch.tensor(_packed(d, "ids") if packed else d["ids"])
        s = torch.tensor(support.reshape(-1, 5)[d["rows"]] if packed else support)
        return fht.fused_linear_grpo_loss(
            h, w, ids, _token(d, "mask", packed), torch.tensor(d["per_sequence"]), loss_type="grpo",
            return_per_token_logps=True, support_ids=s, context=context,
            cu_seqlens=torch.tensor(d["cu"]) if packed else None)

    padded, packed = _torch_pair(d, call)
    assert packed[0][0].item() == padded[0][0].item() and packed[0][1] == padded[0][1]
    _check_rows(d, padded[0][2].numpy(), packed[0][2].numpy(), "per-token log-probs over the support")
    _check_gradients(d, padded, packed)


@pytest.mark.parametrize("loss", ["dpo", "orpo", "simpo"])
def test_preference_packed_equals_padded(loss):
    d = _batch(8, 2)
    d["mask"][:, 0] = 1.0  # orpo: every sequence has an unmasked token
    d["ids"][:, 0] = np.abs(d["ids"][:, 0])

    def call(h, w, packed, context):
        extra = dict(ref_per_token_logps=_token(d, "logps_a", packed)) if loss == "dpo" else {}
        return fht.fused_linear_preference_loss(
            h, w, _token(d, "ids", packed), _token(d, "mask", packed), loss=loss, context=context,
            cu_seqlens=torch.tensor(d["cu"]) if packed else None, **extra)

    padded, packed = _torch_pair(d, call)
    assert packed[0].loss.item() == padded[0].loss.item()
    padded_logits = {"logits/chosen", "logits/rejected"} if loss != "dpo" else set()
    assert {k: v for k, v in packed[0].metrics.items() if k not in padded_logits} == \
           {k: v for k, v in padded[0].metrics.items() if k not in padded_logits}
    assert torch.equal(packed[0].logps, padded[0].logps) and torch.equal(packed[0].rewards, padded[0].rewards)
    _check_gradients(d, padded, packed)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_packed_equals_padded(loss_type):
    d = _batch(7, 3)

    def call(h, w, packed, context):
        kl = dict(kl_logratios=torch.tensor(d["per_sequence"])) if loss_type == "kto" else {}
        return fht.fused_linear_kto_loss(
            h, w, _token(d, "ids", packed), _token(d, "mask", packed), torch.tensor(d["labels"]),
            ref_per_token_logps=_token(d, "logps_a", packed), loss_type=loss_type, context=context,
            cu_seqlens=torch.tensor(d["cu"]) if packed else None, **kl)

    padded, packed = _torch_pair(d, call)
    assert packed[0].loss.item() == padded[0].loss.item() and packed[0].metrics == padded[0].metrics
    assert torch.equal(packed[0].logps, padded[0].logps) and torch.equal(packed[0].rewards, padded[0].rewards)
    _check_gradients(d, padded, packed)


@pytest.mark.skipif(not _ops.TORCH_OPS, reason=f"torch {torch.__version__} has no torch.library.custom_op "
                    "(torch.compile support needs torch >= 2.4)")
def test_compiled_packed_grpo():
    """torch.compile(fullgraph=True) of a packed call: the op's schema takes cu_seqlens; the same loss and gradients
    as eager."""
    d = _batch(5, 4)
    cu, ids, mask = torch.tensor(d["cu"]), _token(d, "ids", True), _token(d, "mask", True)
    advantages, context = torch.tensor(d["per_sequence"]), _context()

    def step(h, w):
        loss, _ = fht.fused_linear_grpo_loss(h, w, ids, mask, advantages, cu_seqlens=cu, context=context)
        return loss

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        h = torch.tensor(_packed(d, "hidden"), requires_grad=True)
        w = torch.tensor(d["weight"], requires_grad=True)
        loss = fn(h, w)
        loss.backward()
        results.append((loss.item(), h.grad, w.grad))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])


def test_numpy_packed_equals_padded():
    d = _batch(6, 5)
    cu = d["cu"].astype(np.int64)
    for packed in (False, True):
        tok = (lambda name: np.ascontiguousarray(_packed(d, name))) if packed else (lambda name: d[name])
        hidden = tok("hidden")
        kw = dict(cu_seqlens=cu) if packed else {}
        g = fhnp.grpo_loss(hidden, d["weight"], tok("ids"), tok("mask"), d["per_sequence"], return_grads=True,
                           context=_context(), loss_type="grpo", **kw)
        p = fhnp.preference_loss(hidden, d["weight"], tok("ids"), tok("mask"), return_grads=True, context=_context(),
                                 loss="dpo", **kw)
        k = fhnp.kto_loss(hidden, d["weight"], tok("ids"), tok("mask"), d["labels"],
                          ref_per_token_logps=tok("logps_a"), loss_type="apo_zero_unpaired", return_grads=True,
                          context=_context(), **kw)
        if not packed:
            padded = (g, p, k)
            continue
        for got, want in zip((g, p, k), padded):
            assert got.loss == want.loss and got.metrics == want.metrics
            _check_rows(d, want.per_token_logp, got.per_token_logp, "per-token log-probs")
            _check_rows(d, want.dhidden, got.dhidden, "dhidden")
            assert normwise(got.dweight, want.dweight) <= DWEIGHT_TOL


def test_packed_refusals():
    d = _batch(4, 6)
    h, w = torch.tensor(_packed(d, "hidden")), torch.tensor(d["weight"])
    ids, mask, adv = _token(d, "ids", True), _token(d, "mask", True), torch.tensor(d["per_sequence"])
    cu = torch.tensor(d["cu"])
    with pytest.raises(TypeError, match="cu_seqlens: expected an int32 or int64"):
        fht.fused_linear_grpo_loss(h, w, ids, mask, adv, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match=r"with cu_seqlens expected the packed rows \[N, H\]"):
        fht.fused_linear_grpo_loss(torch.tensor(d["hidden"]), w, ids, mask, adv, cu_seqlens=cu)
    bad = cu.clone()
    bad[-1] -= 1
    with pytest.raises(fusedhead.errors.InvalidSizeError, match="must equal n"):
        fht.fused_linear_grpo_loss(h, w, ids, mask, adv, cu_seqlens=bad)
    with pytest.raises(fusedhead.errors.InvalidGRPOOptionError, match="max_completion_length"):
        fht.fused_linear_grpo_loss(h, w, ids, mask, adv, cu_seqlens=cu, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="an even count"):
        fht.fused_linear_preference_loss(h, w, ids, mask, cu_seqlens=cu[:-1].contiguous())
