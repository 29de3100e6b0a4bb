#!/usr/bin/env python3
"""Trains a small Hugging Face causal LM (built from its config class, random weights) with transformers.Trainer twice
on the same batches: stock, and with fusedhead.transformers.patch (the training loss through fusedhead, no [N, V]
logits). Prints each step's loss and gradient norm (as the Trainer logs them) for both runs with their relative
differences, the peak memory growth of each run (resident set size: its high-water mark during training minus the
RSS before it), and the median time per optimizer step.

    FUSEDHEAD_LIBRARY=$PWD/build/libfusedhead.so PYTHONPATH=python .venv/bin/python \\
        examples/train_hf_with_fusedhead.py --family llama --steps 30

Each run is a subprocess of its own (this script with --worker stock|fused), so that neither run's memory counts in
the other's peak. Text: the Python standard library's sources (/usr/lib/python3*/ or this interpreter's), split into
words and punctuation; the --vocab - 1 most common pieces are the vocabulary, the rest one unknown id. Each sequence's
first --masked-prefix labels are -100 (a prompt), so num_items_in_batch (passed by the Trainer under gradient
accumulation) differs from the token count.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

HEADS = 4


def _common(a: argparse.Namespace) -> dict[str, Any]:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=a.seq)


# family -> its config from (the transformers module, the arguments): one per class of docs/transformers.md's table.
# head_dim is given where the class's default is not hidden / heads; dropout is off.
FAMILIES: dict[str, Callable[[ModuleType, argparse.Namespace], Any]] = {
    "llama": lambda tr, a: tr.LlamaConfig(**_common(a)),
    "mistral": lambda tr, a: tr.MistralConfig(**_common(a)),
    "qwen2": lambda tr, a: tr.Qwen2Config(**_common(a)),
    "qwen3": lambda tr, a: tr.Qwen3Config(**_common(a), head_dim=a.hidden // HEADS),
    "gemma": lambda tr, a: tr.GemmaConfig(**_common(a), head_dim=a.hidden // HEADS),           # tied, no softcap
    "gemma2": lambda tr, a: tr.Gemma2Config(**_common(a), head_dim=a.hidden // HEADS),         # tied, softcap 30
    # text-only Gemma3ForCausalLM, tied; Gemma3TextConfig's final_logit_softcapping defaults to None (off) and the
    # model applies it when set: Gemma 2's 30 here, so that a softcapped head is trained
    "gemma3": lambda tr, a: tr.Gemma3TextConfig(**_common(a), head_dim=a.hidden // HEADS, final_logit_softcapping=30.0),
    "cohere": lambda tr, a: tr.CohereConfig(**_common(a)),                                     # logit_scale 0.0625
    "granite": lambda tr, a: tr.GraniteConfig(**_common(a), logits_scaling=4.0),
    "phi": lambda tr, a: tr.PhiConfig(**_common(a), resid_pdrop=0.0, embd_pdrop=0.0),          # lm_head with a bias
    "gpt2": lambda tr, a: tr.GPT2Config(vocab_size=a.vocab, n_embd=a.hidden, n_layer=a.layers, n_head=HEADS,
                                        n_positions=a.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # tied
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=(*FAMILIES, "all"), default="llama", help="all: every family in turn")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--masked-prefix", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="the Trainer's bf16=True (CPU autocast to bfloat16)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's and fusedhead's threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write each pair's summary and per-step values to this file")
    p.add_argument("--worker", choices=("stock", "fused"), help=argparse.SUPPRESS)
    return p.parse_args()


def corpus_files() -> list[Path]:
    roots = sorted(Path("/usr/lib").glob("python3*")) + [Path(sysconfig.get_paths()["stdlib"])]
    for root in roots:
        files = sorted(root.glob("*.py"))
        if files:
            return files
    sys.exit("train_hf_with_fusedhead: no Python standard library sources found for the text")


def make_sequences(args: argparse.Namespace) -> Any:
    """[S, seq] int64 token ids from the standard library's sources (enough for the run, a few more)."""
    import torch
    need = args.steps * args.batch * args.grad_accum * args.seq
    pieces = []
    for f in corpus_files():
        pieces += re.findall(r"\w+|[^\w\s]", f.read_text(errors="replace"))
        if len(pieces) >= 4 * need:
            break
    vocab = {w: i + 1 for i, (w, _) in enumerate(collections.Counter(pieces).most_common(args.vocab - 1))}
    ids = torch.tensor([vocab.get(w, 0) for w in pieces[:need]], dtype=torch.int64)
    if len(ids) < need:
        sys.exit(f"train_hf_with_fusedhead: the text has {len(ids)} tokens, the run needs {need}")
    return ids.view(-1, args.seq)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(args: argparse.Namespace) -> None:
    """One run; prints a JSON line: losses, grad norms, step times, peak RSS growth."""
    import torch
    import transformers as tr
    from torch.utils.data import Dataset

    import fusedhead
    import fusedhead.transformers as fhtr

    torch.set_num_threads(args.threads)
    fusedhead.set_default_context_settings(threads=args.threads)
    tr.logging.set_verbosity_error()
    seqs = make_sequences(args)

    class Data(Dataset):
        def __len__(self):
            return len(seqs)

        def __getitem__(self, i):
            labels = seqs[i].clone()
            labels[:args.masked_prefix] = -100
            return {"input_ids": seqs[i], "labels": labels}

    torch.manual_seed(args.seed)
    model = tr.AutoModelForCausalLM.from_config(FAMILIES[args.family](tr, args))
    if args.worker == "fused":
        fhtr.patch(model, strict=True)

    times = []

    class Timer(tr.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    targs = tr.TrainingArguments(
        output_dir="/tmp/train_hf_with_fusedhead", per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, bf16=args.bf16)
    trainer = tr.Trainer(model=model, args=targs, train_dataset=Data(), callbacks=[Timer()])
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM, the RSS high-water mark
    trainer.train()
    peak = rss_kib("VmHWM")
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    print(json.dumps({"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
                      "times": times, "peak_growth_mib": (peak - before) / 1024}))


def rel(ref: float, x: float) -> float:
    return abs(x - ref) / abs(ref)


def run_pair(args: argparse.Namespace, family: str) -> dict[str, Any]:
    """The stock and the fused run of one family, each in a subprocess; prints the per-step table, returns both
    runs' values and their summary."""
    import torch
    import transformers
    runs = {}
    for kind in ("stock", "fused"):
        # the last --family wins: the worker trains this family whatever the command line's --family was
        cmd = [sys.executable, __file__, *sys.argv[1:], "--family", family, "--worker", kind]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"train_hf_with_fusedhead: the {kind} run of {family} failed:\n{done.stderr[-4000:]}")
        runs[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    s, f = runs["stock"], runs["fused"]
    dtype = "bf16" if args.bf16 else "fp32"
    print(f"{family}: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}; {args.steps} steps of "
          f"{args.grad_accum} x {args.batch} sequences x {args.seq} tokens; "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}; "
          f"{args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'step':>4} {'loss stock':>12} {'loss fused':>12} {'rel diff':>9} {'gnorm stock':>12} "
          f"{'gnorm fused':>12} {'rel diff':>9} {'ms stock':>9} {'ms fused':>9}")
    for i, (ls, lf, gs, gf) in enumerate(zip(s["loss"], f["loss"], s["grad_norm"], f["grad_norm"])):
        print(f"{i:4d} {ls:12.7f} {lf:12.7f} {rel(ls, lf):9.2e} {gs:12.7f} {gf:12.7f} {rel(gs, gf):9.2e} "
              f"{1e3 * s['times'][i]:9.1f} {1e3 * f['times'][i]:9.1f}")
    return {"family": family, "dtype": dtype,
            "max_loss_rel_diff": max(rel(a, b) for a, b in zip(s["loss"], f["loss"])),
            "grad_norm_rel_diff_step0": rel(s["grad_norm"][0], f["grad_norm"][0]),
            "peak_growth_mib": {k: r["peak_growth_mib"] for k, r in runs.items()},
            "median_ms_per_step": {k: 1e3 * statistics.median(r["times"][1:]) for k, r in runs.items()},
            "runs": runs}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    pairs = [run_pair(args, family) for family in (FAMILIES if args.family == "all" else [args.family])]
    print(f"\n{'family':<8} {'dtype':<5} {'max loss rel':>12} {'gnorm0 rel':>10} {'peak MiB stock/fused':>20} "
          f"{'ms/step stock/fused':>19}   (steps 1.. median)")
    for p in pairs:
        peak, ms = p["peak_growth_mib"], p["median_ms_per_step"]
        print(f"{p['family']:<8} {p['dtype']:<5} {p['max_loss_rel_diff']:12.2e} {p['grad_norm_rel_diff_step0']:10.2e} "
              f"{peak['stock']:>10.0f} / {peak['fused']:<7.0f} {ms['stock']:>9.0f} / {ms['fused']:<7.0f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "pairs": pairs},
                                        indent=1))


if __name__ == "__main__":
    main()
