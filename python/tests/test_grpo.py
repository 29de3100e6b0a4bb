"""fusedhead.torch (and fusedhead.numpy) GRPO against TRL's GRPOTrainer._compute_loss at huggingface/trl
f2cd5771, transcribed in torch float64 in trl_grpo.py (logits materialised, autograd for the gradients).

Tolerances: the library stores per-token values in fp32 and runs fp32 BLIS GEMMs (statistics and reductions in
double); against a float64 reference on the same fp32 inputs that gives loss errors of a few 1e-7 relative, so
loss and metrics are compared at rel/abs 1e-5 and gradients normwise at 1e-4 (as conftest.py's fp32 bounds;
the GRPO coefficients multiply fp32 log-prob errors by ratios and advantages of order 1, the GSPO and VESPO
sequence sums spread them over a row, and luspo multiplies them by a sequence's length). The loss's absolute
tolerance is 1e-5 times its scale without cancellation (the loss type's reduction of |per-token loss|, the
forward error bound of a signed sum): VESPO's weight phi = exp(lam + k log w - lam w) has log w a *sum* of a
sequence's log-ratios, so phi carries |k - lam w| times that sequence's summed fp32 log-prob errors (measured
up to 5e-6 relative at L = 6, k = 3), and the loss, a sum of sequences' terms of both signs (of size ~1.5 for a
loss of ~0.9), loses two digits of that to cancellation (measured 2.1e-5 absolute, at most 3.2e-6 of its scale).

Decisions taken on thresholds (the clip range, the top-entropy quantile, the off-policy threshold, the importance-
sampling bounds) could flip on an fp32 error where a value sits on its threshold; the data keep the entropies and
the off-policy gaps at least 1e-3 away from theirs (checked: well_conditioned), and the importance-sampling ratios
come from the inputs alone (old and sampling log-probs, exact in both).

Schedules: the default context runs the single-call step in one row block holding every sequence; BLOCKS
(tile_rows = 2 T, B = 5) runs row blocks of 2, 2 and 1 whole sequences, so that block boundaries fall inside the
batch, after the fully masked sequence 1; STREAM (tile_rows < T) cannot hold one sequence and streams (forward
pass, then backward). top_entropy_quantile < 1 streams whatever the context (its threshold needs every entropy).
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
from trl_grpo import entropy_threshold_gap, trl_grpo_loss  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
T_DEFAULT = 7
THRESHOLD_MARGIN = 1e-3  # far above the fp32 (and bf16-GEMM) errors of entropies and log-probs


def trl_reference(h, W, b, ids, mask, A, old=None, ref=None, sampling=None, **options):
    """(loss, metrics, per-token logp) of TRL's _compute_loss in float64 (trl_grpo.trl_grpo_loss)."""
    return trl_grpo_loss(h, W, b, ids, mask, A, old, ref, sampling, **options)


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def make_grpo(seed=0, B=4, T=T_DEFAULT, H=16, V=97, *, bias=False, old=True, ref=True, sampling=False,
              layout="vh", temperature=0.7, zero_advantage=False):
    """fp32-representable data as float64 numpy; row 1 of the mask is all zero, the others random 0/1 tails.
    sampling: the sampler's log-probs, old (or the current log-probs) plus noise, so that importance ratios
    straddle 1 and the bounds used. zero_advantage: the last sequence has advantage 0 (A > 0 and A >= 0 differ)."""
    rng = np.random.default_rng(seed)
    d = {}
    d["h"] = rng.standard_normal((B, T, H)).astype(np.float32).astype(np.float64)
    d["W"] = (rng.standard_normal((V, H)) * (3.0 / math.sqrt(H))).astype(np.float32).astype(np.float64)
    d["b"] = (rng.standard_normal(V) * 0.5).astype(np.float32).astype(np.float64) if bias else None
    d["ids"] = rng.integers(0, V, (B, T)).astype(np.int64)
    mask = np.ones((B, T))
    for r in range(B):
        mask[r, rng.integers(2, T + 1):] = 0  # right padding
    mask[1] = 0.0
    d["mask"] = mask
    A = rng.standard_normal(B)
    A[0] = abs(A[0]) + 0.1  # both signs present
    A[2] = -abs(A[2]) - 0.1
    if zero_advantage:
        A[-1] = 0.0
    d["A"] = A.astype(np.float32).astype(np.float64)
    # old / ref: the current log-probs (bias left out) plus noise, so that ratios straddle the clip range
    with torch.no_grad():
        lp = F.log_softmax(F.linear(torch.tensor(d["h"]), torch.tensor(d["W"])) / temperature, -1)
        lp = lp.gather(-1, torch.tensor(d["ids"]).unsqueeze(-1)).squeeze(-1).numpy()
    noise_old, noise_ref, noise_s = (rng.standard_normal((B, T)) for _ in range(3))
    d["old"] = (lp + 0.3 * noise_old).astype(np.float32).astype(np.float64) if old else None
    d["ref"] = (lp + 0.3 * noise_ref).astype(np.float32).astype(np.float64) if ref else None
    base = d["old"] if old else lp
    d["samp"] = (base + 0.3 * noise_s).astype(np.float32).astype(np.float64) if sampling else None
    d["layout"] = layout
    return d


def _t32(a):
    return None if a is None else torch.tensor(a, dtype=torch.float32)


def _t64(a, grad=False):
    return None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def reference_of(d, upstream=1.0, **opts):
    """(loss, metrics, logp, [dh, dW, db], details) of the float64 transcription on d; grads of upstream*loss."""
    h64, W64, b64 = _t64(d["h"], True), _t64(d["W"], True), _t64(d["b"], d["b"] is not None)
    rloss, rmetrics, rlogp, details = trl_grpo_loss(h64, W64, b64, torch.tensor(d["ids"]), _t64(d["mask"]),
                                                    _t64(d["A"]), _t64(d["old"]), _t64(d["ref"]), _t64(d["samp"]),
                                                    return_details=True, **opts)
    (rloss * upstream).backward()
    return rloss, rmetrics, rlogp, [h64.grad, W64.grad, None if b64 is None else b64.grad], details


def well_conditioned(d, details, opts, h=None, W=None):
    """The data keep every thresholded decision away from its threshold (module docstring). h, W: the float64
    values the library received when they are not d's (bf16 tests)."""
    if details.get("entropy_threshold") is not None:
        h = torch.tensor(d["h"]) if h is None else h.detach()
        W = torch.tensor(d["W"]) if W is None else W.detach()
        with torch.no_grad():
            logits = F.linear(h, W, None if d["b"] is None else torch.tensor(d["b"])) / opts.get("temperature", 1.0)
            ls = F.log_softmax(logits, -1)
            ent = -(ls.exp() * ls).sum(-1)
        gap = entropy_threshold_gap(ent, torch.tensor(d["mask"]), details["entropy_threshold"])
        assert gap > THRESHOLD_MARGIN, f"an entropy lies {gap:.2e} from the quantile threshold: pick other data"
    if "off_policy_margin" in details:
        assert details["off_policy_margin"] > THRESHOLD_MARGIN, "a sequence's gap sits on the off-policy threshold"


def run_both(d, upstream=1.0, context=None, support=None, **opts):
    """(library loss, metrics, logp, grads), (reference loss, metrics, logp, grads); grads of upstream*loss.
    support: None, or (support_ids, support_offsets, bool mask [B, T, V]) for the head and the reference."""
    ids = torch.tensor(d["ids"])
    h = _t32(d["h"]).requires_grad_()
    Wl = d["W"] if d["layout"] == "vh" else np.ascontiguousarray(d["W"].T)
    W = _t32(Wl).requires_grad_()
    b = None if d["b"] is None else _t32(d["b"]).requires_grad_()
    ids_s, offsets_s, inside = support if support is not None else (None, None, None)
    loss, metrics, logp = fht.fused_linear_grpo_loss(h, W, ids, _t32(d["mask"]), _t32(d["A"]), b, _t32(d["old"]),
                                                     _t32(d["ref"]), _t32(d["samp"]), layout=d["layout"],
                                                     return_per_token_logps=True, context=context,
                                                     support_ids=ids_s, support_offsets=offsets_s, **opts)
    (loss * upstream).backward()
    lib_grads = [h.grad, W.grad if d["layout"] == "vh" else W.grad.t(), None if b is None else b.grad]
    rloss, rmetrics, rlogp, ref_grads, details = reference_of(d, upstream, support=inside, **opts)
    well_conditioned(d, details, opts)
    return (loss, metrics, logp, lib_grads), (rloss, rmetrics, rlogp, ref_grads, details["loss_scale"])


def check(lib, ref, mask):
    """Loss and metrics at 1e-5, relative to the loss's scale where its terms cancel (LOSS_TOL times the
    reduction of the absolute per-token losses, trl_grpo's loss_scale: the forward error bound of a sum); log-probs
    at 1e-5; gradients normwise at 1e-4."""
    loss, metrics, logp, grads = lib
    rloss, rmetrics, rlogp, rgrads, scale = ref
    abs_tol = LOSS_TOL * max(1.0, scale)
    assert loss.item() == pytest.approx(rloss.item(), rel=LOSS_TOL, abs=abs_tol)
    assert set(metrics) == set(rmetrics), (sorted(set(metrics) - set(rmetrics)), sorted(set(rmetrics) - set(metrics)))
    for k in rmetrics:
        tol = abs_tol if k == "policy_loss" else LOSS_TOL
        assert metrics[k] == pytest.approx(rmetrics[k], rel=LOSS_TOL, abs=tol), k
    m = mask > 0
    np.testing.assert_allclose(logp.numpy()[m], rlogp.numpy()[m], rtol=LOSS_TOL, atol=LOSS_TOL)
    for g, rg in zip(grads, rgrads):
        assert (g is None) == (rg is None)
        if g is not None:
            assert normwise(g.numpy(), rg.numpy()) <= GRAD_TOL


@pytest.fixture(scope="module")
def contexts():
    """name -> context: the default one (one row block), BLOCKS (row blocks of 2, 2, 1 sequences at B = 5,
    T = 7), STREAM (tile_rows below T: streaming)."""
    with fusedhead.Context(tile_rows=2 * T_DEFAULT, threads=1) as blocks, \
            fusedhead.Context(tile_rows=3, tile_vocab=32, threads=1) as stream:
        yield {"one_block": None, "blocks": blocks, "stream": stream}


# ---------------------------------------------------------------------------------------------------------
# Every loss type x importance-sampling level x old logps x beta
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on_policy"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, level, with_old, beta):
    d = make_grpo(seed=2 * LOSS_TYPES.index(loss_type) + (level == "sequence"), old=with_old, ref=beta != 0.0,
                  bias=beta != 0.0)
    lib, ref = run_both(d, loss_type=loss_type, importance_sampling_level=level, temperature=0.7, beta=beta)
    check(lib, ref, d["mask"])


OPTION_CASES = {
    "delta": dict(loss_type="grpo", delta=1.2, epsilon_high=0.28),
    "delta_gspo": dict(loss_type="bnpo", delta=1.1, importance_sampling_level="sequence"),
    "delta_luspo": dict(loss_type="luspo", delta=1.15),
    "epsilon_alias": dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.3),
    "cispo_cap": dict(loss_type="cispo", epsilon_high=1.1),
    "sapo_taus": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, beta=0.1),
    "num_items": dict(loss_type="dapo", num_items_in_batch=40.0),
    "num_items_tensor": dict(loss_type="cispo", num_items_in_batch=torch.tensor(33)),
    "num_items_vespo": dict(loss_type="vespo", num_items_in_batch=29),
    "max_completion_length": dict(loss_type="dr_grpo", max_completion_length=16),
    "entropy_coef": dict(loss_type="grpo", entropy_coef=0.01, beta=0.04),
    "entropy_coef_gspo": dict(loss_type="sapo", entropy_coef=0.05, importance_sampling_level="sequence"),
    # issue 30's reported case: TRL divides dapo's entropy bonus by num_items_in_batch
    "entropy_dapo_num_items_37": dict(loss_type="dapo", entropy_coef=0.05, num_items_in_batch=37),
    "vespo_params": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0,
                         vespo_lambda_neg=0.5),
    "vespo_lambda_floor": dict(loss_type="vespo", vespo_lambda_pos=0.0, vespo_lambda_neg=1e-6),
    "bias_kl_token": dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=True),
    "bias_kl_sequence": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True,
                             importance_sampling_level="sequence"),
    "bias_kl_cispo": dict(loss_type="cispo", beta=0.1, use_bias_correction_kl=True, epsilon_high=1.2),
    "bias_kl_luspo_sequence": dict(loss_type="luspo", beta=0.04, use_bias_correction_kl=True,
                                   importance_sampling_level="sequence"),
    "bias_kl_vespo": dict(loss_type="vespo", beta=0.04, use_bias_correction_kl=True),
}


@pytest.mark.parametrize("case", list(OPTION_CASES), ids=list(OPTION_CASES))
def test_options(case):
    opts = dict(OPTION_CASES[case])
    d = make_grpo(seed=7, bias=True)
    plain = dict(opts)
    if "epsilon" in plain:
        plain["epsilon_low"] = plain.pop("epsilon")
    tensor_items = isinstance(plain.get("num_items_in_batch"), torch.Tensor)
    if tensor_items:
        plain["num_items_in_batch"] = float(plain["num_items_in_batch"])
    lib, ref = run_both(d, temperature=0.7, **plain)
    check(lib, ref, d["mask"])
    if tensor_items or "epsilon" in opts:  # the alias / tensor form gives the same result
        alias_loss, _ = fht.fused_linear_grpo_loss(*_inputs32(d), temperature=0.7, **opts)
        assert alias_loss.item() == lib[0].item()


# ---------------------------------------------------------------------------------------------------------
# The entropy bonus: TRL's normaliser per loss type (num_items_in_batch for dapo, cispo, vespo; the masked mean
# for the others), with and without num_items_in_batch, and over the top-entropy tokens only
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_items", [None, 37], ids=["no_num_items", "num_items_37"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus(loss_type, num_items):
    d = make_grpo(seed=31, bias=True)
    lib, ref = run_both(d, loss_type=loss_type, temperature=0.7, entropy_coef=0.03, beta=0.02,
                        num_items_in_batch=num_items)
    check(lib, ref, d["mask"])
    assert {"policy_loss", "entropy_coef"} <= set(lib[1]) and lib[1]["entropy_coef"] == pytest.approx(0.03)


# ---------------------------------------------------------------------------------------------------------
# top_entropy_quantile: only the tokens whose entropy is in the batch's top quantile carry the policy term
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5])
def test_top_entropy_quantile(quantile, level):
    d = make_grpo(seed=41, B=5, bias=True)
    lib, ref = run_both(d, loss_type="dapo", importance_sampling_level=level, temperature=0.7, beta=0.04,
                        top_entropy_quantile=quantile)
    check(lib, ref, d["mask"])


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "luspo", "vespo"])
def test_top_entropy_quantile_with_entropy_bonus(loss_type):
    """The bonus then runs over the same tokens (TRL's effective_mask)."""
    d = make_grpo(seed=43, B=5)
    lib, ref = run_both(d, loss_type=loss_type, temperature=0.7, top_entropy_quantile=0.5, entropy_coef=0.02,
                        num_items_in_batch=23)
    check(lib, ref, d["mask"])


# ---------------------------------------------------------------------------------------------------------
# The vLLM importance-sampling correction (sampling_per_token_logps) and its sampling/... metrics
# ---------------------------------------------------------------------------------------------------------
IS_BOUNDS = {"default": dict(),
             "both": dict(vllm_importance_sampling_clip_min=0.6, vllm_importance_sampling_clip_max=1.4),
             "min_only": dict(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=None)}


def _raw_is_ratio(d, mode):
    diff = (d["old"] - d["samp"]) * d["mask"]
    return np.exp(diff.sum(-1)) if mode.startswith("sequence") else np.exp(diff)[d["mask"] > 0]


@pytest.mark.parametrize("bounds", list(IS_BOUNDS))
@pytest.mark.parametrize("mode", IS_MODES)
def test_importance_sampling_modes(mode, bounds):
    d = make_grpo(seed=51, B=5, sampling=True, bias=True)
    opts = dict(IS_BOUNDS[bounds], vllm_importance_sampling_mode=mode)
    if bounds != "default":  # the bounds bind somewhere, so that truncation / masking is exercised
        lo = opts["vllm_importance_sampling_clip_min"]
        hi = opts["vllm_importance_sampling_clip_max"] or math.inf
        r = _raw_is_ratio(d, mode)
        assert ((r < lo) | (r > hi)).any() and ((r >= lo) & (r <= hi)).any(), r
    lib, ref = run_both(d, loss_type="dapo", temperature=0.7, beta=0.04, **opts)
    check(lib, ref, d["mask"])
    assert "sampling/importance_sampling_ratio/mean" in lib[1]


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "vespo"])
def test_importance_sampling_every_loss_type(loss_type, mode):
    d = make_grpo(seed=53, sampling=True)
    lib, ref = run_both(d, loss_type=loss_type, temperature=0.7, vllm_importance_sampling_mode=mode,
                        vllm_importance_sampling_clip_min=0.7, vllm_importance_sampling_clip_max=1.6)
    check(lib, ref, d["mask"])


def test_importance_sampling_off_and_on_policy():
    """correction False: sampling_per_token_logps changes nothing but the off-policy mask's reference; without
    old_per_token_logps the ratio compares the current log-probs (detached) with the sampler's."""
    d = make_grpo(seed=55, sampling=True, bias=True)
    lib, ref = run_both(d, loss_type="grpo", temperature=0.7, vllm_importance_sampling_correction=False)
    check(lib, ref, d["mask"])
    assert not any(k.startswith("sampling/") for k in lib[1])
    plain, _ = fht.fused_linear_grpo_loss(*_inputs32(dict(d, samp=None)), loss_type="grpo", temperature=0.7)
    assert lib[0].item() == pytest.approx(plain.item(), rel=1e-6, abs=1e-7)
    d = make_grpo(seed=56, old=False, sampling=True)
    lib, ref = run_both(d, loss_type="bnpo", temperature=0.7, vllm_importance_sampling_mode="token_mask",
                        vllm_importance_sampling_clip_min=0.7, vllm_importance_sampling_clip_max=1.4)
    check(lib, ref, d["mask"])


def test_importance_sampling_cap_alias():
    """TRL's deprecated vllm_importance_sampling_cap sets clip_max (with a FutureWarning), as GRPOConfig does."""
    d = make_grpo(seed=57, sampling=True)
    opts = dict(loss_type="dapo", temperature=0.7, vllm_importance_sampling_mode="token_truncate")
    l0, m0 = fht.fused_linear_grpo_loss(*_inputs32(d), vllm_importance_sampling_clip_max=1.3, **opts)
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        l1, m1 = fht.fused_linear_grpo_loss(*_inputs32(d), vllm_importance_sampling_cap=1.3, **opts)
    with pytest.warns(FutureWarning):
        l2, _ = fht.FusedLinearGRPOLoss(vllm_importance_sampling_cap=1.3, **opts)(
            *_inputs32(d)[:8], sampling_per_token_logps=_inputs32(d)[8])
    with pytest.warns(FutureWarning):
        r = fhnp.grpo_loss(*(None if a is None else a.numpy() for a in _inputs32(d)),
                           vllm_importance_sampling_cap=1.3, **opts)
    assert l0.item() == l1.item() == l2.item() and m0 == m1
    assert r.loss == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    _, rm, _, _, _ = reference_of(d, **opts, vllm_importance_sampling_clip_max=1.3)
    assert m0["sampling/importance_sampling_ratio/max"] == pytest.approx(rm["sampling/importance_sampling_ratio/max"])


# ---------------------------------------------------------------------------------------------------------
# The off-policy sequence mask
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("source", ["sampling", "old"])
def test_off_policy_mask(source, level):
    d = make_grpo(seed=61, B=6, sampling=source == "sampling", zero_advantage=True)
    d["samp" if source == "sampling" else "old"][2] += 0.4  # sequence 2 (A < 0) drifted: its gap ~ 0.4
    thresholds = (0.05, 10.0)  # some negative-advantage sequence dropped at the first; none at the second
    dropped = []
    for thr in thresholds:
        lib, ref = run_both(d, loss_type="grpo", importance_sampling_level=level, temperature=0.7,
                            off_policy_mask_threshold=thr, vllm_importance_sampling_correction=False)
        check(lib, ref, d["mask"])
        _, _, _, _, details = reference_of(d, loss_type="grpo", importance_sampling_level=level, temperature=0.7,
                                           off_policy_mask_threshold=thr)
        dropped.append(int((details["off_policy_keep"] == 0).sum()))
    assert dropped[0] > 0 and dropped[1] == 0, dropped


# ---------------------------------------------------------------------------------------------------------
# luspo (TRL's quirk: a mean over every B*T position once the per-token loss has a token axis, padding included)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entropy_coef", [0.0, 0.02])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_luspo(level, beta, entropy_coef):
    d = make_grpo(seed=71, B=5, bias=True, ref=True)
    lib, ref = run_both(d, loss_type="luspo", importance_sampling_level=level, temperature=0.7, beta=beta,
                        entropy_coef=entropy_coef, epsilon_high=0.28)
    check(lib, ref, d["mask"])


# ---------------------------------------------------------------------------------------------------------
# Over a support: TRL's loss on log-probs renormalised over each token's support (TRL #7269)
# ---------------------------------------------------------------------------------------------------------
def _grpo_support(d, k, csr, seed):
    """Each token's id and k - 1 other distinct ids (masked tokens too, so that the float64 reference stays finite),
    the last entry of every third token -1: (support_ids, support_offsets or None, bool [B, T, V])."""
    g = torch.Generator().manual_seed(seed)
    B, T = d["ids"].shape
    V = d["W"].shape[0]
    rows, inside = [], torch.zeros(B * T, V, dtype=torch.bool)
    for i, y in enumerate(d["ids"].reshape(-1).tolist()):
        others = torch.randperm(V, generator=g)
        row = torch.cat([torch.tensor([y]), others[others != y][: k - 1]])
        if i % 3 == 2:
            row[-1] = -1
        row = row[torch.randperm(k, generator=g)]
        inside[i, row[row >= 0]] = True
        rows.append(row)
    padded = torch.stack(rows).reshape(B, T, k)
    if not csr:
        return padded, None, inside.reshape(B, T, V)
    kept = [r[r >= 0] for r in rows]
    offsets = torch.zeros(len(kept) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(r) for r in kept]), 0)
    return torch.cat(kept), offsets, inside.reshape(B, T, V)


@pytest.mark.parametrize("csr", [False, True], ids=["padded", "csr"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "vespo"])
def test_support_matches_trl_renormalised(loss_type, level, csr):
    """vespo is left out: TRL's VESPO weight sums the log-ratios over padding positions too, where a support is
    undefined (a sampler keeps no set for padding) and the head's masked log-probs are 0."""
    d = make_grpo(seed=91 + LOSS_TYPES.index(loss_type), B=5, bias=True, ref=True, sampling=True)
    support = _grpo_support(d, 24, csr, seed=LOSS_TYPES.index(loss_type))
    lib, ref = run_both(d, loss_type=loss_type, importance_sampling_level=level, temperature=0.7, beta=0.04,
                        entropy_coef=0.01, support=support)
    check(lib, ref, d["mask"])
    masked = d["mask"] == 0
    assert bool((lib[2][torch.tensor(masked)] == 0).all()), "masked tokens' per-token log-probs are 0"


def test_support_numpy_equals_torch():
    d = make_grpo(seed=95, B=4, ref=True)
    ids, offsets, _ = _grpo_support(d, 12, True, seed=5)
    f = lambda a: None if a is None else np.asarray(a, dtype=np.float32)  # noqa: E731
    r = fhnp.grpo_loss(f(d["h"]), f(d["W"]), d["ids"], f(d["mask"]), f(d["A"]), None, f(d["old"]), f(d["ref"]),
                       beta=0.04, return_grads=True, support_ids=ids.numpy(), support_offsets=offsets.numpy())
    h, W = _t32(d["h"]).requires_grad_(), _t32(d["W"]).requires_grad_()
    loss, _ = fht.fused_linear_grpo_loss(h, W, torch.tensor(d["ids"]), _t32(d["mask"]), _t32(d["A"]), None,
                                         _t32(d["old"]), _t32(d["ref"]), beta=0.04, support_ids=ids,
                                         support_offsets=offsets)
    loss.backward()
    assert r.loss == pytest.approx(loss.item(), rel=1e-6)
    assert normwise(r.dhidden, h.grad.numpy()) <= 1e-6 and normwise(r.dweight, W.grad.numpy()) <= 1e-6


def test_support_refusals():
    d = make_grpo(seed=97, B=3)
    ids, _, _ = _grpo_support(d, 8, False, seed=3)
    unmasked = int(np.argwhere(d["mask"].reshape(-1) > 0)[0][0])
    flat = ids.reshape(-1, 8).clone()
    flat[unmasked] = (int(d["ids"].reshape(-1)[unmasked]) + 1 + torch.arange(8)) % d["W"].shape[0]
    with pytest.raises(fusedhead.errors.InvalidSupportError, match=f"row {unmasked}: its target"):
        fht.fused_linear_grpo_loss(*_inputs32(d), support_ids=flat.reshape(ids.shape))
    with pytest.raises(ValueError, match="support_offsets without support_ids"):
        fht.fused_linear_grpo_loss(*_inputs32(d), support_offsets=torch.zeros(22, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------------
# vespo, with and without the token importance-sampling modes
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_case", ["none", "token_truncate", "token_mask", "token_mask_min_above_1",
                                     "correction_off"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vespo(level, is_case):
    d = make_grpo(seed=81, B=5, sampling=is_case != "none", zero_advantage=True)
    opts = dict(loss_type="vespo", importance_sampling_level=level, temperature=0.7)
    if is_case == "correction_off":
        opts.update(vllm_importance_sampling_correction=False)
    elif is_case == "token_mask_min_above_1":  # padding's ratio exp(0) = 1 is masked to 0: log 1e-8 per position
        opts.update(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=1.05,
                    vllm_importance_sampling_clip_max=None)
    elif is_case != "none":
        opts.update(vllm_importance_sampling_mode=is_case, vllm_importance_sampling_clip_min=0.7,
                    vllm_importance_sampling_clip_max=1.5)
    lib, ref = run_both(d, **opts)
    check(lib, ref, d["mask"])
    assert "vespo/phi_seq_mean" in lib[1]


def test_vespo_refuses_sequence_modes():
    """TRL refuses vespo with a sequence-level importance-sampling mode (GRPOTrainer.__init__)."""
    d = make_grpo(seed=83, sampling=True)
    for mode in ("sequence_mask", "sequence_truncate"):
        with pytest.raises(fusedhead.errors.InvalidGRPOOptionError) as e:
            fht.fused_linear_grpo_loss(*_inputs32(d), loss_type="vespo", vllm_importance_sampling_mode=mode)
        assert e.value.message
    # without the sampler's log-probs (or with the correction off) the mode is not used
    fht.fused_linear_grpo_loss(*_inputs32(d)[:8], loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    fht.fused_linear_grpo_loss(*_inputs32(d), loss_type="vespo", vllm_importance_sampling_correction=False)


# ---------------------------------------------------------------------------------------------------------
# Every feature at once, on every schedule: one row block, blocks of whole sequences with boundaries inside
# the batch, streaming
# ---------------------------------------------------------------------------------------------------------
ALL_FEATURES = {
    "dapo_is_tokens": dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=True, entropy_coef=0.02,
                           num_items_in_batch=37, off_policy_mask_threshold=0.05,
                           vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.6,
                           vllm_importance_sampling_clip_max=1.5, delta=1.5, epsilon_high=0.28),
    "gspo_is_sequence": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                             use_bias_correction_kl=True, entropy_coef=0.02, off_policy_mask_threshold=0.05,
                             vllm_importance_sampling_mode="sequence_truncate",
                             vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0),
    "luspo": dict(loss_type="luspo", beta=0.04, entropy_coef=0.02, off_policy_mask_threshold=0.05,
                  vllm_importance_sampling_mode="token_truncate"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", entropy_coef=0.02,
                           vllm_importance_sampling_mode="sequence_mask"),
    # a per-sequence policy term times a per-token ratio: luspo's mean runs over B*T positions again
    "luspo_sequence_token_is": dict(loss_type="luspo", importance_sampling_level="sequence",
                                    vllm_importance_sampling_mode="token_truncate",
                                    vllm_importance_sampling_clip_min=0.7),
    "vespo": dict(loss_type="vespo", beta=0.04, use_bias_correction_kl=True, entropy_coef=0.02,
                  num_items_in_batch=41, off_policy_mask_threshold=0.05,
                  vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.6),
    "sapo": dict(loss_type="sapo", beta=0.04, entropy_coef=0.02, off_policy_mask_threshold=0.05),
    "cispo_quantile": dict(loss_type="cispo", epsilon_high=1.3, entropy_coef=0.02, num_items_in_batch=37,
                           top_entropy_quantile=0.2, vllm_importance_sampling_mode="token_truncate"),
}


@pytest.mark.parametrize("schedule", ["one_block", "blocks", "stream"])
@pytest.mark.parametrize("case", list(ALL_FEATURES))
def test_schedules(case, schedule, contexts):
    d = make_grpo(seed=91, B=5, bias=True, sampling=True, zero_advantage=True)
    lib, ref = run_both(d, context=contexts[schedule], temperature=0.7, **ALL_FEATURES[case])
    check(lib, ref, d["mask"])


# ---------------------------------------------------------------------------------------------------------
# Masks: a batch with no token, and fractional mask values (TRL multiplies by the mask, and takes mask.bool()
# for the entropy quantile and the sampling metrics)
# ---------------------------------------------------------------------------------------------------------
def _every_option(loss_type, level="token"):
    return dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                top_entropy_quantile=0.5, off_policy_mask_threshold=0.1, use_bias_correction_kl=True,
                vllm_importance_sampling_mode="token_mask" if loss_type == "vespo" else "sequence_mask",
                vllm_importance_sampling_clip_min=0.5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch(loss_type, level):
    """Every option on, no token counted: loss 0, zero gradients, and the metrics TRL logs (0 for the means and
    the sampling metrics; clip_ratio/low_min and high_max NaN at the token level, so omitted)."""
    d = make_grpo(seed=97, sampling=True, bias=True)
    d["mask"] = np.zeros_like(d["mask"])
    lib, ref = run_both(d, temperature=0.7, **_every_option(loss_type, level))
    check(lib, ref, d["mask"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fractional_mask(loss_type):
    d = make_grpo(seed=98, B=5, sampling=True, bias=True)
    rng = np.random.default_rng(0)
    d["mask"] = d["mask"] * rng.choice([0.25, 0.5, 1.0], d["mask"].shape)
    opts = _every_option(loss_type)
    opts.pop("top_entropy_quantile")  # with it as well, below
    lib, ref = run_both(d, temperature=0.7, **opts)
    check(lib, ref, d["mask"])
    if loss_type == "dapo":
        lib, ref = run_both(d, temperature=0.7, **_every_option(loss_type))
        check(lib, ref, d["mask"])


# TRL clamps num_items_in_batch to >= 1 (grpo_trainer.py: inputs['num_items_in_batch'].clamp(min=1.0)).
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_num_items_below_one(loss_type):
    d = make_grpo(seed=99, bias=True)
    lib, ref = run_both(d, temperature=0.7, loss_type=loss_type, num_items_in_batch=0.5, entropy_coef=0.01)
    check(lib, ref, d["mask"])


def test_layout_hv_and_upstream_scale():
    d = make_grpo(seed=3, bias=True, layout="hv", sampling=True)
    lib, ref = run_both(d, upstream=-2.5, loss_type="dapo", importance_sampling_level="sequence", beta=0.04,
                        temperature=0.7, entropy_coef=0.01, vllm_importance_sampling_mode="token_truncate")
    check(lib, ref, d["mask"])


# ---------------------------------------------------------------------------------------------------------
# Front-end behaviour
# ---------------------------------------------------------------------------------------------------------
def _inputs32(d):
    """h, W, ids, mask, A, b, old, ref, sampling as the torch front end takes them (float32, int64)."""
    f = _t32
    return (f(d["h"]), f(d["W"]), torch.tensor(d["ids"]), f(d["mask"]), f(d["A"]), f(d["b"]), f(d["old"]),
            f(d["ref"]), f(d.get("samp")))


def test_default_loss_type_is_dapo():
    """loss_type defaults to "dapo", as TRL's GRPOConfig (and fh_grpo_options_init)."""
    d = make_grpo(seed=4)
    args = _inputs32(d)
    l0, m0 = fht.fused_linear_grpo_loss(*args)
    l1, m1 = fht.fused_linear_grpo_loss(*args, loss_type="dapo")
    l2, m2 = fht.FusedLinearGRPOLoss()(*args[:8])
    r = fhnp.grpo_loss(*(None if a is None else a.numpy() for a in args[:8]))
    assert l0.item() == l1.item() == l2.item() == pytest.approx(r.loss, rel=1e-6, abs=1e-7)
    assert m0 == m1 == m2


def test_no_grad_and_partial_grads():
    d = make_grpo(seed=5, bias=True, sampling=True)
    h, W, ids, mask, A, b, old, ref, samp = _inputs32(d)
    opts = dict(loss_type="bnpo", beta=0.04, temperature=0.7, top_entropy_quantile=0.5,
                vllm_importance_sampling_mode="token_truncate")
    with torch.no_grad():  # fh_grpo_forward
        l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, **opts)
    W.requires_grad_()
    l1, m1 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, **opts)
    assert l0.item() == pytest.approx(l1.item(), rel=1e-6, abs=1e-7) and m0 == pytest.approx(m1, rel=1e-6, abs=1e-7)
    l1.backward()
    assert h.grad is None and W.grad is not None
    # bool / integer masks are converted; the module form gives the same (sampling by keyword)
    l2, _ = fht.FusedLinearGRPOLoss(**opts)(h, W, ids, mask.bool(), A, b, old, ref, sampling_per_token_logps=samp)
    l3, _ = fht.fused_linear_grpo_loss(h, W, ids, mask.long(), A, b, old, ref, samp, **opts)
    assert l2.item() == l1.item() == l3.item()


def test_module_num_items_per_call():
    d = make_grpo(seed=6, sampling=True)
    args = _inputs32(d)
    fn = fht.FusedLinearGRPOLoss(loss_type="vespo", entropy_coef=0.01, temperature=0.7,
                                 vllm_importance_sampling_mode="token_mask")
    l0, m0 = fn(*args[:8], num_items_in_batch=torch.tensor(31), sampling_per_token_logps=args[8])
    l1, m1 = fht.fused_linear_grpo_loss(*args, loss_type="vespo", entropy_coef=0.01, temperature=0.7,
                                        vllm_importance_sampling_mode="token_mask", num_items_in_batch=31)
    assert l0.item() == l1.item() and m0 == m1
    assert "vllm_importance_sampling_mode='token_mask'" in repr(fn)


def test_masked_padding_ids_out_of_range():
    """Ids of masked-out tokens need not be valid (TRL pads with pad_token_id); logp there is 0. (Not luspo at
    the token level: TRL counts its padding positions, which need their log-probs.)"""
    d = make_grpo(seed=11, sampling=True)
    h, W, ids, mask, A, b, old, ref, samp = _inputs32(d)
    opts = dict(beta=0.04, loss_type="grpo", vllm_importance_sampling_mode="token_truncate", top_entropy_quantile=0.5)
    l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, **opts)
    bad = ids.clone()
    bad[mask == 0] = -100
    l1, m1, logp = fht.fused_linear_grpo_loss(h, W, bad, mask, A, b, old, ref, samp, return_per_token_logps=True,
                                              **opts)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    assert torch.all(logp[mask == 0] == 0)


def test_context_and_numpy_api():
    d = make_grpo(seed=13, bias=True, sampling=True)
    h, W, ids, mask, A, b, old, ref, samp = _inputs32(d)
    opts = dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04, temperature=0.7,
                entropy_coef=0.01, off_policy_mask_threshold=0.1, vllm_importance_sampling_mode="sequence_truncate",
                vllm_importance_sampling_clip_min=0.5)
    l0, m0 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, **opts)
    with fusedhead.Context(tile_rows=8, tile_vocab=32, threads=1) as ctx:
        l1, m1 = fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, context=ctx, **opts)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    r = fhnp.grpo_loss(h.numpy(), W.numpy(), ids.numpy(), mask.numpy(), A.numpy(), b.numpy(), old.numpy(),
                       ref.numpy(), samp.numpy(), return_grads=True, **opts)
    assert r.loss == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    assert r.metrics == pytest.approx(m0, rel=1e-6, abs=1e-7)
    rf = fhnp.grpo_loss(h.numpy(), W.numpy(), ids.numpy(), mask.numpy(), A.numpy(), b.numpy(), old.numpy(),
                        ref.numpy(), sampling_per_token_logps=samp.numpy(), **opts)  # forward only
    assert rf.loss == pytest.approx(r.loss, rel=1e-6, abs=1e-7) and rf.dhidden is None
    h.requires_grad_()
    fht.fused_linear_grpo_loss(h, W, ids, mask, A, b, old, ref, samp, **opts)[0].backward()
    assert normwise(r.dhidden, h.grad.numpy()) <= 1e-6 and r.dweight.shape == W.shape
    _, rmetrics, _, _, _ = reference_of(d, **opts)
    assert set(r.metrics) == set(rmetrics)


@pytest.mark.parametrize("case", ["dapo_is_tokens", "vespo", "cispo_quantile"])
def test_numpy_matches_trl(case):
    d = make_grpo(seed=93, B=5, bias=True, sampling=True, zero_advantage=True)
    opts = dict(ALL_FEATURES[case], temperature=0.7)
    f32 = lambda a: None if a is None else a.astype(np.float32)  # noqa: E731
    r = fhnp.grpo_loss(f32(d["h"]), f32(d["W"]), d["ids"], f32(d["mask"]), f32(d["A"]), f32(d["b"]), f32(d["old"]),
                       f32(d["ref"]), f32(d["samp"]), return_grads=True, **opts)
    rloss, rmetrics, rlogp, rgrads, details = reference_of(d, **opts)
    well_conditioned(d, details, opts)
    assert r.loss == pytest.approx(rloss.item(), rel=LOSS_TOL, abs=LOSS_TOL)
    assert set(r.metrics) == set(rmetrics)
    for k in rmetrics:
        assert r.metrics[k] == pytest.approx(rmetrics[k], rel=LOSS_TOL, abs=LOSS_TOL), k
    for g, rg in zip((r.dhidden, r.dweight, r.dbias), rgrads):
        assert normwise(g, rg.numpy()) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
def test_errors():
    d = make_grpo(seed=17, sampling=True)
    h, W, ids, mask, A, b, old, ref, samp = _inputs32(d)
    with pytest.raises(TypeError, match="hidden: expected dtype torch.float32"):
        fht.fused_linear_grpo_loss(h.double(), W, ids, mask, A)
    with pytest.raises(TypeError, match="completion_ids"):
        fht.fused_linear_grpo_loss(h, W, ids.int(), mask, A)
    with pytest.raises(TypeError, match="advantages"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A.double())
    with pytest.raises(TypeError, match="sampling_per_token_logps"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, None, old, None, samp.double())
    with pytest.raises(ValueError, match="completion_ids: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids[:, :-1], mask, A)
    with pytest.raises(ValueError, match="completion_mask: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask[:-1], A)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A[:-1])
    with pytest.raises(ValueError, match="old_per_token_logps: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, None, old.t())
    with pytest.raises(ValueError, match="sampling_per_token_logps: expected shape"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, None, old, None, samp[:, :-1])
    with pytest.raises(ValueError, match="hidden: expected \\[B, T, H\\]"):
        fht.fused_linear_grpo_loss(h.reshape(-1, h.shape[-1]), W, ids, mask, A)
    with pytest.raises(ValueError, match="weight: expected shape"):
        fht.fused_linear_grpo_loss(h, W[:, :-1], ids, mask, A)
    with pytest.raises(ValueError, match="loss_type"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, importance_sampling_level="tok")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        fht.FusedLinearGRPOLoss(vllm_importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match="epsilon"):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, epsilon=0.1, epsilon_low=0.2)
    with pytest.raises(TypeError, match="unknown GRPO option"):
        fhnp.grpo_loss(h.numpy(), W.numpy(), ids.numpy(), mask.numpy(), A.numpy(), top_entropy=0.2)
    with pytest.raises(ValueError, match="sampling_per_token_logps: expected shape"):
        fhnp.grpo_loss(h.numpy(), W.numpy(), ids.numpy(), mask.numpy(), A.numpy(), None, old.numpy(), None,
                       samp.numpy()[:, :-1])
    # the library's own checks: exception carries its status and message
    with pytest.raises(fusedhead.FusedheadValueError) as e:
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, beta=0.04)
    assert e.value.message and "ref" in e.value.message.lower()
    bad_options = [dict(epsilon_low=-0.5), dict(top_entropy_quantile=1.5), dict(top_entropy_quantile=-0.1),
                   dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5),
                   dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
                   dict(loss_type="vespo", vespo_lambda_pos=float("nan")),
                   dict(off_policy_mask_threshold=float("inf"))]
    for bad in bad_options:
        with pytest.raises(fusedhead.errors.InvalidGRPOOptionError) as e:
            fht.fused_linear_grpo_loss(h, W, ids, mask, A, None, old, None, samp, **bad)
        assert e.value.message, bad
    with pytest.raises(fusedhead.errors.InvalidTemperatureError):
        fht.fused_linear_grpo_loss(h, W, ids, mask, A, temperature=0.0)
    bad = ids.clone()
    bad[0, 0] = 10_000  # masked-in token out of range
    with pytest.raises(fusedhead.TargetOutOfRangeError):
        fht.fused_linear_grpo_loss(h, W.requires_grad_(), bad, mask, A)
    neg = mask.clone()
    neg[0, 0] = -1.0
    with pytest.raises(fusedhead.errors.InvalidMaskError):
        fht.fused_linear_grpo_loss(h, W, ids, neg, A)
