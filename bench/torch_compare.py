#!/usr/bin/env python3
"""PyTorch against fusedhead: one training step of linear + cross-entropy (forward and backward to the hidden
states and the weight) at the same shape, data and threads.

Cases, each in its own process (peak memory does not mix), the same seeded inputs and torch.set_num_threads(--threads)
in every one; a warm-up step (reported as "first ms") and then best of --reps. Reported: ms, GFLOP/s on the 6*N*H*V
basis, peak RSS growth of the steps, speed-up over torch_eager, and a note on what the case ran:
  torch_eager        F.cross_entropy(F.linear(h, W), y).backward(): materializes [N, V] logits and their gradient
  torch_chunked      the same over token chunks of --chunk rows (a common memory workaround in torch)
  torch_lce[auto]    torch's own F.linear_cross_entropy(h, W, y, options=torch.nn.LinearCrossEntropyOptions()):
                     batch-chunked, gradients computed in the forward. acc_policy and chunking_method 'auto' resolve
                     by device and dtype (torch/nn/modules/linear_cross_entropy_options.py): on CPU bf16 'accurate'
                     with fp32 accumulation and chunks sized by 'aspect_ratio' (next_pow2(ceil(N / ceil(V / H)))
                     rows: 32 at N=H=1024 V=32768, 8 at N=512 H=1536 V=151643); fp32 falls back to 'compact' and
                     'aspect_ratio:2' (half those rows). The note shows the resolved options
  torch_lce[SPEC]    the same with explicit options, one case per --lce-options SPEC, a comma-separated list of
                     LinearCrossEntropyOptions fields (e.g. 'batch_chunk_size=256', 'chunking_method=aspect_ratio:4,
                     acc_policy=balanced', 'acc_dtype=float32'); the default is batch_chunk_size=--chunk
                     (torch_chunked's chunks; an explicit size turns 'auto' chunking off). options=None, its
                     reference path, is exactly F.linear + F.cross_entropy (torch_eager), so it is not run separately
  torch_compile      torch_eager's loss through torch.compile (inductor; needs a C++ compiler, left out if it fails)
  fusedhead          fusedhead.torch.fused_linear_cross_entropy (the single-call train step inside)
  fusedhead_compile  torch.compile of a function calling fused_linear_cross_entropy: with fullgraph=True when
                     torch._dynamo.explain finds no graph break in it, otherwise fullgraph=False; the note gives
                     the graph-break count and the first reason
The torch_lce cases need a torch with F.linear_cross_entropy (2.13 has it), the compile cases torch 2; where torch
lacks them (Debian's 1.13) they are skipped with the reason printed. One-time set-up stays out of the measurement:
both compile cases compile in a step before it, so neither the compilation's time nor the compiler's memory counts
(their first ms is the first compiled step; their note counts the frames dynamo compiled during the measured steps,
recompilations that a real training loop would pay too; their peak RSS growth leaves out what the compile step
kept, fusedhead's workspace and recycled gradient buffer among it: the fusedhead row has those), and the
torch_lce cases first call the op on a 2-row slice (its first call in a process sets up torch's custom-op
machinery: about 1.4 s and 80 MiB here), and the fusedhead cases first run a 2-row train step (the library's first call
starts OpenMP's threads and BLIS's buffer pools: about 75 MiB, once per process).
--dtype bf16 runs every case on bfloat16 hidden states and weight, gradients in bf16 (fusedhead writes them in bf16
itself, the C step as well). --dtype takes several dtypes and --shapes readme the README's two shapes (N=1024
H=1024 V=32768 and N=512 H=1536 V=151643, in place of --n/--hidden/--vocab): one report (one --json object, a JSON
array of them for several) per shape and dtype.

The header names the torch (version, interpreter, what runs its GEMMs, from torch.__config__.show() and the
libraries it mapped) and the fusedhead library (path, BLIS kernel set, row kernels, bf16 GEMM: fusedhead's
kernel_info(), as fh_bench's first line). What runs torch's GEMMs depends on the build:
  - torch's pip wheel (BLAS_INFO=mkl): fp32 GEMMs in MKL (linked into libtorch), bf16 in its bundled oneDNN. It
    does not use BLIS, so BLIS_* variables change nothing there and the script sets none; threads come from
    torch.set_num_threads (OpenMP, MKL).
  - Debian's python3-torch 1.13 (BLAS_INFO=generic): fp32 GEMMs through libblas.so.3, BLIS by the alternatives
    here, and bf16 in Debian's oneDNN 2.6.3. That BLIS, like the one fusedhead links, does not recognise recent
    AMD CPUs: left alone it runs its generic kernels on one thread (about 30 GFLOP/s here). When torch has mapped
    a BLIS libblas, the torch cases get the kernel set fusedhead selects (BLIS_ARCH_TYPE) and --threads BLAS
    threads (BLIS_NUM_THREADS), unless those variables are set already, so that fusedhead is compared with torch
    at its best on this machine; --torch-blas-as-installed leaves them alone.

Binding overhead: after its own measurement the fusedhead process times, interleaved and best of --reps
each, the C train step (fh_ce_forward_backward through fusedhead.numpy.forward_backward into preallocated
outputs) and the torch binding's step in a trainer's loop, with optimizer.zero_grad(set_to_none=False)
(torch 1.13's default: .grad kept and zeroed, autograd adds the step's gradient into it) and with
set_to_none=True (torch 2's default: autograd adopts the step's gradient as .grad). Reported: each time and
its ratio to the C step.

--torch-without-onednn runs torch as it runs on a CPU without AVX-512 (torch.backends.mkldnn.enabled = False):
torch 1.13 sends a bf16 matmul to oneDNN only where cpuinfo reports AVX512-BW/VL/DQ
(aten/src/ATen/native/mkldnn/Utils.h, mkldnn_bf16_device_check), and to its own scalar bf16 GEMM everywhere else.
ONEDNN_MAX_CPU_ISA cannot show that: torch still calls oneDNN, which then has no bf16 matmul and fails.

Run with the interpreter of the torch to compare against, the library built in build/ (or FUSEDHEAD_LIBRARY):
  python bench/torch_compare.py --shapes readme --dtype fp32 bf16 --threads 2      # e.g. a venv with torch 2.13
  /usr/bin/python3 bench/torch_compare.py --n 1024 --hidden 1024 --vocab 32768     # Debian's torch 1.13
"""
import argparse
import json
import os
import sys
import time

from bench_harness import (fusedhead_setup, import_fusedhead, measure, run_case_process, torch_env, torch_gemm)

README_SHAPES = ((1024, 1024, 32768), (512, 1536, 151643))
# Case kinds in report order; torch_lce runs once per options spec ("auto" and each --lce-options).
KINDS = ("torch_eager", "torch_chunked", "torch_lce", "torch_compile", "fusedhead", "fusedhead_compile")
OPTIONAL_KINDS = ("torch_compile", "fusedhead_compile")  # a failure leaves the case out (inductor needs a compiler)


# ---------------------------------------------------------------------------------------------------------
# Cases: each builds its step over the shared inputs d (hidden, weight, targets) and returns (step, note), in the
# case's own process; compile cases compile here, before the measurement. A callable note is called after it.
# ---------------------------------------------------------------------------------------------------------
def case_torch_eager(args, d):
    import torch.nn.functional as F

    def step():
        loss = F.cross_entropy(F.linear(d.hidden, d.weight), d.targets)
        loss.backward()
        return loss
    return step, ""


def case_torch_chunked(args, d):
    import torch.nn.functional as F
    n = d.targets.shape[0]

    def step():
        for start in range(0, n, args.chunk):
            rows = slice(start, min(n, start + args.chunk))
            (F.cross_entropy(F.linear(d.hidden[rows], d.weight), d.targets[rows], reduction="sum") / n).backward()
    return step, f"{args.chunk}-row chunks"


def lce_options(torch, spec):
    """LinearCrossEntropyOptions from an --lce-options spec ('auto': the defaults)."""
    fields = {}
    for item in ([] if spec == "auto" else spec.split(",")):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise SystemExit(f"torch_compare: --lce-options item {item!r} is not field=value")
        fields[key] = (None if value == "None" else getattr(torch, value) if key == "acc_dtype"
                       else int(value) if value.isdigit() else value)
    return torch.nn.LinearCrossEntropyOptions(**fields)


def case_torch_lce(args, d):
    import torch
    import torch.nn.functional as F
    options = lce_options(torch, args.lce)
    try:  # what 'auto' and the chunking method resolve to here (a private helper: best effort)
        r = options._adjust(num_batches=d.hidden.shape[0], in_features=d.hidden.shape[1],
                            num_classes=d.weight.shape[0], dtype=d.hidden.dtype, device=d.hidden.device)
        note = (f"acc_policy={r.acc_policy}, acc_dtype={str(r.acc_dtype).replace('torch.', '')}, "
                f"{r.batch_chunk_size}-row chunks")
    except Exception as e:
        note = f"resolved options unknown ({type(e).__name__})"

    # The op's first call in a process sets up torch's custom-op machinery (about 1.4 s and 80 MiB here): a tiny
    # call does it before the measurement, as the compile cases compile there.
    tiny = [t[:2].detach().requires_grad_() for t in (d.hidden, d.weight)]
    F.linear_cross_entropy(*tiny, d.targets[:2] % 2, options=options).backward()

    def step():
        loss = F.linear_cross_entropy(d.hidden, d.weight, d.targets, options=options)
        loss.backward()
        return loss
    return step, note


def compiled_step(torch, fn, d, **options):
    """The step of torch.compile(fn, **options), compiled here by a first step, and a function that reports the
    frames dynamo compiles after that (in d.report and as a note): a guard failing step after step (a Python
    float of the loss baked into a graph, say) recompiles in the measured steps, up to dynamo's recompile limit."""
    from torch._dynamo.utils import counters
    compiled = torch.compile(fn, **options)

    def step():
        loss = compiled(d.hidden, d.weight, d.targets)
        loss.backward()
        return loss
    step()  # compiles
    start = counters["frames"]["total"]

    def recompiled():
        d.report["frames_compiled_while_measured"] = counters["frames"]["total"] - start
        return f"{d.report['frames_compiled_while_measured']} frame(s) compiled while measured"
    return step, recompiled


def case_torch_compile(args, d):
    import torch
    import torch.nn.functional as F
    step, recompiled = compiled_step(torch, lambda h, w, y: F.cross_entropy(F.linear(h, w), y), d)
    return step, lambda: "inductor, " + recompiled()


def fusedhead_loss(args, d):
    """fused_linear_cross_entropy at --threads; records the library and its kernels in d.report."""
    d.report.update(fusedhead_setup(args.threads, d.hidden.dtype))
    from fusedhead.torch import fused_linear_cross_entropy
    return fused_linear_cross_entropy


def case_fusedhead(args, d):
    loss = fusedhead_loss(args, d)

    def step():
        value = loss(d.hidden, d.weight, d.targets)
        value.backward()
        return value
    return step, ""


def case_fusedhead_compile(args, d):
    import torch
    import torch._dynamo
    loss = fusedhead_loss(args, d)

    def fn(h, w, y):
        return loss(h, w, y)
    explained = torch._dynamo.explain(fn)(d.hidden, d.weight, d.targets)
    breaks = d.report["graph_breaks"] = explained.graph_break_count
    torch._dynamo.reset()
    step, recompiled = compiled_step(torch, fn, d, fullgraph=breaks == 0)
    if breaks == 0:
        return step, lambda: "fullgraph=True, no graph break, " + recompiled()
    reason = str(explained.break_reasons[0].reason).strip().splitlines()[0] if explained.break_reasons else "?"
    return step, lambda: f"fullgraph=False, {breaks} graph break(s) (first: {reason[:60]}), {recompiled()}"


def run_case(args):
    import torch

    torch.set_num_threads(args.threads)
    if args.torch_without_onednn:
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(0)
    n, h, v = args.n, args.hidden, args.vocab
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    d = argparse.Namespace(report={})
    d.hidden = ((torch.rand(n, h) * 2 - 1)).to(dtype).requires_grad_(True)
    d.weight = ((torch.rand(v, h) * 2 - 1) * (3.0 / h) ** 0.5).to(dtype).requires_grad_(True)
    d.targets = torch.randint(0, v, (n,))
    # Gradient buffers exist before measuring: a trainer keeps them across steps.
    d.hidden.grad = torch.zeros_like(d.hidden)
    d.weight.grad = torch.zeros_like(d.weight)
    step, note = globals()["case_" + args.case](args, d)

    def zero_grads():
        d.hidden.grad.zero_()
        d.weight.grad.zero_()
    measured = measure(step, args.reps, zero_grads)
    result = {"case": case_label(args.case, args.lce), **measured, "note": note() if callable(note) else note,
              "threads": torch.get_num_threads(), **d.report}
    if args.case == "fusedhead":
        result["binding_overhead"] = binding_overhead(args, d.hidden, d.weight, d.targets, step)
    print(json.dumps(result))


def binding_overhead(args, hidden, weight, targets, step):
    """The C train step and the binding's step under both zero_grad choices, interleaved (the same machine
    noise for all three), best of args.reps each; ms and the ratios to the C step."""
    import numpy as np
    import torch
    import fusedhead.numpy as fhnp

    bf16 = args.dtype == "bf16"
    # NumPy has no bf16: the library takes the bits as uint16 (the same memory, no copy).
    x, w = (t.detach().view(torch.int16).numpy().view(np.uint16) if bf16 else t.detach().numpy()
            for t in (hidden, weight))
    y = targets.numpy()
    # The same work as the binding's step: gradients in the inputs' dtype (bf16 bits as uint16 for bf16).
    grad_np = np.uint16 if bf16 else np.float32
    dx, dw = np.empty(x.shape, grad_np), np.empty(w.shape, grad_np)
    params = (hidden, weight)
    kept = [torch.zeros_like(p) for p in params]  # .grad as a trainer keeps it across steps

    def c_step():
        fhnp.forward_backward(x, w, y, dhidden=dx, dweight=dw, dtype="bf16" if bf16 else "fp32",
                              grad_dtype="bf16" if bf16 else "fp32")

    def zero_grad(set_to_none):
        for p, g in zip(params, kept):
            p.grad = g
        torch.optim.SGD(params, lr=0.0).zero_grad(set_to_none=set_to_none)

    cases = {"c_step": (c_step, None), "set_to_none_false": (step, False), "set_to_none_true": (step, True)}
    best = dict.fromkeys(cases, float("inf"))
    for rep in range(args.reps + 1):  # the first round warms up the C step's workspace and buffers
        for name, (fn, set_to_none) in cases.items():
            if set_to_none is not None:
                zero_grad(set_to_none)
            t = time.perf_counter()
            fn()
            if rep > 0:
                best[name] = min(best[name], time.perf_counter() - t)
    c = best["c_step"]
    return {"c_step_ms": c * 1e3,
            "binding_ms": {k: v * 1e3 for k, v in best.items() if k != "c_step"},
            "ratio_to_c_step": {k: v / c for k, v in best.items() if k != "c_step"}}


# ---------------------------------------------------------------------------------------------------------
# Driver: which cases this torch has, the environment of each case's process, the report.
# ---------------------------------------------------------------------------------------------------------
def case_label(kind, lce):
    return f"torch_lce[{lce}]" if kind == "torch_lce" else kind


def skip_reason(torch, kind):
    """Why this torch cannot run a case kind, or None."""
    if kind == "torch_lce" and not (hasattr(torch.nn.functional, "linear_cross_entropy")
                                    and hasattr(torch.nn, "LinearCrossEntropyOptions")):
        return f"torch {torch.__version__} has no F.linear_cross_entropy (torch 2.13 has)"
    if kind in OPTIONAL_KINDS and not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile (torch 2 and later)"
    return None


def run_shape(args, torch, n, hidden, vocab, dtype, env):
    """Every case at one shape and dtype, each in its own process; the report's data."""
    block = {"n": n, "hidden": hidden, "vocab": vocab, "threads": args.threads, "dtype": dtype, "reps": args.reps,
             "torch_version": torch.__version__, "python": sys.executable, "skipped": {}, "cases": []}
    for kind in KINDS:
        specs = (["auto"] + (args.lce_options or [f"batch_chunk_size={args.chunk}"])
                 if kind == "torch_lce" else [None])
        reason = skip_reason(torch, kind)
        for spec in specs:
            label = case_label(kind, spec)
            if reason:
                block["skipped"][label] = reason
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--case", kind, f"--n={n}", f"--hidden={hidden}",
                   f"--vocab={vocab}", f"--dtype={dtype}"] + [
                f"--{k}={getattr(args, k)}" for k in ("threads", "reps", "chunk")] + (
                ["--lce", spec] if spec else []) + (["--torch-without-onednn"] if args.torch_without_onednn else [])
            result, error = run_case_process(cmd, env if kind.startswith("torch") else dict(os.environ))
            if result is None:
                if kind in OPTIONAL_KINDS:
                    block["skipped"][label] = f"failed: {error}"
                    continue
                sys.exit(f"torch_compare: {label} failed: {error}")
            block["cases"].append(result)
    flops = 6.0 * n * hidden * vocab
    eager = block["cases"][0]["best_ms"]
    for r in block["cases"]:
        r["gflops"] = flops / (r["best_ms"] * 1e6)
        r["speedup_vs_torch_eager"] = eager / r["best_ms"]
        for key in ("fusedhead_library", "fusedhead_kernels"):
            if key in r:
                block[key] = r.pop(key)
    return block


def print_report(args, block):
    print(f"torch_compare: N={block['n']} H={block['hidden']} V={block['vocab']}, {block['dtype']}, "
          f"{block['threads']} threads, best of {block['reps']} after a warm-up step")
    print(f"torch {block['torch_version']} ({block['python']}"
          f"{', without oneDNN' if args.torch_without_onednn else ''}): {block['torch_gemm']}; {block['torch_blas']}")
    print(f"fusedhead {block.get('fusedhead_library', '(not run)')}: {block.get('fusedhead_kernels', '')}\n")
    width = max([len(r["case"]) for r in block["cases"]] + [len(k) for k in block["skipped"]] + [4])
    print(f"{'case':<{width}} {'best ms':>10} {'GFLOP/s':>9} {'first ms':>10} {'peak RSS +':>12} {'vs eager':>9}  note")
    for r in block["cases"]:
        print(f"{r['case']:<{width}} {r['best_ms']:>10.1f} {r['gflops']:>9.1f} {r['first_ms']:>10.1f} "
              f"{r['peak_rss_growth_bytes'] / 2**20:>8.1f} MiB {r['speedup_vs_torch_eager']:>8.2f}x  {r['note']}")
    for label, reason in block["skipped"].items():
        print(f"{label:<{width}} skipped: {reason}")
    o = next((r["binding_overhead"] for r in block["cases"] if "binding_overhead" in r), None)
    if o:
        print(f"\nbinding overhead (fusedhead process, interleaved, best of {block['reps']}): C train step "
              f"(fusedhead.numpy.forward_backward, preallocated outputs) {o['c_step_ms']:.1f} ms")
        for key, label in (("set_to_none_false", "zero_grad(set_to_none=False), torch 1.13's default"),
                           ("set_to_none_true", "zero_grad(set_to_none=True), torch 2's default")):
            print(f"  fusedhead.torch, {label + ':':<52} {o['binding_ms'][key]:>8.1f} ms  "
                  f"{o['ratio_to_c_step'][key]:.3f}x the C step")
    print(flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--shapes", choices=("readme",),
                   help="the README's shapes (N=1024 H=1024 V=32768, N=512 H=1536 V=151643) for --n/--hidden/--vocab")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--dtype", nargs="+", choices=("fp32", "f32", "bf16"), default=["fp32"],
                   help="one report per dtype (f32 is fp32)")
    p.add_argument("--lce-options", action="append", metavar="SPEC",
                   help="a torch_lce case with these LinearCrossEntropyOptions, e.g. 'chunking_method=aspect_ratio:4'"
                        " (repeatable; default: batch_chunk_size=--chunk)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--torch-blas-as-installed", action="store_true",
                   help="run torch with BLIS as Debian leaves it (generic kernels, one thread here)")
    p.add_argument("--torch-without-onednn", action="store_true",
                   help="torch as on a CPU without AVX-512: its bf16 matmul without oneDNN")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--lce", help=argparse.SUPPRESS)
    args = p.parse_args()
    dtypes = list(dict.fromkeys("fp32" if d == "f32" else d for d in args.dtype))
    if args.case:
        args.dtype = dtypes[0]
        if args.case.startswith("fusedhead"):
            import_fusedhead()
        run_case(args)
        return
    try:
        import torch
    except ImportError:
        print("torch_compare: PyTorch is not installed for this interpreter (Debian: python3-torch; pip: torch)",
              file=sys.stderr)
        sys.exit(2)
    gemm, blis = torch_gemm(torch)
    env = torch_env(args.threads, blis, args.torch_blas_as_installed)
    if not blis:
        blas = "BLIS_* not set (torch does not use BLIS)"
    elif args.torch_blas_as_installed:
        blas = "BLIS as installed"
    else:
        blas = f"BLIS_ARCH_TYPE={env.get('BLIS_ARCH_TYPE', 'unset')} BLIS_NUM_THREADS={env['BLIS_NUM_THREADS']}"
    blocks = []
    for n, hidden, vocab in README_SHAPES if args.shapes else ((args.n, args.hidden, args.vocab),):
        for dtype in dtypes:
            block = run_shape(args, torch, n, hidden, vocab, dtype, env)
            block.update(torch_gemm=gemm, torch_blas=blas)
            blocks.append(block)
            if not args.json:
                print_report(args, block)
    if args.json:
        print(json.dumps(blocks[0] if len(blocks) == 1 else blocks, indent=2))


if __name__ == "__main__":
    main()
