"""fusedhead's heads against TRL's OWN loss code (not the float64 transcriptions trl_*.py, which stay), pinned to the
TRL version python/requirements-test.txt installs (1.16.0; the module is skipped for any other version, whose code
these tests have not been read against).

What runs on TRL's side, on the same fp32 hidden states and lm_head weight as fusedhead's:
  - the model: a stand-in causal LM (_StandInLM: a "backbone" that returns the given hidden states for the given
    input ids, and an nn.Linear lm_head holding the given weight and bias) given TRL's own fused LM head by
    trl.trainer.utils.add_fused_lm_head, so `model(..., labels=..., fused_lm_head=True)` is TRL's code end to end:
    the label shift and masking, and trl.kernels.ChunkedLogProbFunction, which materialises the [N, V] logits (one
    chunk at these sizes) for the log-probs, entropy, mean logits and top-1 flags.
  - the losses: the trainers' own methods called unbound on a minimal stand-in `self` (_trainer_self: the
    attributes __init__ would have set from the config, a real accelerate.Accelerator on the CPU with one process,
    TRL's defaultdict of metrics). Building real trainers for each option would cost seconds each; the end-to-end
    trainer runs are in test_trl_trainers.py.
      GRPO: GRPOTrainer._compute_loss (with its own _get_per_token_logps_and_entropies, get_high_entropy_mask,
        get_off_policy_mask, get_gamma_weights). The vLLM importance-sampling ratio is computed by TRL inline in
        _generate_and_score_completions (trl/trainer/grpo_trainer.py lines 2659-2708 at 1.16.0), not callable:
        that ratio and its sampling/... metrics come from the transcription trl_grpo.py (read against 1.16.0: the
        same, but for a NaN guard that these finite inputs never reach); everything after it is TRL's.
      DPO: DPOTrainer._compute_loss (precompute_ref_log_probs: the reference's sequence log-probs in the batch),
        every loss_type fusedhead takes, and weighted lists of them.
      KTO: KTOTrainer._compute_loss and _compute_kl_logps (TRL 1.16.0 has no separate kto_loss: the loss is in
        _compute_loss), loss types kto and apo_zero_unpaired, desirable / undesirable weights.
      GKD: GKDTrainer.generalized_jsd_loss (static), every beta regime, temperature, reductions and
        num_items_in_batch.
      IWOPD: IWOPDTrainer.generalized_jsd_loss (static) over top-k supports: every beta regime x top_k 1, 20, 256 x
        with and without the tail bucket.
      DistillationTrainer: trl/trainer/distillation_trainer.py's _chunked_divergence_loss (module level), every beta
        regime, temperature, num_items_in_batch, biases, a completion mask, and its entropy sum.
Found here (and fixed): fusedhead's GRPO head was written to TRL at f2cd5771, and TRL 1.16.0 changed two reductions
since: luspo with a token axis (each sequence's masked sum averaged over B, not a mean over every B*T position), and
the entropy bonus of dapo / cispo / vespo, which 1.16.0 divides by the active token count, not num_items_in_batch.
The cases luspo, entropy_bonus_*_num_items and top_entropy_quantile_bonus_* hold the head to 1.16.0 there.
Options TRL has and fusedhead's heads do not take are not here (DPO's f_divergence_type other than reverse_kl,
ld_alpha, use_weighting, which the head refuses; GRPO's adaptive entropy controller and MoE aux loss; tool masks).

Tolerances (conftest's float32 ones, both sides fp32): loss and metrics 1e-5 relative (absolute 1e-5 for values near
0, as test_preference_trl.py), gradients of hidden, weight and bias normwise 1e-4.
"""
from __future__ import annotations

import contextlib
import math
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not importable (python/requirements-test.txt installs it)")
trl = pytest.importorskip("trl", reason="trl not importable (python/requirements-test.txt installs it)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"TRL {trl.__version__}: these tests are read against TRL 1.16.0's code", allow_module_level=True)

with warnings.catch_warnings():  # TRLExperimentalWarning: GKD lives in trl.experimental at 1.16.0
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

import fusedhead.torch as fht  # noqa: E402
import fusedhead.trl as fhtrl  # noqa: E402
from conftest import GRAD_RTOL_F32, LOSS_RTOL_F32, normwise  # noqa: E402
import trl_grpo  # noqa: E402  (the vLLM importance-sampling ratio only; see above)
from trl_standin import StandInLM, grpo_trainer_self, trainer_self  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def trl_unpatched():
    """TRL's own per-token function on TRL's side (fusedhead.trl.patch() would replace it)."""
    fhtrl.unpatch()
    yield


# --- TRL's side: a stand-in model with TRL's fused LM head, and a stand-in trainer `self` ---------------------------

def _trl_metrics(ns, skip=("num_tokens",)):
    return {k: v[-1] for k, v in ns._metrics["train"].items() if k not in skip}


def _leaves(hidden, weight, bias):
    return [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]


def _grads(hidden, model):
    head = model.lm_head
    return [hidden.grad, head.weight.grad] + ([] if head.bias is None else [head.bias.grad])


def _check(got_loss, got_metrics, got_grads, want_loss, want_metrics, want_grads, keys=None):
    assert abs(got_loss - want_loss) <= LOSS_RTOL_F32 * max(abs(want_loss), 1.0), (got_loss, want_loss)
    if keys is None:
        assert set(got_metrics) == set(want_metrics), (sorted(got_metrics), sorted(want_metrics))
    for k in (want_metrics if keys is None else keys):
        a, b = float(got_metrics[k]), float(want_metrics[k])
        assert a == pytest.approx(b, rel=LOSS_RTOL_F32, abs=LOSS_RTOL_F32), (k, a, b)
    for a, b in zip(got_grads, want_grads):
        assert normwise(a.double().numpy(), b.double().numpy()) <= GRAD_RTOL_F32


# --- GRPO: GRPOTrainer._compute_loss -------------------------------------------------------------------------------

GRPO_B, GRPO_P, GRPO_C, GRPO_H, GRPO_V = 6, 3, 7, 24, 601


def _grpo_data(seed, bias):
    g = torch.Generator().manual_seed(seed)
    b, p, c, h, v = GRPO_B, GRPO_P, GRPO_C, GRPO_H, GRPO_V
    d = {"hidden": torch.randn(b, p + c, h, generator=g),
         "weight": torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h)),
         "bias": torch.randn(v, generator=g) * 0.5 if bias else None,
         "prompt_ids": torch.randint(3, v, (b, p), generator=g),
         "completion_ids": torch.randint(3, v, (b, c), generator=g),
         "advantages": torch.randn(b, generator=g)}
    prompt_mask = torch.ones(b, p, dtype=torch.int64)
    prompt_mask[0, 0] = 0                                  # a left-padded prompt
    cmask = torch.ones(b, c, dtype=torch.int64)
    for i, n in enumerate((c, 4, c, 2, 5, c)):            # ragged completions, right padded
        cmask[i, n:] = 0
    d["prompt_mask"], d["completion_mask"] = prompt_mask, cmask
    with torch.no_grad():
        z = F.linear(d["hidden"][:, p - 1:-1].double(), d["weight"].double(),
                     None if d["bias"] is None else d["bias"].double())
        lp = z.log_softmax(-1).gather(-1, d["completion_ids"].unsqueeze(-1)).squeeze(-1).float()
    noise = lambda s: (torch.randn(b, c, generator=g) * s)  # noqa: E731
    d["old"] = (lp + noise(0.25)) * cmask               # a policy a little behind: the ratios clip now and then
    d["ref"] = (lp + noise(0.3)) * cmask
    d["sampling"] = (lp + noise(0.15)) * cmask
    return d


def _grpo_trl(d, *, temperature, loss_type, importance_sampling_level, epsilon, epsilon_high, delta, beta,
              use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, num_items_in_batch,
              max_completion_length, entropy_coef, top_entropy_quantile, off_policy_mask_threshold, use_vllm,
              vllm_importance_sampling_correction, vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
              vllm_importance_sampling_clip_max, vespo, old, ref, sampling):
    """GRPOTrainer._compute_loss on TRL's own fused head: (loss, metrics, grads of hidden [full], weight, bias)."""
    model = StandInLM(d["weight"], d["bias"], temperature=temperature)
    hidden = d["hidden"].clone().requires_grad_()
    model.register(torch.cat([d["prompt_ids"], d["completion_ids"]], 1), hidden)
    ns = grpo_trainer_self(model, loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                           epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, beta=beta,
                           use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
                           sapo_temperature_neg=sapo_temperature_neg,
                           max_completion_length=max_completion_length or GRPO_C, entropy_coef=entropy_coef,
                           top_entropy_quantile=top_entropy_quantile,
                           off_policy_mask_threshold=off_policy_mask_threshold, use_vllm=use_vllm,
                           vllm_importance_sampling_correction=vllm_importance_sampling_correction, vespo=vespo)
    cmask = d["completion_mask"]
    inputs = {"prompt_ids": d["prompt_ids"], "prompt_mask": d["prompt_mask"], "completion_ids": d["completion_ids"],
              "completion_mask": cmask, "advantages": d["advantages"],
              "num_items_in_batch": torch.tensor(float(cmask.sum()) if num_items_in_batch is None
                                                 else float(num_items_in_batch))}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    extra = {}
    if sampling is not None:
        inputs["sampling_per_token_logps"] = sampling
        if use_vllm and vllm_importance_sampling_correction:
            # _generate_and_score_completions' inline ratio (old: TRL always computes it with vLLM)
            ratio = trl_grpo.vllm_importance_sampling_ratio(old, sampling, cmask, vllm_importance_sampling_mode,
                                                            vllm_importance_sampling_clip_min,
                                                            vllm_importance_sampling_clip_max)
            inputs["importance_sampling_ratio"] = ratio
            extra = trl_grpo.sampling_metrics(old, sampling, cmask, ratio, vllm_importance_sampling_mode)
    loss = GRPOTrainer._compute_loss(ns, model, inputs)
    loss.backward()
    metrics = dict(_trl_metrics(ns), **extra)
    metrics = {k: v for k, v in metrics.items() if v == v}  # NaN: nothing to log (fusedhead omits the key)
    return loss.item(), metrics, _grads(hidden, model)


GRPO_DEFAULTS = dict(temperature=1.0, loss_type="dapo", importance_sampling_level="token", epsilon=0.2,
                     epsilon_high=None, delta=None, beta=0.0, use_bias_correction_kl=False, sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05, num_items_in_batch=None, max_completion_length=None,
                     entropy_coef=0.0, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                     vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                     vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0)
VESPO_DEFAULTS = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)

GRPO_CASES = {
    # every loss type at its defaults, off-policy (old given) so that the ratios move and clip
    **{f"{t}": dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")},
    "vespo": dict(loss_type="vespo", vespo=dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5,
                                                vespo_lambda_neg=1.5)),
    "on_policy": dict(old=None),
    "gspo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "clip_higher_delta_temperature": dict(loss_type="dapo", epsilon=0.15, epsilon_high=0.28, delta=1.4,
                                          temperature=0.7),
    "kl": dict(loss_type="grpo", beta=0.04),
    "kl_bias_correction": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "cispo_cap": dict(loss_type="cispo", epsilon_high=1.1),
    "num_items": dict(loss_type="dapo", num_items_in_batch=50),
    "dr_grpo_max_len": dict(loss_type="dr_grpo", max_completion_length=12),
    "bias_head": dict(loss_type="dapo", bias=True),
    "entropy_bonus_grpo": dict(loss_type="grpo", entropy_coef=0.05),
    "entropy_bonus_dapo": dict(loss_type="dapo", entropy_coef=0.05),
    "entropy_bonus_dapo_num_items": dict(loss_type="dapo", entropy_coef=0.05, num_items_in_batch=50),
    "entropy_bonus_cispo_num_items": dict(loss_type="cispo", entropy_coef=-0.04, num_items_in_batch=80),
    "top_entropy_quantile": dict(loss_type="bnpo", top_entropy_quantile=0.4),
    "top_entropy_quantile_bonus": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.03),
    "top_entropy_quantile_bonus_dapo": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.03),
    "top_entropy_quantile_bonus_vespo": dict(loss_type="vespo", top_entropy_quantile=0.6, entropy_coef=0.03,
                                             num_items_in_batch=40),
    "luspo_kl_bonus_quantile": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04,
                                    entropy_coef=0.02, top_entropy_quantile=0.7),
    "off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    "vllm_sequence_mask": dict(sampling=True),
    "vllm_sequence_truncate": dict(sampling=True, vllm_importance_sampling_mode="sequence_truncate",
                                   vllm_importance_sampling_clip_max=1.5),
    "vllm_token_mask": dict(sampling=True, vllm_importance_sampling_mode="token_mask",
                            vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25),
    "vllm_token_truncate": dict(sampling=True, loss_type="grpo", vllm_importance_sampling_mode="token_truncate",
                                vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1),
    "vllm_no_correction": dict(sampling=True, vllm_importance_sampling_correction=False,
                               off_policy_mask_threshold=0.02),
    "vllm_off_policy_mask": dict(sampling=True, off_policy_mask_threshold=0.02, loss_type="bnpo"),
    "vespo_vllm_token": dict(sampling=True, loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                             vllm_importance_sampling_clip_max=2.0),
}


@pytest.mark.parametrize("case", sorted(GRPO_CASES))
def test_grpo_matches_trl_compute_loss(case):
    spec = dict(GRPO_CASES[case])
    d = _grpo_data(seed=sorted(GRPO_CASES).index(case), bias=spec.pop("bias", False))
    use_sampling = spec.pop("sampling", False)
    vespo = dict(VESPO_DEFAULTS, **spec.pop("vespo", {}))
    old = spec.pop("old", d["old"])
    opts = dict(GRPO_DEFAULTS, **spec)
    ref = d["ref"] if opts["beta"] != 0.0 else None
    sampling = d["sampling"] if use_sampling else None
    want = _grpo_trl(d, use_vllm=use_sampling, vespo=vespo, old=old, ref=ref, sampling=sampling, **opts)

    p = GRPO_P
    hidden, weight, *bias = _leaves(d["hidden"], d["weight"], d["bias"])
    fh_opts = dict(opts, **vespo)
    fh_opts["epsilon_low"] = fh_opts.pop("epsilon")
    if fh_opts["num_items_in_batch"] is None:
        fh_opts["num_items_in_batch"] = torch.tensor(float(d["completion_mask"].sum()))
    loss, metrics = fht.fused_linear_grpo_loss(
        hidden[:, p - 1:-1], weight, d["completion_ids"], d["completion_mask"], d["advantages"],
        bias=bias[0] if bias else None, old_per_token_logps=old, ref_per_token_logps=ref,
        sampling_per_token_logps=sampling, **fh_opts)
    loss.backward()
    got_grads = [hidden.grad, weight.grad] + ([bias[0].grad] if bias else [])
    _check(loss.item(), metrics, got_grads, *want)


# --- DPO: DPOTrainer._compute_loss ---------------------------------------------------------------------------------

DPO_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
             "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
DPO_LISTS = {"mpo": (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)),
             "mixed": (("discopop", "apo_down", "sigmoid_norm", "exo_pair", "aot"), (1.0, -0.3, 2.0, 0.5, 0.25))}


def _pref_data(seed, rows, L=11, H=24, V=601, bias=False, empty_last=True):
    """TRL's collated layout: rows of input_ids with a prompt of 1-3 tokens, a ragged completion, right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (rows, L), generator=g)
    cmask = torch.zeros(rows, L, dtype=torch.int64)
    amask = torch.zeros(rows, L, dtype=torch.int64)
    for s in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=g))
        end = start + int(torch.randint(2, L - start + 1, (1,), generator=g))
        if empty_last and s == rows - 1:
            end = start
        cmask[s, start:end] = 1
        amask[s, :end] = 1
        ids[s, end:] = 0
    return {"input_ids": ids, "completion_mask": cmask, "attention_mask": amask,
            "hidden": torch.randn(rows, L, H, generator=g),
            "weight": torch.randn(V, H, generator=g) * (3.0 / math.sqrt(H)),
            "bias": torch.randn(V, generator=g) * 0.5 if bias else None,
            "ref": torch.randn(rows, generator=g) * 2.0 - 2.5 * cmask[:, 1:].sum(1).float(), "g": g}


def _model_for(d):
    """(the stand-in model, its hidden-state leaf) for a preference batch."""
    model = StandInLM(d["weight"], d["bias"])
    hidden = d["hidden"].clone().requires_grad_()
    model.register(d["input_ids"], hidden)
    return model, hidden


def _dpo_both(d, loss_types, loss_weights, *, beta, label_smoothing, discopop_tau):
    rows = d["input_ids"].shape[0]
    model, leaf = _model_for(d)
    ns = trainer_self(model, args=types.SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None),
                       ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                       loss_types=list(loss_types), loss_weights=list(loss_weights), beta=beta,
                       label_smoothing=label_smoothing, use_weighting=False)
    inputs = {"input_ids": d["input_ids"], "attention_mask": d["attention_mask"],
              "completion_mask": d["completion_mask"], "ref_chosen_logps": d["ref"][:rows // 2],
              "ref_rejected_logps": d["ref"][rows // 2:]}
    loss = DPOTrainer._compute_loss(ns, model, inputs, return_outputs=False)
    loss.backward()
    want = (loss.item(), _trl_metrics(ns), _grads(leaf, model))

    hidden, weight, *bias = _leaves(d["hidden"], d["weight"], d["bias"])
    targets = d["input_ids"][:, 1:].masked_fill(d["completion_mask"][:, 1:] == 0, -100)
    out = fht.fused_linear_preference_loss(hidden[:, :-1], weight, targets, d["completion_mask"][:, 1:],
                                           loss="dpo", loss_type=list(loss_types), loss_weights=list(loss_weights),
                                           beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                                           ref_logps=d["ref"], bias=bias[0] if bias else None)
    out.loss.backward()
    got = (out.loss.item(), out.metrics, [hidden.grad, weight.grad] + ([bias[0].grad] if bias else []))
    return got, want


@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_loss_type_matches_trl_compute_loss(loss_type):
    d = _pref_data(seed=DPO_TYPES.index(loss_type), rows=8, bias=loss_type in ("sigmoid", "ipo"))
    got, want = _dpo_both(d, [loss_type], [1.0], beta=0.2, label_smoothing=0.1, discopop_tau=0.05)
    _check(*got, *want)


@pytest.mark.parametrize("name", sorted(DPO_LISTS))
def test_dpo_weighted_list_matches_trl_compute_loss(name):
    types_, weights = DPO_LISTS[name]
    d = _pref_data(seed=100 + sorted(DPO_LISTS).index(name), rows=12)
    got, want = _dpo_both(d, types_, weights, beta=0.1, label_smoothing=0.05, discopop_tau=0.1)
    _check(*got, *want)


# --- KTO: KTOTrainer._compute_loss ---------------------------------------------------------------------------------

KTO_LABELS = torch.tensor([True, False, True, True, False, False, True])


@pytest.mark.parametrize("loss_type,desirable_weight,undesirable_weight,bias",
                         [("kto", 1.0, 1.0, False), ("kto", 1.33, 0.75, True), ("apo_zero_unpaired", 1.0, 1.0, False),
                          ("apo_zero_unpaired", 0.6, 1.4, False)])
def test_kto_matches_trl_compute_loss(loss_type, desirable_weight, undesirable_weight, bias):
    seed = 7 + int(desirable_weight * 10) + (loss_type == "kto")
    rows = len(KTO_LABELS)
    d = _pref_data(seed=seed, rows=rows, bias=bias)
    # the KL completions: each prompt with another row's completion (TRL's mismatched pairs), other hidden states
    kl = _pref_data(seed=seed + 1000, rows=rows, H=d["hidden"].shape[-1], V=d["weight"].shape[0], empty_last=False)
    calculate_kl = loss_type == "kto"
    beta = 0.15
    model, leaf = _model_for(d)
    model.register(kl["input_ids"], kl["hidden"])
    ns = trainer_self(model, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
                       calculate_KL=calculate_kl, loss_type=loss_type, beta=beta,
                       desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                       precompute_ref_logps=True)
    ns._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, ns)
    ref_kl = torch.randn(rows, generator=d["g"]) - 2.5 * kl["completion_mask"][:, 1:].sum(1).float()
    batch = {"input_ids": d["input_ids"], "attention_mask": d["attention_mask"],
             "completion_mask": d["completion_mask"], "label": KTO_LABELS.clone(), "ref_logps": d["ref"],
             "KL_input_ids": kl["input_ids"], "KL_attention_mask": kl["attention_mask"],
             "KL_completion_mask": kl["completion_mask"], "ref_KL_logps": ref_kl}
    loss = KTOTrainer._compute_loss(ns, model, batch, return_outputs=False)
    loss.backward()
    want = (loss.item(), _trl_metrics(ns), _grads(leaf, model))
    kl_logps = KTOTrainer._compute_kl_logps(ns, model, batch) if calculate_kl else None   # TRL's, no gradient

    hidden, weight, *b = _leaves(d["hidden"], d["weight"], d["bias"])
    targets = d["input_ids"][:, 1:].masked_fill(d["completion_mask"][:, 1:] == 0, -100)
    out = fht.fused_linear_kto_loss(hidden[:, :-1], weight, targets, d["completion_mask"][:, 1:], KTO_LABELS,
                                    loss_type=loss_type, beta=beta, desirable_weight=desirable_weight,
                                    undesirable_weight=undesirable_weight, ref_logps=d["ref"],
                                    kl_logratios=None if kl_logps is None else kl_logps - ref_kl,
                                    bias=b[0] if b else None)
    out.loss.backward()
    _check(out.loss.item(), out.metrics, [hidden.grad, weight.grad] + ([b[0].grad] if b else []), *want)


# --- GKD: GKDTrainer.generalized_jsd_loss --------------------------------------------------------------------------

@pytest.mark.parametrize("beta,temperature,reduction,num_items,teacher_h",
                         [(0.5, 1.0, "batchmean", None, 24), (0.0, 1.0, "batchmean", None, 24),
                          (1.0, 1.0, "batchmean", None, 24), (0.3, 2.0, "batchmean", None, 40),
                          (0.7, 0.8, "sum", None, 24), (0.5, 1.0, "batchmean", 37.0, 40),
                          (0.2, 1.5, "none", None, 24)])
def test_gkd_generalized_jsd_matches_trl(beta, temperature, reduction, num_items, teacher_h):
    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 7) + teacher_h)
    b, t, h, v = 3, 9, 24, 601
    hs, ws = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    bs = torch.randn(v, generator=g) * 0.3
    ht = torch.randn(b, t, teacher_h, generator=g)
    wt = torch.randn(v, teacher_h, generator=g) * (3.0 / math.sqrt(teacher_h))
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :3] = -100          # a masked prompt
    labels[2, 6:] = -100          # padding

    hs1, ws1, bs1 = _leaves(hs, ws, bs)
    want = GKDTrainer.generalized_jsd_loss(F.linear(hs1, ws1, bs1), F.linear(ht, wt), labels=labels, beta=beta,
                                           temperature=temperature, reduction=reduction,
                                           num_items_in_batch=None if num_items is None else torch.tensor(num_items))
    if reduction == "none":          # TRL: [valid tokens, V] per vocabulary entry; fusedhead: per token
        want = want.sum(-1)
        weights = torch.linspace(0.5, 1.5, want.numel())
        (want * weights).sum().backward()
    else:
        want.backward()

    hs2, ws2, bs2 = _leaves(hs, ws, bs)
    fh_reduction = {"batchmean": "mean", "sum": "sum", "none": "none"}[reduction]
    if num_items is not None:
        fh_reduction = "sum"
    got = fht.fused_linear_distillation_loss(hs2, ws2, ht, wt, labels, student_bias=bs2, divergence="jsd",
                                             beta=beta, temperature=temperature, reduction=fh_reduction)
    if num_items is not None:
        got = got / num_items
    if reduction == "none":
        got = got[labels != -100]
        assert torch.allclose(got.double(), want.detach().double(), rtol=LOSS_RTOL_F32, atol=LOSS_RTOL_F32)
        (got * weights).sum().backward()
    else:
        assert abs(got.item() - want.item()) <= LOSS_RTOL_F32 * max(abs(want.item()), 1.0), (got.item(), want.item())
        got.backward()
    for a, w in ((hs2, hs1), (ws2, ws1), (bs2, bs1)):
        assert normwise(a.grad.numpy(), w.grad.numpy()) <= GRAD_RTOL_F32


# --- IWOPD: IWOPDTrainer.generalized_jsd_loss over top-k supports -------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.3])
@pytest.mark.parametrize("top_k,add_tail,temperature", [(1, True, 1.0), (1, False, 0.7), (20, True, 0.7),
                                                        (20, False, 1.0), (256, True, 1.0), (256, False, 1.5)])
def test_iw_opd_topk_jsd_matches_trl(beta, top_k, add_tail, temperature):
    """trl/experimental/iw_opd/iw_opd_trainer.py's IWOPDTrainer.generalized_jsd_loss (static) with top_k and add_tail:
    the teacher's top-k for forward KL (beta 0), the student's for reverse KL (beta 1), their union for the JSD, the
    tail bucket or the renormalisation. TRL runs on float64 logits of the same fp32 values (its selection then sees no
    fp32 rounding; fusedhead selects on its fp32 logits: a tie within that rounding at the k-th place would differ,
    and these draws have none); batchmean over the labels' counted tokens."""
    with warnings.catch_warnings():  # TRLExperimentalWarning
        warnings.simplefilter("ignore")
        from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer
    g = torch.Generator().manual_seed(top_k * 13 + int(beta * 10) + int(add_tail))
    b, t, h, ht, v = 3, 9, 24, 40, 601
    hs, ws = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    bs = torch.randn(v, generator=g) * 0.3
    xt, wt = torch.randn(b, t, ht, generator=g), torch.randn(v, ht, generator=g) * (3.0 / math.sqrt(ht))
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :3] = -100          # a masked prompt
    labels[2, 6:] = -100          # padding

    hs1, ws1, bs1 = (a.double().requires_grad_() for a in (hs, ws, bs))
    want = IWOPDTrainer.generalized_jsd_loss(F.linear(hs1, ws1, bs1), F.linear(xt.double(), wt.double()),
                                             labels=labels, beta=beta, temperature=temperature, top_k=top_k,
                                             add_tail=add_tail)
    want.backward()

    hs2, ws2, bs2 = _leaves(hs, ws, bs)
    got = fht.fused_linear_distillation_loss(hs2, ws2, xt, wt, labels, student_bias=bs2, divergence="jsd",
                                             beta=beta, temperature=temperature, top_k=top_k, add_tail=add_tail)
    assert abs(got.item() - want.item()) <= LOSS_RTOL_F32 * max(abs(want.item()), 1.0), (got.item(), want.item())
    got.backward()
    for a, w in ((hs2, hs1), (ws2, ws1), (bs2, bs1)):
        assert normwise(a.grad.numpy(), w.grad.numpy()) <= GRAD_RTOL_F32


# --- DistillationTrainer: trl/trainer/distillation_trainer.py _chunked_divergence_loss ----------------------------

@pytest.mark.parametrize("beta,temperature,num_items,bias", [(1.0, 1.0, None, False), (0.0, 1.0, None, True),
                                                             (0.5, 0.7, None, True), (0.3, 1.5, 23.0, False)])
def test_distillation_trainer_loss_matches_trl(beta, temperature, num_items, bias):
    """What fusedhead.trl.fuse_loss computes for DistillationTrainer (the head on the completion positions, TRL's
    mask as ignore_index targets, the entropy metric from fused_linear_logprobs) against TRL's own
    _chunked_divergence_loss on the same hidden states: the loss, the student's gradients and the entropy sum."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 7))
    b, t, h, ht_, v = 3, 7, 24, 40, 601
    hs, ws = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    bs = torch.randn(v, generator=g) * 0.3 if bias else None
    ht = torch.randn(b, t, ht_, generator=g)
    wt = torch.randn(v, ht_, generator=g) * (3.0 / math.sqrt(ht_))
    bt = torch.randn(v, generator=g) * 0.3 if bias else None
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[1, 4:] = 0                                 # a completion that ended early (right padding)
    nib = None if num_items is None else torch.tensor(num_items)

    trl_leaves, fh_leaves = _leaves(hs, ws, bs), _leaves(hs, ws, bs)
    hs1, ws1, bs1 = (trl_leaves + [None])[:3]
    want, want_entropy, want_n = _chunked_divergence_loss(hs1, ht, ws1, wt, mask, beta, num_items_in_batch=nib,
                                                          student_lm_head_bias=bs1, teacher_lm_head_bias=bt,
                                                          temperature=temperature)
    want.backward()
    hs2, ws2, bs2 = (fh_leaves + [None])[:3]
    targets = ids.masked_fill(mask == 0, -100)
    got = fht.fused_linear_distillation_loss(hs2, ws2, ht, wt, targets, student_bias=bs2, teacher_bias=bt,
                                             divergence="jsd", beta=beta, temperature=temperature,
                                             reduction="mean" if nib is None else "sum")
    if nib is not None:
        got = got / nib
    got.backward()
    with torch.no_grad():
        _, entropy = fht.fused_linear_logprobs(hs, ws, targets, temperature, return_entropy=True, bias=bs)
    assert abs(got.item() - want.item()) <= LOSS_RTOL_F32 * max(abs(want.item()), 1.0), (got.item(), want.item())
    assert abs(entropy.sum().item() - want_entropy.item()) <= LOSS_RTOL_F32 * abs(want_entropy.item())
    assert int(want_n) == int((mask != 0).sum())
    for a, w in zip(fh_leaves, trl_leaves):
        assert normwise(a.grad.numpy(), w.grad.numpy()) <= GRAD_RTOL_F32
