"""TRL's trainers end to end (TRL 1.16.0, python/requirements-test.txt), stock and with fusedhead on the same model,
data and seed: SFTTrainer (nll, dft, completion-only, packed), DPOTrainer, KTOTrainer and RLOOTrainer (with
generation) through fusedhead.trl.patch() (their losses are built from TRL's per-token function), GRPOTrainer with
generation through patch() and through fuse_loss() (the whole loss on fused_linear_grpo_loss), DistillationTrainer
(on-policy generation) and GKDTrainer with a teacher through fuse_loss() (fused_linear_distillation_loss).

Each run: a Llama from a small config (random init, fp32: bf16=False, where TRL's default is bf16 autocast), 2
optimizer steps, CPU. Step 0's logged loss, gradient norm and metrics agree with stock within 1e-5 relative
(LOSS_RTOL_F32; 1e-5 absolute for values near 0); step 1 (after one update computed from slightly different
gradients) within 1e-4 relative: two stock runs agree exactly on this machine (same seed, deterministic CPU kernels),
so a drift between stock runs gives no looser bound. examples/trl_with_fusedhead.py runs 10 steps of each and prints
the per-step differences.
"""
from __future__ import annotations

import copy
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="python/requirements-test.txt installs transformers")
trl = pytest.importorskip("trl", reason="trl not importable (python/requirements-test.txt installs it)")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft", reason="python/requirements-test.txt installs peft")

import fusedhead.trl as fhtrl  # noqa: E402
from conftest import LOSS_RTOL_F32  # noqa: E402

V = 4096
STEPS = 2


@pytest.fixture(autouse=True)
def unpatched():
    fhtrl.unpatch()
    yield
    fhtrl.unpatch()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t1", eos_token="t2", unk_token="t0")


def model(seed=0, layers=2, hidden=64):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=1, eos_token_id=2, bos_token_id=0))


def words(g, lo, hi):
    n = int(torch.randint(lo, hi + 1, (1,), generator=g))
    return " ".join(f"t{i}" for i in torch.randint(3, V, (n,), generator=g).tolist())


def sft_data(rows=8):
    """Tokenized rows of 10 to 17 tokens whose first 4 (the prompt) are masked out of the loss."""
    g = torch.Generator().manual_seed(10)
    ids = [torch.randint(3, V, (10 + i,), generator=g).tolist() for i in range(rows)]
    mask = [[0] * 4 + [1] * (len(r) - 4) for r in ids]
    return datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": mask})


def preference_data(rows=8):
    g = torch.Generator().manual_seed(11)
    return datasets.Dataset.from_dict({"prompt": [words(g, 2, 5) for _ in range(rows)],
                                       "chosen": [words(g, 3, 8) for _ in range(rows)],
                                       "rejected": [words(g, 3, 8) for _ in range(rows)]})


def kto_data(rows=8):
    g = torch.Generator().manual_seed(12)
    return datasets.Dataset.from_dict({"prompt": [words(g, 2, 5) for _ in range(rows)],
                                       "completion": [words(g, 3, 8) for _ in range(rows)],
                                       "label": [i % 3 != 0 for i in range(rows)]})


def prompt_data(rows=8):
    g = torch.Generator().manual_seed(13)
    return datasets.Dataset.from_dict({"prompt": [words(g, 2, 5) for _ in range(rows)]})


def reward_len_parity(completions, **kwargs):
    """A trivial reward: how many of a completion's tokens have an even id."""
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


class _IdsCollator:
    """GKD's batches from token ids (TRL's ChatML collator needs a chat template): input_ids, attention_mask and
    labels with the prompt and padding at -100."""

    def __init__(self, pad_id=1):
        self.pad_id = pad_id

    def __call__(self, rows):
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), self.pad_id)
        attention = torch.zeros(len(rows), n, dtype=torch.int64)
        labels = torch.full((len(rows), n), -100)
        for i, r in enumerate(rows):
            k, p = len(r["input_ids"]), r["prompt_len"]
            ids[i, :k] = torch.tensor(r["input_ids"])
            attention[i, :k] = 1
            labels[i, p:k] = ids[i, p:k]
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def gkd_data(rows=8):
    g = torch.Generator().manual_seed(14)
    data = {"input_ids": [], "prompt_len": []}
    for _ in range(rows):
        p, c = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
        data["input_ids"].append(torch.randint(3, V, (p + c,), generator=g).tolist())
        data["prompt_len"].append(p)
    return datasets.Dataset.from_dict(data)


COMMON = dict(max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
              seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False)


def make_trainer(kind, base, out, teacher=None, **overrides):
    """A TRL trainer of the given kind on a copy of base (and of teacher), its config from COMMON and overrides.
    The copy's config names a local directory holding base, from which TRL loads its reference model (DPO, KTO,
    GRPO with beta != 0: no Hub)."""
    tok = tokenizer()
    policy = copy.deepcopy(base)
    policy.save_pretrained(f"{out}/base")
    policy.config._name_or_path = f"{out}/base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning (GKD), deprecations of TrainingArguments' names
        if kind == "sft":
            args = trl.SFTConfig(output_dir=out, **{**COMMON, "per_device_train_batch_size": 4,
                                                    "completion_only_loss": True, "max_length": None, **overrides})
            return trl.SFTTrainer(model=policy, args=args, train_dataset=sft_data(), processing_class=tok)
        if kind == "dpo":
            args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=4, beta=0.1,
                                 **dict(COMMON, **overrides))
            return trl.DPOTrainer(model=policy, args=args, train_dataset=preference_data(),
                                  processing_class=tok)
        if kind == "kto":
            args = trl.KTOConfig(output_dir=out, per_device_train_batch_size=4, beta=0.1,
                                 **dict(COMMON, **overrides))
            return trl.KTOTrainer(model=policy, args=args, train_dataset=kto_data(),
                                  processing_class=tok)
        if kind == "grpo":
            peft_config = overrides.pop("peft_config", None)
            args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2,
                                  max_completion_length=5, temperature=1.0, **dict(COMMON, **overrides))
            return trl.GRPOTrainer(model=policy, reward_funcs=reward_len_parity, args=args,
                                   train_dataset=prompt_data(), processing_class=tok, peft_config=peft_config)
        if kind == "rloo":
            args = trl.RLOOConfig(output_dir=out, **{**COMMON, "per_device_train_batch_size": 4, "num_generations": 2,
                                                     "max_completion_length": 5, **overrides})
            return trl.RLOOTrainer(model=policy, reward_funcs=reward_len_parity, args=args,
                                   train_dataset=prompt_data(), processing_class=tok)
        if kind == "distill":
            args = trl.DistillationConfig(output_dir=out, per_device_train_batch_size=4, max_completion_length=5,
                                          **dict(COMMON, **overrides))
            return trl.DistillationTrainer(model=policy, teacher_model=copy.deepcopy(teacher), args=args,
                                           train_dataset=prompt_data(), processing_class=tok)
        if kind == "gkd":
            from trl.experimental.gkd import GKDConfig, GKDTrainer
            args = GKDConfig(output_dir=out, per_device_train_batch_size=4, lmbda=0.0, beta=0.5,
                             **dict(COMMON, **overrides))
            return GKDTrainer(model=policy, teacher_model=copy.deepcopy(teacher), args=args,
                              train_dataset=gkd_data(), processing_class=tok, data_collator=_IdsCollator())
    raise ValueError(kind)


def run(kind, base, route, teacher=None, **overrides):
    """The logged history of STEPS steps: route None (stock), "patch" (fusedhead.trl.patch(strict=True)) or
    "fuse_loss" (fusedhead.trl.fuse_loss(trainer, strict=True))."""
    with tempfile.TemporaryDirectory() as d:
        if route == "patch":
            fhtrl.patch(strict=True)
        torch.manual_seed(0)  # the same PEFT adapters' initialisation in every run
        trainer = make_trainer(kind, base, d, teacher, **overrides)
        if route == "fuse_loss":
            fhtrl.fuse_loss(trainer, strict=True)
        trainer.train()
        fhtrl.unpatch()
    return [h for h in trainer.state.log_history if "loss" in h]


def logged_keys(step):
    """The logged values of a step compared with stock: all but the step counters, timings and spreads."""
    return sorted(k for k in step if k not in ("epoch", "step", "learning_rate", "num_tokens")
                  and not k.startswith("profiling") and "time" not in k and "/std" not in k)


def compare(stock, fused, keys=None):
    assert len(stock) == len(fused) == STEPS
    keys = keys or logged_keys(stock[0])
    assert set(keys) <= set(fused[0]), sorted(set(keys) - set(fused[0]))
    for k in keys:
        a, b = stock[0][k], fused[0][k]
        assert abs(a - b) <= LOSS_RTOL_F32 * max(abs(a), 1.0), (k, a, b)
    a, b = stock[1]["loss"], fused[1]["loss"]
    assert abs(a - b) <= 1e-4 * max(abs(a), 1e-2), ("step 1 loss", a, b)
    return keys


SFT_PACKED = dict(loss_type="nll", packing=True, max_length=32)
# RLOO with groups split over two steps, the second off-policy (test_rloo_trainer_with_generation_patched_matches_stock)
RLOO_SPLIT = dict(per_device_train_batch_size=2, steps_per_generation=2, learning_rate=2e-5)


@pytest.mark.parametrize("options", [dict(loss_type="nll"), dict(loss_type="dft"), SFT_PACKED])
def test_sft_trainer_patched_matches_stock(options):
    """SFTTrainer, completion-only loss (a masked prompt). Unpacked: padded batches. packing=True (TRL 1.16.0's
    default strategy, bfd, turns padding_free on: each batch is one row of several sequences with their
    position_ids; the attention transformers builds from them is the same in both runs)."""
    base = model()
    keys = compare(run("sft", base, None, **options), run("sft", base, "patch", **options))
    assert {"grad_norm", "entropy", "mean_token_accuracy"} <= set(keys)


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["sigmoid", "bco_pair", "sft"]])
def test_dpo_trainer_patched_matches_stock(loss_type):
    base = model()
    keys = compare(run("dpo", base, None, loss_type=loss_type), run("dpo", base, "patch", loss_type=loss_type))
    assert {"rewards/margins", "logps/chosen", "logits/chosen", "entropy", "mean_token_accuracy"} <= set(keys)


def test_kto_trainer_patched_matches_stock():
    base = model()
    keys = compare(run("kto", base, None), run("kto", base, "patch"))
    assert {"kl", "rewards/chosen", "logps/rejected", "logits/chosen", "entropy"} <= set(keys)


# LoRA on the attention projections (not the head): fuse_loss takes the backbone inside PEFT's wrappers
LORA_ON_ATTENTION = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.mark.parametrize("route,options", [("patch", {}), ("fuse_loss", {}),
                                           ("fuse_loss", dict(loss_type="grpo", beta=0.05, entropy_coef=0.01,
                                                              num_iterations=2, epsilon=0.05)),
                                           ("fuse_loss", dict(loss_type="dapo", entropy_coef=0.05,
                                                              gradient_accumulation_steps=2)),
                                           ("fuse_loss", dict(loss_type="luspo", entropy_coef=0.02)),
                                           ("fuse_loss", dict(peft_config=LORA_ON_ATTENTION))])
def test_grpo_trainer_with_generation_matches_stock(route, options):
    """Generation (sampling, 5 new tokens) from the same weights and seed: the same completions at step 0.
    num_iterations=2: step 1 reuses step 0's completions with the updated policy, so old_per_token_logps (computed
    through TRL's per-token function) differ from the current ones and the clipped objective is off-policy.
    dapo with 2 accumulation steps: num_items_in_batch spans both micro-batches while TRL 1.16.0 divides the entropy
    bonus by each micro-batch's token count and the steps. luspo at the token level (TRL's default): each sequence's
    masked sum, with ragged completions. LoRA on the attention: the adapters' gradients through the fused loss."""
    base = model()
    keys = compare(run("grpo", base, None, **options), run("grpo", base, route, **options))
    assert {"reward", "entropy", "clip_ratio/region_mean", "completions/mean_length"} <= set(keys)
    if options.get("beta"):
        assert "kl" in keys


@pytest.mark.parametrize("options", [{}, RLOO_SPLIT])
def test_rloo_trainer_with_generation_patched_matches_stock(options):
    """RLOOTrainer (trl/trainer/rloo_trainer.py at 1.16.0) through patch(): its loss is built from the per-token
    log-probs (policy, and old and reference ones at generation). On-policy with whole groups in a batch the
    leave-one-out advantages sum to 0 and so does the loss: the gradient norm and the entropy carry the comparison.
    With steps_per_generation=2 and batches of 2 the generated batch is shuffled and split into two steps, so groups
    are split (a loss that is not 0) and step 1 trains on completions sampled before step 0's update: an off-policy
    ratio (a learning rate of 2e-5 keeps it inside TRL's clip range, 1 +- 0.2, where the gradient is not 0)."""
    base = model()
    keys = compare(run("rloo", base, None, **options), run("rloo", base, "patch", **options))
    assert {"grad_norm", "reward", "entropy", "kl", "clip_ratio/region_mean"} <= set(keys)


@pytest.mark.parametrize("options", [{}, dict(beta=0.5, temperature=0.7, gradient_accumulation_steps=2)])
def test_distillation_trainer_fused_matches_stock(options):
    """DistillationTrainer (trl/trainer/distillation_trainer.py at 1.16.0) with on-policy generation from the student
    and a teacher of another size, through fuse_loss(): TRL's default beta 1 (reverse KL), and the generalized JSD
    at beta 0.5 with temperature 0.7 and two accumulation steps (num_items_in_batch spans the generated batch)."""
    base, teacher = model(seed=0), model(seed=1, layers=3, hidden=96)
    keys = compare(run("distill", base, None, teacher=teacher, **options),
                   run("distill", base, "fuse_loss", teacher=teacher, **options))
    assert {"grad_norm", "entropy", "completions/mean_length"} <= set(keys)


def test_gkd_trainer_fused_matches_stock():
    base, teacher = model(seed=0), model(seed=1, layers=3, hidden=96)
    compare(run("gkd", base, None, teacher=teacher), run("gkd", base, "fuse_loss", teacher=teacher))


def test_fuse_loss_refuses_loudly():
    base = model()
    with tempfile.TemporaryDirectory() as d:
        trainer = make_trainer("dpo", base, d)
        with pytest.raises(TypeError, match="patch"):
            fhtrl.fuse_loss(trainer)
        # RLOO's ratio exponentiates each sequence's summed log-ratio (GRPO's head: per token, or GSPO's mean);
        # subclasses with their own loss: fuse_loss looks at the class only, so uninitialised instances suffice
        from trl.experimental.gmpo import GMPOTrainer
        from trl.experimental.server_distillation import ServerDistillationTrainer
        for cls, what in ((trl.RLOOTrainer, "no whole-loss"), (GMPOTrainer, "overrides GRPOTrainer's _compute_loss"),
                          (ServerDistillationTrainer, "overrides DistillationTrainer's compute_loss")):
            with pytest.raises(TypeError, match=what):
                fhtrl.fuse_loss(cls.__new__(cls))
        trainer = make_trainer("grpo", base, d, max_steps=1, use_adaptive_entropy=True)
        fhtrl.fuse_loss(trainer, strict=True)
        with pytest.raises(fhtrl.NotRoutedError, match="use_adaptive_entropy"):
            trainer.train()
        fhtrl.fuse_loss(trainer, strict=False)
        with pytest.warns(fhtrl.RoutingWarning, match="use_adaptive_entropy"):
            trainer.train()
