#!/usr/bin/env python3
"""fusedhead against what a CPU user would run instead (issue 42): per head, one training step (forward and
backward to the hidden states and the lm_head weight) through fusedhead.torch and through every peer, at the same
shape, seeded data, dtype and threads.

Each case runs in a process of its own (peak memory does not mix; bench/bench_harness.py), torch.set_num_threads
(--threads) in every one and fusedhead's context at the same count; a warm-up step, then the best of --reps. The
cases of one head, dtype and shape alternate: --rounds rounds, each running every case once, in reverse order every
other round, so that a machine whose speed drifts favours none; reported: the best time over the rounds and the
largest peak. One-time set-up stays out of the measurement: compiled cases (torch.compile, Liger's chunked losses,
which compile their loss math) compile in a step before it, and their peak leaves out what compiling kept; the
fusedhead cases first run a 2-row step (the library's first call in a process starts OpenMP's threads and BLIS's
buffer pools, about 75 MiB once).

Reported per case: time per train step (ms), GFLOP/s on the 6*N*H*V basis (the logits GEMM and the two gradient
GEMMs; distillation's teacher forward, another 2*N*H_t*V, is not counted), peak RSS growth (MiB), the ratio to the
fastest peer (its time over the case's: above 1, faster than every peer) and the loss value (the cases of one head
compute the same loss on the same data, so the values agree to rounding where the semantics match). A peer that is
not installed, refuses the CPU or fails is a row of its own with the reason, never dropped.

Heads, cases and what each computes (N = --n tokens; sequence heads take T = --seq-len tokens per sequence, fewer
when N is smaller, and every token counts: no padding, so that each case does the same 6*N*H*V of work):
  ce        cross-entropy, mean over N tokens: F.cross_entropy(F.linear(h, W), y). Default dtypes fp32 and bf16.
    torch_eager              F.linear + F.cross_entropy: materializes [N, V] logits and their gradient
    torch_lce[auto]          torch's own F.linear_cross_entropy with LinearCrossEntropyOptions() (CPU defaults)
    torch_lce[batch_chunk_size=C]  the same over --chunk-row batch chunks
    torch_compile            torch.compile (inductor) of torch_eager's loss
    liger_flce               Liger's LigerFusedLinearCrossEntropyLoss (Triton kernels)
    trl_nll                  TRL's SFT loss (loss_type "nll", "chunked_nll" its deprecated alias): trl.kernels
                             ChunkedLogProbFunction over 32768-wide vocabulary tiles, -sum(log p) / N
    fusedhead                fusedhead.torch.fused_linear_cross_entropy
    fusedhead_compile        torch.compile(fullgraph=True) of a function calling it
    fusedhead[memory_budget=M MiB]  fusedhead with its context's memory_budget at --memory-budget M (every head;
                             run only when that option is given): the smaller workspace it trades time for
  logprobs  per-token log p(y) and entropy of softmax(h W^T), then -(sum log p + 0.01 sum entropy) / N
            (gradients through both, as GRPO's entropy bonus takes them)
    torch_eager              F.linear, log_softmax in fp32, gather and entropy on the [N, V] logits
    torch_compile            torch.compile of torch_eager's loss
    trl_logprob_entropy      TRL's per-token function that its GRPO calls through add_fused_lm_head:
                             ChunkedLogProbFunction(..., outputs=("entropy",))
    fusedhead                fusedhead.torch.fused_linear_logprobs(..., return_entropy=True)
  grpo      TRL GRPOTrainer's loss, loss_type "dapo", on-policy (old log-probs = the policy's, detached),
            beta 0 (no KL: GRPOConfig's default), epsilon 0.2, temperature 1, num_items_in_batch = N; B = N / T
            sequences, advantages standard normal (group-normalised rewards)
    liger_grpo               Liger's LigerFusedLinearGRPOLoss(beta=0, use_ref_model=False, loss_type="dapo"), its
                             defaults otherwise (chunk_size 1, compiled)
    trl_grpo                 TRL 1.16.0's GRPOTrainer._compute_loss itself, on a stand-in model with TRL's fused LM
                             head (python/tests/trl_standin.py; each sequence behind a one-token prompt)
    fusedhead                fusedhead.torch.fused_linear_grpo_loss(loss_type="dapo", beta=0)
  dpo       TRL DPOTrainer's loss, loss_type "sigmoid", beta 0.1, sequence log-probs summed over tokens,
            reference log-probs 0 (precomputed reference: no reference head in the step); B = N / (2T) pairs,
            chosen sequences then rejected ones
    liger_dpo                Liger's LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False, loss_type="sigmoid")
    fusedhead                fusedhead.torch.fused_linear_preference_loss(loss="dpo", loss_type="sigmoid")
  kto       TRL KTOTrainer's loss, loss_type "kto", beta 0.1, reference log-probs 0 and KL term 0; B = N / T
            sequences, every other one desirable
    liger_kto                Liger's LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=False), kl=None
    fusedhead                fusedhead.torch.fused_linear_kto_loss(ref_logps=0, kl=0)
  distill   generalized JSD (beta 0.5, temperature 1) of a student head towards a teacher head (the same H and V,
            the teacher detached) times 0.5, plus 0.5 times the student's cross-entropy, mean over N tokens
    liger_jsd                Liger's LigerFusedLinearJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5)
    fusedhead                fusedhead.torch.fused_linear_distillation_loss(divergence="jsd", beta=0.5,
                             weight_soft_loss=0.5, weight_hard_loss=0.5)

Peers' packages: torch 2.13 and TRL 1.16.0 (python/requirements-test.txt), Liger-Kernel (python/requirements-bench.txt,
installed by scripts/install-deps without its dependencies: it asks for triton, a GPU compiler, which its chunked
losses do not import; its LigerFusedLinearCrossEntropyLoss does, so that case reports the CPU refused).

Output: a markdown table per shape, dtype and head (--out DIR: peers.md, peers.json, and per shape PNG plots of time
and memory per case drawn with gnuplot, with their .dat and .gp files); --json prints the JSON to stdout instead of
the tables. Run with the venv's interpreter and the library built in build/ (or FUSEDHEAD_LIBRARY), e.g.
  .venv/bin/python bench/peers.py --out bench/results/peers            # every head at every shape (hours on 2 cores)
  .venv/bin/python bench/peers.py --shapes 64x64x512 --heads ce --reps 1 --rounds 1 --json   # a smoke run
scripts/bench-peers builds what is missing and runs this with its arguments.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import bench_harness as harness

SHAPES = ((1024, 1024, 32768), (512, 1536, 151643), (256, 2304, 262144), (8192, 1024, 32768))
HEADS = ("ce", "logprobs", "grpo", "dpo", "kto", "distill")
DEFAULT_DTYPES = {"ce": ("fp32", "bf16")}  # every other head: fp32
PEERS = {
    "ce": ("torch_eager", "torch_lce[auto]", "torch_lce[chunk]", "torch_compile", "liger_flce", "trl_nll",
           "fusedhead", "fusedhead[budget]", "fusedhead_compile"),
    "logprobs": ("torch_eager", "torch_compile", "trl_logprob_entropy", "fusedhead", "fusedhead[budget]"),
    "grpo": ("liger_grpo", "trl_grpo", "fusedhead", "fusedhead[budget]"),
    "dpo": ("liger_dpo", "fusedhead", "fusedhead[budget]"),
    "kto": ("liger_kto", "fusedhead", "fusedhead[budget]"),
    "distill": ("liger_jsd", "fusedhead", "fusedhead[budget]"),
}
ENTROPY_COEF = 0.01  # the logprobs head's loss: -(sum log p + ENTROPY_COEF sum entropy) / N
TESTS_DIR = os.path.join(harness.PYTHON_DIR, "tests")
REQUIREMENTS_BENCH = os.path.join(harness.PYTHON_DIR, "requirements-bench.txt")


class PeerUnavailable(Exception):
    """A peer that cannot run here: status "not installed" (its package is missing) or "refuses the CPU"."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status


def case_label(peer: str, args: argparse.Namespace) -> str:
    if peer == "torch_lce[chunk]":
        return f"torch_lce[batch_chunk_size={args.chunk}]"
    if peer == "fusedhead[budget]":
        return f"fusedhead[memory_budget={args.memory_budget} MiB]"
    return peer


def pip_hint(package: str) -> str:
    """The command that installs a peer's package at this project's pin (python/requirements-bench.txt)."""
    pin = package
    try:
        with open(REQUIREMENTS_BENCH) as f:
            pin = next((line.strip() for line in f if line.lower().startswith(package + "==")), package)
    except OSError:
        pass
    return f".venv/bin/pip install --no-deps {pin}"


def import_peer(module: str, package: str):
    """Imports a peer's module; a missing package (or a module it needs) becomes PeerUnavailable, saying which and
    how to install it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or "?"
        if missing == "triton":
            raise PeerUnavailable("refuses the CPU", f"{module} needs Triton, whose kernels run on GPUs only "
                                  f"({type(e).__name__}: {e})") from e
        raise PeerUnavailable("not installed", f"{type(e).__name__}: {e} (install: {pip_hint(package)})") from e


def sequences(head: str, n: int, seq_len: int) -> Tuple[int, int]:
    """(sequences, tokens per sequence) for a sequence head: T = min(seq_len, N) (DPO: N / 2, one pair at least),
    N a multiple of T."""
    t = min(seq_len, n // 2 if head == "dpo" else n)
    if t < 1 or n % t or (head == "dpo" and (n // t) % 2):
        raise SystemExit(f"peers: N={n} does not split into {head} sequences of {t} tokens (see --seq-len)")
    return n // t, t


# ---------------------------------------------------------------------------------------------------------------
# Data: one builder for every case of a head, in the case's process, from one seed. The CE head's inputs are
# bench/torch_compare.py's (hidden, weight, targets in that order from seed 0), so that its cases can be reused.
# ---------------------------------------------------------------------------------------------------------------
def make_data(args: argparse.Namespace) -> argparse.Namespace:
    import torch

    torch.manual_seed(0)
    n, h, v = args.n, args.hidden, args.vocab
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    d = argparse.Namespace(report={}, dtype=dtype)
    d.hidden = (torch.rand(n, h) * 2 - 1).to(dtype).requires_grad_(True)
    d.weight = ((torch.rand(v, h) * 2 - 1) * (3.0 / h) ** 0.5).to(dtype).requires_grad_(True)
    d.targets = torch.randint(0, v, (n,))
    if args.head in ("grpo", "dpo", "kto"):
        d.b, d.t = sequences(args.head, n, args.seq_len)
        d.hidden_bt = d.hidden.view(d.b, d.t, h)
        d.targets_bt = d.targets.view(d.b, d.t)
        d.mask = torch.ones(d.b, d.t, dtype=torch.int64)
        d.advantages = torch.randn(d.b)
        d.labels = torch.arange(d.b) % 2 == 0
    if args.head == "distill":
        d.teacher_hidden = (torch.rand(n, h) * 2 - 1).to(dtype)
        d.teacher_weight = ((torch.rand(v, h) * 2 - 1) * (3.0 / h) ** 0.5).to(dtype)
    # Gradient buffers exist before measuring: a trainer keeps them across steps.
    d.hidden.grad = torch.zeros_like(d.hidden)
    d.weight.grad = torch.zeros_like(d.weight)
    return d


def zero_grads(d: argparse.Namespace) -> Callable[[], None]:
    def zero() -> None:
        for t in d.leaves:
            if t.grad is not None:
                t.grad.zero_()
    return zero


def first(value):
    """The loss of a peer that returns (loss, extras...)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def backward_step(loss_fn: Callable[[], Any]) -> Callable[[], Any]:
    def step():
        loss = first(loss_fn())
        loss.backward()
        return loss
    return step


# ---------------------------------------------------------------------------------------------------------------
# Cases: (args, d) -> (step, note). The CE cases that bench/torch_compare.py has are its own functions.
# ---------------------------------------------------------------------------------------------------------------
def torch_compare_case(kind: str, lce: Optional[str] = None):
    def build(args, d):
        import torch_compare
        args.lce = lce if lce != "chunk" else f"batch_chunk_size={args.chunk}"
        return getattr(torch_compare, "case_" + kind)(args, d)
    return build


def trl_chunk_size() -> int:
    """The vocabulary tile TRL's trainers hand ChunkedLogProbFunction (trl/trainer/utils.py)."""
    utils = import_peer("trl.trainer.utils", "trl")
    return utils._CHUNKED_LOGPROB_CHUNK_SIZE


def ce_liger_flce(args, d):
    module = import_peer("liger_kernel.transformers.fused_linear_cross_entropy", "liger-kernel")
    loss_fn = module.LigerFusedLinearCrossEntropyLoss()
    return backward_step(lambda: loss_fn(d.weight, d.hidden, d.targets)), ""


def ce_trl_nll(args, d):
    kernels = import_peer("trl.kernels", "trl")
    chunk, n = trl_chunk_size(), d.targets.shape[0]

    def loss():
        logp = kernels.ChunkedLogProbFunction.apply(d.hidden, d.weight, None, d.targets, 1.0, chunk, None, 1.0, ())[0]
        return -logp.sum() / n
    return backward_step(loss), f"{chunk}-wide vocabulary tiles"


def logprobs_loss(logp, entropy, n: int):
    return -(logp.sum() + ENTROPY_COEF * entropy.sum()) / n


def logprobs_eager(h, w, y):
    import torch.nn.functional as F
    logp_all = F.linear(h, w).float().log_softmax(-1)
    logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs_loss(logp, entropy, y.shape[0])


def logprobs_torch_eager(args, d):
    return backward_step(lambda: logprobs_eager(d.hidden, d.weight, d.targets)), "fp32 log_softmax on the logits"


def logprobs_torch_compile(args, d):
    import torch
    compiled = torch.compile(logprobs_eager)
    step = backward_step(lambda: compiled(d.hidden, d.weight, d.targets))
    step()  # compiles
    return step, "inductor"


def logprobs_trl(args, d):
    kernels = import_peer("trl.kernels", "trl")
    chunk, n = trl_chunk_size(), d.targets.shape[0]

    def loss():
        logp, entropy = kernels.ChunkedLogProbFunction.apply(d.hidden, d.weight, None, d.targets, 1.0, chunk, None,
                                                             1.0, ("entropy",))[:2]
        return logprobs_loss(logp, entropy, n)
    return backward_step(loss), f"{chunk}-wide vocabulary tiles"


def logprobs_fusedhead(args, d):
    d.report.update(harness.fusedhead_setup(args.threads, d.dtype))
    from fusedhead.torch import fused_linear_logprobs
    n = d.targets.shape[0]
    return backward_step(lambda: logprobs_loss(*fused_linear_logprobs(d.hidden, d.weight, d.targets,
                                                                      return_entropy=True), n)), ""


def compile_first(step: Callable[[], Any]) -> Callable[[], Any]:
    """Runs a step whose loss compiles itself (Liger's chunked losses) once, before the measurement."""
    step()
    return step


def grpo_liger(args, d):
    module = import_peer("liger_kernel.chunked_loss", "liger-kernel")
    loss_fn = module.LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=0.2,
                                              epsilon_high=0.2, temperature=1.0)
    items = float(d.mask.sum())
    return compile_first(backward_step(lambda: loss_fn(d.hidden_bt, d.weight, d.targets_bt, d.mask, d.advantages,
                                                       num_items_in_batch=items))), "chunk_size 1, compiled"


def grpo_trl(args, d):
    import torch
    import_peer("trl", "trl")
    sys.path.insert(0, TESTS_DIR)
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl_standin import StandInLM, grpo_trainer_self

    # TRL's fused head scores position t of [prompt, completion] for token t + 1: a one-token prompt puts the
    # completion's N hidden states at positions 0 .. T - 1 (the last position is never scored on the CPU's path).
    hidden = torch.cat([d.hidden_bt.detach(), torch.zeros(d.b, 1, args.hidden, dtype=d.dtype)], 1)
    hidden.requires_grad_(True)
    hidden.grad = torch.zeros_like(hidden)
    d.leaves = [hidden, d.weight]
    model = StandInLM(d.weight, temperature=1.0, outputs=("log_probs", "entropy"), share_weight=True)
    prompt_ids = torch.zeros(d.b, 1, dtype=torch.int64)
    model.register(torch.cat([prompt_ids, d.targets_bt], 1), hidden)
    ns = grpo_trainer_self(model, loss_type="dapo", importance_sampling_level="token", epsilon=0.2,
                           epsilon_high=None, delta=None, beta=0.0, use_bias_correction_kl=False,
                           sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, max_completion_length=d.t,
                           entropy_coef=0.0, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                           use_vllm=False, vllm_importance_sampling_correction=False,
                           vespo=dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0))
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": d.targets_bt,
              "completion_mask": d.mask, "advantages": d.advantages,
              "num_items_in_batch": torch.tensor(float(d.mask.sum()))}
    return (backward_step(lambda: GRPOTrainer._compute_loss(ns, model, inputs)),
            f"ChunkedLogProbFunction, {trl_chunk_size()}-wide vocabulary tiles")


def grpo_fusedhead(args, d):
    d.report.update(harness.fusedhead_setup(args.threads, d.dtype))
    from fusedhead.torch import fused_linear_grpo_loss
    items = float(d.mask.sum())
    return backward_step(lambda: fused_linear_grpo_loss(d.hidden_bt, d.weight, d.targets_bt, d.mask, d.advantages,
                                                        loss_type="dapo", beta=0.0, epsilon=0.2,
                                                        num_items_in_batch=items)), ""


def dpo_liger(args, d):
    module = import_peer("liger_kernel.chunked_loss", "liger-kernel")
    loss_fn = module.LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False, compute_nll_loss=False,
                                             average_log_prob=False, loss_type="sigmoid")
    return compile_first(backward_step(lambda: loss_fn(d.weight, d.hidden_bt, d.targets_bt))), \
        "chunk_size 1, compiled"


def dpo_fusedhead(args, d):
    d.report.update(harness.fusedhead_setup(args.threads, d.dtype))
    from fusedhead.torch import fused_linear_preference_loss
    return backward_step(lambda: fused_linear_preference_loss(d.hidden_bt, d.weight, d.targets_bt, d.mask, loss="dpo",
                                                              loss_type="sigmoid", beta=0.1)), ""


def kto_liger(args, d):
    module = import_peer("liger_kernel.chunked_loss", "liger-kernel")
    loss_fn = module.LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=False)
    return compile_first(backward_step(lambda: loss_fn(d.hidden_bt, d.weight, d.targets_bt,
                                                       preference_labels=d.labels))), "chunk_size 1, compiled"


def kto_fusedhead(args, d):
    import torch
    d.report.update(harness.fusedhead_setup(args.threads, d.dtype))
    from fusedhead.torch import fused_linear_kto_loss
    ref = torch.zeros(d.b)
    return backward_step(lambda: fused_linear_kto_loss(d.hidden_bt, d.weight, d.targets_bt, d.mask, d.labels,
                                                       beta=0.1, ref_logps=ref, kl=0.0)), ""


def distill_liger(args, d):
    module = import_peer("liger_kernel.chunked_loss", "liger-kernel")
    loss_fn = module.LigerFusedLinearJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0)
    return compile_first(backward_step(lambda: loss_fn(d.hidden, d.weight, d.teacher_hidden, d.teacher_weight,
                                                       d.targets))), "chunk_size 1024, compiled"


def distill_fusedhead(args, d):
    d.report.update(harness.fusedhead_setup(args.threads, d.dtype))
    from fusedhead.torch import fused_linear_distillation_loss
    return backward_step(lambda: fused_linear_distillation_loss(
        d.hidden, d.weight, d.teacher_hidden, d.teacher_weight, d.targets, divergence="jsd", beta=0.5,
        temperature=1.0, weight_soft_loss=0.5, weight_hard_loss=0.5)), ""


CASES: Dict[Tuple[str, str], Callable] = {
    ("ce", "torch_eager"): torch_compare_case("torch_eager"),
    ("ce", "torch_lce[auto]"): torch_compare_case("torch_lce", "auto"),
    ("ce", "torch_lce[chunk]"): torch_compare_case("torch_lce", "chunk"),
    ("ce", "torch_compile"): torch_compare_case("torch_compile"),
    ("ce", "liger_flce"): ce_liger_flce,
    ("ce", "trl_nll"): ce_trl_nll,
    ("ce", "fusedhead"): torch_compare_case("fusedhead"),
    ("ce", "fusedhead_compile"): torch_compare_case("fusedhead_compile"),
    ("logprobs", "torch_eager"): logprobs_torch_eager,
    ("logprobs", "torch_compile"): logprobs_torch_compile,
    ("logprobs", "trl_logprob_entropy"): logprobs_trl,
    ("logprobs", "fusedhead"): logprobs_fusedhead,
    ("grpo", "liger_grpo"): grpo_liger,
    ("grpo", "trl_grpo"): grpo_trl,
    ("grpo", "fusedhead"): grpo_fusedhead,
    ("dpo", "liger_dpo"): dpo_liger,
    ("dpo", "fusedhead"): dpo_fusedhead,
    ("kto", "liger_kto"): kto_liger,
    ("kto", "fusedhead"): kto_fusedhead,
    ("distill", "liger_jsd"): distill_liger,
    ("distill", "fusedhead"): distill_fusedhead,
}


def run_case(args: argparse.Namespace) -> None:
    """The case process: builds the data and the case, measures it, prints one JSON line (a failure too)."""
    import torch

    torch.set_num_threads(args.threads)
    result: Dict[str, Any] = {"case": case_label(args.case, args), "status": "ok"}
    budget = args.case == "fusedhead[budget]"
    try:
        d = make_data(args)
        d.leaves = [d.hidden, d.weight]
        step, note = CASES[(args.head, "fusedhead" if budget else args.case)](args, d)
        if budget:  # after the case's set-up step, which sets the default context's threads
            import fusedhead
            fusedhead.set_default_context_settings(memory_budget=args.memory_budget << 20)
        result.update(harness.measure(step, args.reps, zero_grads(d)))
        result.update(note=note() if callable(note) else note, threads=torch.get_num_threads(), **d.report)
    except PeerUnavailable as e:
        result.update(status=e.status, error=str(e))
    except Exception as e:  # a peer that fails on the CPU is a result, not a crash of the benchmark
        traceback.print_exc()
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result.update(status="failed", error=f"{type(e).__name__}: {message}"[:300])
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Driver: the cases of each shape, dtype and head, alternating over rounds; tables, JSON, plots.
# ---------------------------------------------------------------------------------------------------------------
def run_block(args: argparse.Namespace, shape: Tuple[int, int, int], dtype: str, head: str,
              env: Dict[str, str]) -> Dict[str, Any]:
    n, h, v = shape
    peers = [p for p in PEERS[head] if (args.memory_budget is not None or p != "fusedhead[budget]") and
             (not args.peers or p in args.peers or case_label(p, args) in args.peers)]
    rows: Dict[str, Dict[str, Any]] = {}
    for rnd in range(args.rounds):
        for peer in (peers if rnd % 2 == 0 else list(reversed(peers))):
            label = case_label(peer, args)
            if label in rows and rows[label]["status"] != "ok":
                continue  # a peer that cannot run does not get better in the next round
            cmd = [sys.executable, os.path.abspath(__file__), "--case", peer, "--head", head, f"--n={n}",
                   f"--hidden={h}", f"--vocab={v}", f"--dtype={dtype}", f"--threads={args.threads}",
                   f"--reps={args.reps}", f"--chunk={args.chunk}", f"--seq-len={args.seq_len}"]
            if args.memory_budget is not None:
                cmd.append(f"--memory-budget={args.memory_budget}")
            result, error = harness.run_case_process(
                cmd, dict(os.environ) if peer.startswith("fusedhead") else env, args.case_timeout)
            if result is None:
                result = {"case": label, "status": "failed", "error": error}
            if not args.json:
                print(f"  {head} {dtype} N={n} H={h} V={v} round {rnd + 1}: {label}: " + (
                    f"{result['best_ms']:.1f} ms" if result["status"] == "ok" else
                    f"{result['status']}: {result.get('error', '')}"), file=sys.stderr, flush=True)
            old = rows.get(label)
            if old is None or result["status"] != "ok":
                rows[label] = result
            else:
                old["best_ms"] = min(old["best_ms"], result["best_ms"])
                old["peak_rss_growth_bytes"] = max(old["peak_rss_growth_bytes"], result["peak_rss_growth_bytes"])
    cases = [rows[case_label(p, args)] for p in peers]
    block: Dict[str, Any] = {"head": head, "dtype": dtype, "n": n, "hidden": h, "vocab": v, "threads": args.threads,
                             "reps": args.reps, "rounds": args.rounds, "cases": cases}
    if head in ("grpo", "dpo", "kto"):
        block["sequences"], block["tokens_per_sequence"] = sequences(head, n, args.seq_len)
    flops = 6.0 * n * h * v
    peer_times = [r["best_ms"] for r in cases if r["status"] == "ok" and not r["case"].startswith("fusedhead")]
    fastest = min(peer_times) if peer_times else None
    for r in cases:
        for key in ("fusedhead_library", "fusedhead_kernels"):
            if key in r:
                block[key] = r.pop(key)
        if r["status"] == "ok":
            r["gflops"] = flops / (r["best_ms"] * 1e6)
            r["vs_fastest_peer"] = fastest / r["best_ms"] if fastest else None
    return block


def table(block: Dict[str, Any]) -> str:
    """One block as a markdown table."""
    seq = (f", {block['sequences']} sequences of {block['tokens_per_sequence']} tokens"
           if "sequences" in block else "")
    lines = [f"### {block['head']}, {block['dtype']}, N={block['n']} H={block['hidden']} V={block['vocab']}{seq}",
             "", "| case | ms | GFLOP/s | peak RSS + MiB | vs fastest peer | loss | note |",
             "|---|---|---|---|---|---|---|"]
    for r in block["cases"]:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | — | — | — | — | — | **{r['status']}**: {r.get('error', '')} |")
            continue
        ratio = f"{r['vs_fastest_peer']:.2f}×" if r.get("vs_fastest_peer") else "—"
        loss = f"{r['loss']:.6g}" if r.get("loss") is not None else "—"
        lines.append(f"| {r['case']} | {r['best_ms']:.1f} | {r['gflops']:.1f} | "
                     f"{r['peak_rss_growth_bytes'] / 2**20:.1f} | {ratio} | {loss} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def header(report: Dict[str, Any]) -> str:
    return (f"peers: {report['date']}, {report['cpu']}, {report['threads']} threads, best of {report['reps']} "
            f"after a warm-up, {report['rounds']} round(s) alternating\n"
            f"torch {report['torch_version']} ({report['python']}): {report['torch_gemm']}\n"
            f"fusedhead {report.get('fusedhead_library', '(not run)')}: {report.get('fusedhead_kernels', '')}\n"
            f"packages: {', '.join(f'{k} {v}' for k, v in report['packages'].items())}\n")


def package_versions() -> Dict[str, str]:
    from importlib import metadata
    versions = {}
    for name in ("torch", "trl", "transformers", "liger-kernel", "triton"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def plot(out: str, report: Dict[str, Any]) -> List[str]:
    """Per shape, two PNGs drawn by gnuplot (time and peak RSS growth per case, one bar per head, dtype and case,
    fusedhead's bars in a colour of their own); returns the files written, or none where gnuplot is missing."""
    gnuplot = shutil.which("gnuplot")
    written: List[str] = []
    for n, h, v in report["shapes"]:
        name = f"peers_{n}x{h}x{v}"  # the .gp files name their .dat and .png relative to out (gnuplot runs there)
        stem = os.path.join(out, name)
        rows = []
        for b in report["blocks"]:
            if (b["n"], b["hidden"], b["vocab"]) != (n, h, v):
                continue
            for r in b["cases"]:
                ok = r["status"] == "ok"
                rows.append((f"{b['head']} {b['dtype']}: {r['case']}", r["best_ms"] if ok else float("nan"),
                             r["peak_rss_growth_bytes"] / 2**20 if ok else float("nan"),
                             1 if r["case"].startswith("fusedhead") else 0))
        if not rows:
            continue
        with open(stem + ".dat", "w") as f:
            f.write("# case\tms\tpeak_rss_growth_MiB\tfusedhead\n")
            for label, ms, mib, fh in rows:
                f.write(f"\"{label}\"\t{ms}\t{mib}\t{fh}\n")
        for what, column, ylabel, log in (("time", 2, "ms per train step (log scale)", True),
                                          ("memory", 3, "peak RSS growth, MiB", False)):
            gp = f"{stem}_{what}.gp"
            with open(gp, "w") as f:
                f.write(f"""set terminal pngcairo size {max(900, 40 * len(rows) + 200)},700 font ",10"
set output "{name}_{what}.png"
set title "fusedhead and peers: N={n} H={h} V={v}, {report['threads']} threads ({what}; gaps: peer not run)" noenhanced
set style fill solid 0.8 border -1
set boxwidth 0.7
set xtics rotate by -60 noenhanced
set bmargin 14
set rmargin 12
set ylabel "{ylabel}"
set grid ytics
{"set logscale y" if log else "set yrange [0:*]"}
set datafile missing "nan"
set key off
plot "{name}.dat" using 0:{column}:($4 > 0 ? 0xd62728 : 0x1f77b4):xtic(1) with boxes lc rgb variable
""")
            if gnuplot:
                subprocess.run([gnuplot, os.path.basename(gp)], check=True, cwd=out)
                written.append(f"{stem}_{what}.png")
    if not gnuplot:
        print("peers: no gnuplot on PATH (Debian: gnuplot-nox): .gp and .dat written, no PNG", file=sys.stderr)
    return written


def parse_shape(text: str) -> Tuple[int, int, int]:
    try:
        n, h, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NxHxV (e.g. 1024x1024x32768)")
    return n, h, v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=list(SHAPES), metavar="NxHxV",
                   help="shapes to run (default: " + " ".join("x".join(map(str, s)) for s in SHAPES) + ")")
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="heads to run (default: all)")
    p.add_argument("--peers", nargs="+", metavar="CASE",
                   help="only these cases (names as in the tables, e.g. fusedhead liger_grpo); default: all")
    p.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"),
                   help="dtypes for every head (default: fp32 and bf16 for ce, fp32 for the others)")
    p.add_argument("--threads", type=int, default=2, help="torch's and fusedhead's threads in every case (default 2)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per case process, after a warm-up (default 3)")
    p.add_argument("--rounds", type=int, default=2,
                   help="processes per case, alternating with the other cases of the head (default 2)")
    p.add_argument("--chunk", type=int, default=256, help="torch_lce's batch chunk in rows (default 256)")
    p.add_argument("--memory-budget", type=int, metavar="MIB",
                   help="also run fusedhead with its context's memory_budget at MIB MiB: fusedhead[memory_budget=...]")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per sequence of the grpo, dpo and kto heads (default 256; fewer when N is smaller)")
    p.add_argument("--case-timeout", type=float, help="seconds before a case process is stopped and reported failed")
    p.add_argument("--out", help="folder for peers.md, peers.json and the PNG plots (created)")
    p.add_argument("--json", action="store_true", help="print the JSON report to stdout instead of the tables")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--head", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        args.dtype = args.dtype[0]
        if args.case.startswith("fusedhead"):
            harness.import_fusedhead()
        run_case(args)
        return
    try:
        import torch
    except ImportError:
        sys.exit("peers: PyTorch is not installed for this interpreter (run it with the project's .venv)")
    gemm, blis = harness.torch_gemm(torch)
    env = harness.torch_env(args.threads, blis)
    report: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": harness.cpu_model(),
        "threads": args.threads, "reps": args.reps, "rounds": args.rounds, "torch_version": torch.__version__,
        "python": sys.executable, "torch_gemm": gemm, "packages": package_versions(),
        "shapes": [list(s) for s in args.shapes], "blocks": []}
    for shape in args.shapes:
        for head in args.heads:
            for dtype in args.dtype or DEFAULT_DTYPES.get(head, ("fp32",)):
                block = run_block(args, shape, dtype, head, env)
                for key in ("fusedhead_library", "fusedhead_kernels"):
                    if key in block:
                        report[key] = block.pop(key)
                report["blocks"].append(block)
                if not args.json:
                    print(table(block), flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(header(report))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(args.out, "peers.md"), "w") as f:
            f.write(header(report) + "\n" + "\n".join(table(b) for b in report["blocks"]))
        written = plot(args.out, report)
        print(f"peers: wrote {args.out}/peers.md, peers.json" + (f", {len(written)} PNG" if written else ""),
              file=sys.stderr)


if __name__ == "__main__":
    main()
