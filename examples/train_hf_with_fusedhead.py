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
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

FAMILIES = ("llama", "qwen3", "gemma2", "cohere", "granite", "phi", "gpt2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="llama")
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
    p.add_argument("--worker", choices=("stock", "fused"), help=argparse.SUPPRESS)
    return p.parse_args()


def make_config(args):
    import transformers as tr
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=args.seq)
    if args.family == "llama":
        return tr.LlamaConfig(**common)
    if args.family == "qwen3":
        return tr.Qwen3Config(**common, head_dim=args.hidden // 4)
    if args.family == "gemma2":
        return tr.Gemma2Config(**common, head_dim=args.hidden // 4)       # final_logit_softcapping 30, tied
    if args.family == "cohere":
        return tr.CohereConfig(**common)                                    # logit_scale 0.0625
    if args.family == "granite":
        return tr.GraniteConfig(**common, logits_scaling=4.0)
    if args.family == "phi":
        return tr.PhiConfig(**common, resid_pdrop=0.0, embd_pdrop=0.0)      # lm_head with a bias
    return tr.GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=4,
                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # tied


def corpus_files():
    roots = sorted(Path("/usr/lib").glob("python3*")) + [Path(sysconfig.get_paths()["stdlib"])]
    for root in roots:
        files = sorted(root.glob("*.py"))
        if files:
            return files
    sys.exit("train_hf_with_fusedhead: no Python standard library sources found for the text")


def make_sequences(args):
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


def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(args):
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
    model = tr.AutoModelForCausalLM.from_config(make_config(args))
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


def main():
    args = parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    import transformers
    results = {}
    for kind in ("stock", "fused"):
        cmd = [sys.executable, __file__, "--worker", kind] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    s, f = results["stock"], results["fused"]
    print(f"{args.family}: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}; {args.steps} steps of "
          f"{args.grad_accum} x {args.batch} sequences x {args.seq} tokens; "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}; "
          f"{args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'step':>4} {'loss stock':>12} {'loss fused':>12} {'rel diff':>9} {'gnorm stock':>12} "
          f"{'gnorm fused':>12} {'rel diff':>9} {'ms stock':>9} {'ms fused':>9}")
    rel = lambda a, b: abs(a - b) / abs(a)  # noqa: E731
    for i, (ls, lf, gs, gf) in enumerate(zip(s["loss"], f["loss"], s["grad_norm"], f["grad_norm"])):
        print(f"{i:4d} {ls:12.7f} {lf:12.7f} {rel(ls, lf):9.2e} {gs:12.7f} {gf:12.7f} {rel(gs, gf):9.2e} "
              f"{1e3 * s['times'][i]:9.1f} {1e3 * f['times'][i]:9.1f}")
    worst = max(rel(a, b) for a, b in zip(s["loss"], f["loss"]))
    print(f"max loss rel diff {worst:.2e}; step-0 grad norm rel diff {rel(s['grad_norm'][0], f['grad_norm'][0]):.2e}")
    print(f"peak RSS growth during training: stock {s['peak_growth_mib']:.0f} MiB, "
          f"fused {f['peak_growth_mib']:.0f} MiB")
    med = {k: 1e3 * statistics.median(r["times"][1:]) for k, r in results.items()}
    print(f"median time per step (steps 1..): stock {med['stock']:.0f} ms, fused {med['fused']:.0f} ms")


if __name__ == "__main__":
    main()
