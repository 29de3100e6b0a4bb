#!/usr/bin/python3
"""Trains a tiny language model on the Python standard library's sources, three times from the same seed: (a) with
torch's materialized logits, F.cross_entropy(F.linear(h, W), y), (b) with fusedhead.torch.causal_lm_loss (Hugging
Face's causal-LM loss, here on the batch's already shifted labels: shift_labels=y), which never forms the [N, V]
logits, and (c) the same with gradient
filtering (Context(grad_filter_eps=--filter-eps, grad_filter_tail=--filter-tail), row blocks of
--filter-tile-rows tokens), which skips the backward GEMMs' vocabulary columns whose softmax terms are below eps in
every row of a block and by default replaces those terms by the library's rank-one estimate. It shows how the
three training curves agree, what share of the backward work filtering skipped at each step, and how peaked a
really trained head's softmax is (what filtering can gain depends on that).

    FUSEDHEAD_LIBRARY=$PWD/build/libfusedhead.so PYTHONPATH=python /usr/bin/python3 examples/train_tiny_lm.py \
        --out /tmp/tiny-lm --save-batch /tmp/tiny-lm/batch
    build/bench/fh_bench --distribution /tmp/tiny-lm/batch      # replays the trained head's batch

Debian's interpreter is the one that sees python3-torch and python3-sentencepiece; gnuplot (gnuplot-nox) renders
the plots when it is installed, else the script that renders them is left beside the CSV.

Steps:
  1. Text: the .py files under /usr/lib/python3.*/ (--files caps their number), in an order shuffled by --seed.
  2. Tokenizer: a sentencepiece BPE model of --vocab pieces, trained on the first --tokenizer-bytes of that text
     (a few seconds), written to OUT/tokenizer.model. Each line is encoded apart and ends with the EOS piece,
     which stands for the newline.
  3. Tokens: the first --corpus-bytes of text; the last tenth of the token stream is held out.
  4. Model: token and position embeddings, --layers pre-norm transformer blocks (causal, no dropout), a final
     LayerNorm and an untied lm_head [V, H]; Adam. Runs (a), (b) and (c) start from copies of one model and see
     the same batches, step for step (interleaved, so the machine's noise hits their timings alike).
  5. Every --log-every steps (and at the last step) a row of OUT/curves.csv:
       loss_torch, loss_fused    each run's training loss on the step's batch
       rel_diff                  |loss_fused - loss_torch| / loss_torch: the two trajectories apart
       same_state_rel_diff       run (b)'s fused loss against materialized logits on run (b)'s own hidden states
                                 and weight: the fused head's own error, without the trajectories' divergence
       ms_torch, ms_fused        mean time of a whole training step (model, head, backward, Adam) since the last row
       loss_filtered, filtered_rel_diff, ms_filtered
                                 run (c)'s loss, |loss_filtered - loss_fused| / loss_fused, and its time
       skipped                   the share of run (c)'s backward GEMM flops that filtering skipped at this step
       held_out_torch, held_out_fused, held_out_filtered
                                 each run's loss after the step on the same --eval-rows held-out tokens (what it
                                 has learned, where the training losses above are one batch's each)
       held_out_rel_diff, held_out_filtered_rel_diff
                                 fused vs torch and filtered vs fused on them
       entropy and the peakedness of run (b)'s softmax p = softmax(h W^T) over the first --stat-rows rows of the
       batch (materialized in float64; cheap): p_lt_2m12 and p_lt_2m28, the fractions of entries below 2^-12
       (bf16's filtering eps) and 2^-28 (fp32's); blocks_lt_2m12, the fraction of blocks of those rows x 256
       vocabulary columns whose every entry is below 2^-12 (what filtering could skip); sorted_blocks_lt_2m12,
       the same after ordering the vocabulary by mean logit over those rows (what vocabulary sorting would give).
     OUT/curves.gp renders OUT/loss.png (the curves, and the relative differences on a log scale) and
     OUT/distribution.png (the peakedness and the skipped share against the step).
  6. --save-batch DIR: run (b)'s final hidden states on held-out text, hidden.npy [N, H] float32, targets.npy [N]
     int64 and weight.npy [V, H] float32 (the lm_head), N = --save-rows; their statistics are printed.

The default run (V=16384, H=256, 2 blocks, 16 x 64 tokens per step, 300 steps) takes about 7 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import copy
import csv
import glob
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fusedhead
from fusedhead.torch import causal_lm_loss

try:
    import sentencepiece as spm
except ImportError:  # pragma: no cover
    sys.exit("train_tiny_lm: needs sentencepiece (Debian: python3-sentencepiece) for Debian's /usr/bin/python3")

BLOCK_COLUMNS = 256  # vocabulary columns per block in the block statistics
EPS_BF16, EPS_FP32 = 2.0 ** -12, 2.0 ** -28  # filtering's eps per dtype: its machine epsilon / 32, as CCE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/fusedhead-tiny-lm", help="output folder (tokenizer, CSV, plots)")
    p.add_argument("--files", type=int, default=0, help="use at most this many source files (0: all)")
    p.add_argument("--tokenizer-bytes", type=int, default=3_000_000, help="text the tokenizer is trained on")
    p.add_argument("--corpus-bytes", type=int, default=6_000_000, help="text tokenised for training")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stat-rows", type=int, default=64, help="rows of the batch the peakedness is measured on")
    p.add_argument("--eval-rows", type=int, default=2048,
                   help="held-out tokens each run's loss is measured on at every logged step")
    p.add_argument("--save-batch", metavar="DIR", help="write the trained head's held-out batch as .npy here")
    p.add_argument("--save-rows", type=int, default=2048, help="rows of the saved batch")
    p.add_argument("--filter-eps", type=float, default=EPS_BF16,
                   help="run (c)'s grad_filter_eps (default 2^-12, Cut Cross-Entropy's for bf16)")
    p.add_argument("--filter-tail", choices=["estimate", "drop"], default="estimate",
                   help="run (c)'s grad_filter_tail: the skipped softmax terms replaced by the library's rank-one "
                        "estimate (default), or dropped as Cut Cross-Entropy does")
    p.add_argument("--filter-tile-rows", type=int, default=0,
                   help="run (c)'s row blocks (0: the library's choice): filtering skips a vocabulary column of a "
                        "block only when all its rows allow it")
    p.add_argument("--control", action="store_true",
                   help="a third run: materialized logits summed over two halves of H (rounding differences alone)")
    p.add_argument("--no-plot", action="store_true", help="write the gnuplot script but do not run gnuplot")
    return p.parse_args(argv)


def source_files(limit: int, seed: int):
    files = sorted(glob.glob("/usr/lib/python3.*/**/*.py", recursive=True))
    if not files:
        sys.exit("train_tiny_lm: no .py files under /usr/lib/python3.*/")
    random.Random(seed).shuffle(files)
    return files[:limit] if limit > 0 else files


def read_lines(files, max_bytes: int):
    """The lines of the files, in order, until max_bytes of text have been read."""
    lines, total = [], 0
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        lines.extend(text.split("\n"))
        total += len(text)
        if total >= max_bytes:
            break
    return lines


def train_tokenizer(lines, vocab: int, out: Path, threads: int):
    prefix = out / "tokenizer"
    # BPE trains in seconds at 16k pieces where unigram needs more text for as many; code keeps its indentation.
    spm.SentencePieceTrainer.train(sentence_iterator=iter([l for l in lines if l.strip()]), model_prefix=str(prefix),
                                   vocab_size=vocab, model_type="bpe", remove_extra_whitespaces=False,
                                   max_sentence_length=8192, num_threads=threads, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(prefix) + ".model")


def encode(sp, lines) -> np.ndarray:
    """The token stream: each line's pieces, then EOS in place of its newline."""
    ids = sp.encode(lines)
    eos = sp.eos_id()
    return np.fromiter((t for line in ids for t in line + [eos]), dtype=np.int64)


class TinyLM(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks (causal, no dropout), a final LayerNorm and an
    untied lm_head [V, H]."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("causal", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, tokens):
        """The final hidden states [B * T, H] of tokens [B, T]."""
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.causal[:t, :t])
        x = self.norm(x)
        return x.reshape(-1, x.shape[-1])


def split_k_cross_entropy(hidden, weight, targets):
    """The control run's head: materialized logits, each summed over the two halves of H. The same math as
    F.linear, another fp32 rounding."""
    k = hidden.shape[1] // 2
    return F.cross_entropy(F.linear(hidden[:, :k], weight[:, :k]) + F.linear(hidden[:, k:], weight[:, k:]), targets)


def heads(filter_context):
    """Each run's head: (h, w, y) -> loss."""
    return {"torch": lambda h, w, y: F.cross_entropy(F.linear(h, w), y),
            "fused": lambda h, w, y: causal_lm_loss(h, w, None, shift_labels=y),
            "filtered": lambda h, w, y: causal_lm_loss(h, w, None, shift_labels=y, context=filter_context),
            "control": split_k_cross_entropy}


def peakedness(hidden, weight, order=None):
    """Statistics of softmax(hidden weight^T) in float64 (from fp32 logits): mean entropy (nats), the fractions of
    entries below 2^-12 and 2^-28, and the fractions of blocks of all the rows x BLOCK_COLUMNS vocabulary columns
    whose every entry is below 2^-12, in vocabulary order and in `order` (default: by these rows' mean logit)."""
    with torch.no_grad():
        logits = (hidden @ weight.T).double()
        logp = torch.log_softmax(logits, dim=1)
        p = logp.exp()
        if order is None:
            order = torch.argsort(logits.mean(0), descending=True)

        def blocks_below(q):
            pad = (-q.shape[1]) % BLOCK_COLUMNS  # a short last block, padded with zeros (below any eps)
            q = F.pad(q, (0, pad)).reshape(q.shape[0], -1, BLOCK_COLUMNS)
            return float((q.amax(dim=(0, 2)) < EPS_BF16).double().mean())

        return {"entropy": float(-(p * logp).sum(1).mean()), "p_lt_2m12": float((p < EPS_BF16).double().mean()),
                "p_lt_2m28": float((p < EPS_FP32).double().mean()), "blocks_lt_2m12": blocks_below(p),
                "sorted_blocks_lt_2m12": blocks_below(p[:, order])}


def state_statistics(model, inputs, targets, rows: int):
    """peakedness() of the model's softmax on the batch's first rows, and the model's loss on the whole batch
    through torch's materialized logits ("reference")."""
    with torch.no_grad():
        hidden = model(inputs)
        stats = peakedness(hidden[:rows], model.lm_head.weight)
        stats["reference"] = float(F.cross_entropy(F.linear(hidden, model.lm_head.weight), targets))
    return stats


def held_out_window(held_out, rows: int, seq: int):
    """Whole sequences of the held-out stream covering its first `rows` tokens (fewer if it is short): inputs
    [sequences, seq] and the targets of the first `rows` positions."""
    sequences = min(-(-rows // seq), (len(held_out) - 1) // seq)
    if sequences < 1:
        sys.exit(f"train_tiny_lm: {len(held_out)} held-out tokens, fewer than one sequence of {seq}")
    window = held_out[:sequences * seq + 1]
    return window[:-1].reshape(sequences, seq), window[1:][:rows].contiguous()


def held_out_loss(model, inputs, targets) -> float:
    """The model's mean loss on the held-out tokens (materialized logits, float64 log-sum-exp)."""
    with torch.no_grad():
        hidden = model(inputs)[:len(targets)]
        return float(F.cross_entropy(F.linear(hidden, model.lm_head.weight).double(), targets))


def save_batch(folder: Path, model, held_out, args) -> None:
    """hidden.npy, targets.npy and weight.npy of the model on the first --save-rows held-out tokens."""
    inputs, targets = held_out_window(held_out, args.save_rows, args.seq)
    weight = model.lm_head.weight.detach()
    with torch.no_grad():
        hidden = model(inputs)[:len(targets)].contiguous()
        loss = float(F.cross_entropy(F.linear(hidden, weight), targets))
        # The vocabulary order that sorting would use: by mean logit over the whole batch (as CCE does).
        order = torch.argsort((hidden.mean(0) @ weight.T), descending=True)
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in (("hidden", hidden), ("targets", targets), ("weight", weight)):
        np.save(folder / f"{name}.npy", array.numpy())
    # Row blocks of --stat-rows, as in the training log, weighted by their rows (the last may be shorter).
    blocks = [(len(h), peakedness(h, weight, order)) for h in hidden.split(args.stat_rows)]
    stats = {k: sum(n * b[k] for n, b in blocks) / len(hidden) for k in blocks[0][1]}
    print(f"saved batch: {folder}/{{hidden,targets,weight}}.npy, N={len(hidden)} H={args.hidden} V={args.vocab}, "
          f"held-out loss {loss:.4f}; mean entropy {stats['entropy']:.3f} nats, p < 2^-12: {stats['p_lt_2m12']:.4f}, "
          f"p < 2^-28: {stats['p_lt_2m28']:.4f}; blocks of {args.stat_rows} rows x {BLOCK_COLUMNS} columns all "
          f"< 2^-12: {stats['blocks_lt_2m12']:.4f}, {stats['sorted_blocks_lt_2m12']:.4f} with the vocabulary sorted by "
          f"the batch's mean logit")


CSV_COLUMNS = ["step", "loss_torch", "loss_fused", "rel_diff", "same_state_rel_diff", "ms_torch", "ms_fused",
               "entropy", "p_lt_2m12", "p_lt_2m28", "blocks_lt_2m12", "sorted_blocks_lt_2m12", "loss_filtered",
               "filtered_rel_diff", "ms_filtered", "skipped", "held_out_torch", "held_out_fused", "held_out_filtered",
               "held_out_rel_diff", "held_out_filtered_rel_diff"]
CONTROL_COLUMNS = ["loss_control", "control_rel_diff"]  # last, so that the others keep their gnuplot numbers


def write_csv(path: Path, rows, control: bool) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS + (CONTROL_COLUMNS if control else []))
        w.writeheader()
        w.writerows(rows)


def gnuplot_script(args) -> str:
    title = f"V={args.vocab} H={args.hidden}, {args.layers} blocks, {args.batch}x{args.seq} tokens per step"
    control = (", \\\n     '' using 1:($23 > 0 ? $23 : NaN) with linespoints title "
               "'torch vs control (split-H logits: rounding alone)'") if args.control else ""
    blocks = (f", {args.filter_tile_rows}-row blocks" if args.filter_tile_rows else "") + f", tail {args.filter_tail}"
    return f"""# Renders loss.png and distribution.png from curves.csv: run `gnuplot curves.gp` in this folder.
set datafile separator ','
set key noenhanced
set grid
set terminal pngcairo size 900,800 noenhanced
set output 'loss.png'
set multiplot layout 2,1 title 'tiny LM on the Python standard library ({title})'
set ylabel 'training loss (nats)'
plot 'curves.csv' using 1:2 with lines lw 2 title 'torch materialized logits', \\
     '' using 1:3 with lines dt 2 lw 2 title 'fusedhead fused cross-entropy', \\
     '' using 1:13 with lines dt 3 lw 2 title 'fusedhead + filtering (eps {args.filter_eps:g}{blocks})'
set logscale y
set format y '%.0e'
set xlabel 'step'
set ylabel 'relative difference (0 not drawn)'
plot 'curves.csv' using 1:($4 > 0 ? $4 : NaN) with linespoints title 'torch vs fused (two trajectories)', \\
     '' using 1:($5 > 0 ? $5 : NaN) with linespoints title 'fused vs materialized on the same state', \\
     '' using 1:($14 > 0 ? $14 : NaN) with linespoints title 'filtered vs fused (two trajectories)', \\
     '' using 1:($20 > 0 ? $20 : NaN) with lines dt 2 lc rgb '#9400d3' title 'held-out loss, torch vs fused', \\
     '' using 1:($21 > 0 ? $21 : NaN) with lines dt 2 lc rgb '#1e90ff' title 'held-out loss, filtered vs fused'{control}
unset multiplot
unset logscale y
set format y '%g'
set terminal pngcairo size 900,600 noenhanced
set output 'distribution.png'
set title 'how peaked the trained softmax is (the fused run, first {args.stat_rows} rows of each batch)'
set ylabel 'fraction'
set y2label 'mean entropy (nats)'
set ytics nomirror
set y2tics
set key center right
plot 'curves.csv' using 1:9 with linespoints title 'p < 2^-12', \\
     '' using 1:10 with linespoints title 'p < 2^-28', \\
     '' using 1:11 with linespoints title '{args.stat_rows} x {BLOCK_COLUMNS} blocks all < 2^-12', \\
     '' using 1:12 with linespoints title 'the same, vocabulary sorted by mean logit', \\
     '' using 1:16 with linespoints title 'backward GEMM work skipped by filtering (run c)', \\
     '' using 1:8 axes x1y2 with lines lw 2 title 'mean entropy'
"""


def render(out: Path, args) -> None:
    (out / "curves.gp").write_text(gnuplot_script(args))
    if args.no_plot:
        return
    if shutil.which("gnuplot") is None:
        print(f"gnuplot is not installed (Debian: gnuplot-nox): run `gnuplot curves.gp` in {out} to render the plots")
        return
    subprocess.run(["gnuplot", "curves.gp"], cwd=out, check=True)
    print(f"plots: {out / 'loss.png'}, {out / 'distribution.png'}")


def prepare_tokens(out: Path, args):
    """Trains the tokenizer; returns the training and held-out token streams."""
    t0 = time.perf_counter()
    files = source_files(args.files, args.seed)
    sp = train_tokenizer(read_lines(files, args.tokenizer_bytes), args.vocab, out, args.threads)
    t1 = time.perf_counter()
    tokens = torch.from_numpy(encode(sp, read_lines(files, args.corpus_bytes)))
    split = len(tokens) * 9 // 10
    if split <= args.seq + 1:
        sys.exit(f"train_tiny_lm: {split} training tokens, too few for sequences of {args.seq}")
    print(f"tokenizer: {args.vocab} pieces in {t1 - t0:.1f} s; {len(tokens)} tokens in "
          f"{time.perf_counter() - t1:.1f} s ({split} for training); BLIS {fusedhead.kernel_info().kernel_set}, "
          f"{args.threads} threads")
    return tokens[:split], tokens[split:]


def train(train_tokens, held_out, args):
    """Trains the runs in lockstep; returns the logged rows, each run's mean ms per step and the models."""
    torch.manual_seed(args.seed)
    filter_context = fusedhead.Context(threads=args.threads, tile_rows=args.filter_tile_rows,
                                       grad_filter_eps=args.filter_eps, grad_filter_tail=args.filter_tail)
    head = heads(filter_context)
    models = {"torch": TinyLM(args.vocab, args.hidden, args.layers, args.heads, args.seq)}
    for name in ("fused", "filtered", "control") if args.control else ("fused", "filtered"):
        models[name] = copy.deepcopy(models["torch"])
    optimizers = {k: torch.optim.Adam(m.parameters(), lr=args.lr) for k, m in models.items()}
    batches = torch.Generator().manual_seed(args.seed)
    rows, elapsed, total, since = [], dict.fromkeys(models, 0.0), dict.fromkeys(models, 0.0), 0
    eval_inputs, eval_targets = held_out_window(held_out, args.eval_rows, args.seq)
    for step in range(args.steps):
        starts = torch.randint(0, len(train_tokens) - args.seq - 1, (args.batch,), generator=batches)
        window = torch.stack([train_tokens[s:s + args.seq + 1] for s in starts.tolist()])
        inputs, targets = window[:, :-1], window[:, 1:].reshape(-1)
        logged = step % args.log_every == 0 or step == args.steps - 1
        if logged:  # the fused run's state before its step: the state its loss below is computed on
            row = state_statistics(models["fused"], inputs, targets, args.stat_rows)
        loss = {}
        for name, model in models.items():
            t = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            value = head[name](model(inputs), model.lm_head.weight, targets)
            value.backward()
            optimizers[name].step()
            dt = time.perf_counter() - t
            elapsed[name] += dt
            total[name] += dt
            loss[name] = float(value)
        since += 1
        if not logged:
            continue
        ms = {k: 1e3 * v / since for k, v in elapsed.items()}
        gradient_flops, skipped_flops = filter_context.filter_stats()
        row.update(step=step, ms_torch=ms["torch"], ms_fused=ms["fused"], ms_filtered=ms["filtered"],
                   same_state_rel_diff=abs(loss["fused"] - row["reference"]) / row.pop("reference"),
                   filtered_rel_diff=abs(loss["filtered"] - loss["fused"]) / loss["fused"],
                   skipped=skipped_flops / gradient_flops)
        for name in models:
            row[f"loss_{name}"] = loss[name]
        row["rel_diff"] = abs(loss["fused"] - loss["torch"]) / loss["torch"]
        # Each run's state after this step, on the same held-out tokens: the training loss above is one batch's,
        # which differs from run to run as their trajectories part; this mean over held-out text shows what each
        # has learned.
        for name in ("torch", "fused", "filtered"):
            row[f"held_out_{name}"] = held_out_loss(models[name], eval_inputs, eval_targets)
        row["held_out_rel_diff"] = abs(row["held_out_fused"] - row["held_out_torch"]) / row["held_out_torch"]
        row["held_out_filtered_rel_diff"] = (abs(row["held_out_filtered"] - row["held_out_fused"]) /
                                             row["held_out_fused"])
        if args.control:
            row["control_rel_diff"] = abs(loss["control"] - loss["torch"]) / loss["torch"]
        rows.append(row)
        control = f" (control {row['control_rel_diff']:.1e})" if args.control else ""
        print(f"step {step:4d}  loss torch {loss['torch']:.6f} fused {loss['fused']:.6f} filtered "
              f"{loss['filtered']:.6f}  rel diff {row['rel_diff']:.1e}{control}, same state "
              f"{row['same_state_rel_diff']:.1e}, filtered {row['filtered_rel_diff']:.1e}  ms/step torch "
              f"{ms['torch']:.0f} fused {ms['fused']:.0f} filtered {ms['filtered']:.0f} (skipped "
              f"{row['skipped']:.3f})  entropy {row['entropy']:.2f}  p<2^-12 {row['p_lt_2m12']:.4f}  held-out torch "
              f"{row['held_out_torch']:.4f} fused {row['held_out_fused']:.4f} filtered {row['held_out_filtered']:.4f}",
              flush=True)
        elapsed, since = dict.fromkeys(models, 0.0), 0
    return rows, {k: 1e3 * v / args.steps for k, v in total.items()}, models


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    # torch's BLAS is the BLIS that fusedhead links; BLIS reads its settings once, at its first call, and
    # loading fusedhead first lets it pick BLIS's kernels for this CPU (bench/torch_compare.py) for torch too.
    os.environ.setdefault("BLIS_NUM_THREADS", str(args.threads))
    fusedhead.load_library()
    fusedhead.set_default_context_settings(threads=args.threads)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokens, held_out = prepare_tokens(out, args)
    rows, ms, models = train(train_tokens, held_out, args)
    write_csv(out / "curves.csv", rows, args.control)
    render(out, args)
    control = (f" (torch vs control {max(r['control_rel_diff'] for r in rows):.2e})" if args.control else "")
    print(f"{args.steps} steps: mean ms/step torch {ms['torch']:.0f}, fused {ms['fused']:.0f}, filtered "
          f"{ms['filtered']:.0f}; largest relative difference between the curves {max(r['rel_diff'] for r in rows):.2e}"
          f"{control}, fused vs materialized on the same state {max(r['same_state_rel_diff'] for r in rows):.2e}, "
          f"filtered vs fused {max(r['filtered_rel_diff'] for r in rows):.2e} (mean signed "
          f"{np.mean([(r['loss_filtered'] - r['loss_fused']) / r['loss_fused'] for r in rows]):+.2e}); held-out loss "
          f"at the end torch {rows[-1]['held_out_torch']:.4f} fused {rows[-1]['held_out_fused']:.4f} filtered "
          f"{rows[-1]['held_out_filtered']:.4f}, largest relative difference torch vs fused "
          f"{max(r['held_out_rel_diff'] for r in rows):.2e}, filtered vs fused "
          f"{max(r['held_out_filtered_rel_diff'] for r in rows):.2e}; backward work skipped by filtering "
          f"{np.mean([r['skipped'] for r in rows]):.3f} on average over the logged steps; {out / 'curves.csv'}")
    if args.save_batch:
        save_batch(Path(args.save_batch), models["fused"], held_out, args)
    print(f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
