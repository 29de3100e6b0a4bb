#!/usr/bin/python3
"""PyTorch against fusedhead: one training step of linear + cross-entropy (forward and backward to the hidden
states and the weight) at the same shape and threads.

Cases, each in its own process (peak memory does not mix), best of --reps after a warm-up step:
  torch_eager     F.cross_entropy(F.linear(h, W), y).backward(): materializes [N, V] logits and gradient
  torch_chunked   the same over token chunks of --chunk rows (a common memory workaround in torch)
  torch_compile   torch_eager's loss through torch.compile (torch 2 and later; skipped where torch lacks it). Its
                  compilation runs in a step before the measurement starts, so neither its time nor the compiler's
                  memory counts: first ms is the first compiled step
  fusedhead       fusedhead.torch.fused_linear_cross_entropy (the single-call train step inside)
Reported: ms, GFLOP/s on the 6*N*H*V basis, peak RSS growth of the step, speed-up over torch_eager.
--dtype bf16 runs every case on bfloat16 hidden states and weight (torch's bf16 linear goes to oneDNN by itself,
fusedhead's too), gradients in bf16 (fusedhead writes them in bf16 itself, the C step as well).

Binding overhead: after its own measurement the fusedhead process times, interleaved and best of --reps
each, the C train step (fh_ce_forward_backward through fusedhead.numpy.forward_backward into preallocated
outputs) and the torch binding's step in a trainer's loop, with optimizer.zero_grad(set_to_none=False)
(torch 1.13's default: .grad kept and zeroed, autograd adds the step's gradient into it) and with
set_to_none=True (torch 2's default: autograd adopts the step's gradient as .grad). Reported: each time and
its ratio to the C step.

--torch-without-onednn runs torch as it runs on a CPU without AVX-512 (torch.backends.mkldnn.enabled = False):
torch sends a bf16 matmul to oneDNN only where cpuinfo reports AVX512-BW/VL/DQ (torch 1.13,
aten/src/ATen/native/mkldnn/Utils.h, mkldnn_bf16_device_check), and to its own scalar bf16 GEMM everywhere else.
ONEDNN_MAX_CPU_ISA cannot show that: torch still calls oneDNN, which then has no bf16 matmul and fails.

Debian's torch calls BLIS through libblas.so.3, and that BLIS, like the one fusedhead links, does not recognise
recent AMD CPUs: left alone it runs its generic kernels on one thread (about 30 GFLOP/s here). The torch cases
therefore get the kernel set fusedhead selects (BLIS_ARCH_TYPE) and --threads BLAS threads (BLIS_NUM_THREADS),
unless those variables are set already, so that fusedhead is compared with torch at its best on this machine;
--torch-blas-as-installed leaves them alone.

Run with Debian's interpreter (it has python3-torch), the library built in build/:
  /usr/bin/python3 bench/torch_compare.py --n 1024 --hidden 1024 --vocab 32768 --threads 2
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time


def rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    if args.torch_without_onednn:
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(0)
    n, h, v = args.n, args.hidden, args.vocab
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hidden = ((torch.rand(n, h) * 2 - 1)).to(dtype).requires_grad_(True)
    weight = ((torch.rand(v, h) * 2 - 1) * (3.0 / h) ** 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,))
    # Gradient buffers exist before measuring: a trainer keeps them across steps.
    hidden.grad = torch.zeros_like(hidden)
    weight.grad = torch.zeros_like(weight)

    if args.case == "torch_eager":
        def step():
            F.cross_entropy(F.linear(hidden, weight), targets).backward()
    elif args.case == "torch_chunked":
        def step():
            for start in range(0, n, args.chunk):
                rows = slice(start, min(n, start + args.chunk))
                logits = F.linear(hidden[rows], weight)
                (F.cross_entropy(logits, targets[rows], reduction="sum") / n).backward()
    elif args.case == "torch_compile":
        compiled = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w), y))

        def step():
            compiled(hidden, weight, targets).backward()
        step()  # compiles
    else:
        import fusedhead
        from fusedhead.torch import fused_linear_cross_entropy

        fusedhead.set_default_context_settings(threads=args.threads)

        def step():
            fused_linear_cross_entropy(hidden, weight, targets).backward()

    base = rss_bytes("VmRSS:")
    reset_peak()
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(args.reps):
        hidden.grad.zero_()
        weight.grad.zero_()
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    peak = rss_bytes("VmHWM:") - base
    result = {"case": args.case, "best_ms": best * 1e3, "first_ms": first * 1e3, "peak_rss_growth_bytes": peak}
    if args.case == "fusedhead":
        result["binding_overhead"] = binding_overhead(args, hidden, weight, targets, step)
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


def import_fusedhead():
    # The package from this checkout (and the library it finds in build/) unless one is on the path already.
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
    import fusedhead
    return fusedhead


def torch_blas_env(threads):
    """The environment of the torch cases: BLIS_ARCH_TYPE as fusedhead sets it when it loads (read back from the
    C environment, which os.environ does not see) and BLIS_NUM_THREADS, each unless already set."""
    env = dict(os.environ)
    env.setdefault("BLIS_NUM_THREADS", str(threads))
    if "BLIS_ARCH_TYPE" not in env:
        import_fusedhead().load_library()
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        arch = libc.getenv(b"BLIS_ARCH_TYPE")
        if arch is not None:
            env["BLIS_ARCH_TYPE"] = arch.decode()
    return env


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--json", action="store_true")
    p.add_argument("--torch-blas-as-installed", action="store_true",
                   help="run torch with BLIS as Debian leaves it (generic kernels, one thread here)")
    p.add_argument("--torch-without-onednn", action="store_true",
                   help="torch as on a CPU without AVX-512: its bf16 matmul without oneDNN")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        if args.case == "fusedhead":
            import_fusedhead()
        run_case(args)
        return
    try:
        import torch
    except ImportError:
        print("torch_compare: PyTorch is not installed for this interpreter (Debian: python3-torch)", file=sys.stderr)
        sys.exit(2)
    torch_env = None if args.torch_blas_as_installed else torch_blas_env(args.threads)
    results = []
    cases = ("torch_eager", "torch_chunked") + (("torch_compile",) if hasattr(torch, "compile") else ()) + ("fusedhead",)
    for case in cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case] + [
            f"--{k}={getattr(args, k)}" for k in ("n", "hidden", "vocab", "threads", "reps", "chunk", "dtype")] + (
            ["--torch-without-onednn"] if args.torch_without_onednn else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env=torch_env if case != "fusedhead" else None)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            if case == "torch_compile":  # inductor needs a C++ compiler: say so and compare the others
                print("torch_compare: torch_compile failed (above); left out", file=sys.stderr)
                continue
            sys.exit(1)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    flops = 6.0 * args.n * args.hidden * args.vocab
    eager = results[0]["best_ms"]
    for r in results:
        r["gflops"] = flops / (r["best_ms"] * 1e6)
        r["speedup_vs_torch_eager"] = eager / r["best_ms"]
    if args.json:
        print(json.dumps({"n": args.n, "hidden": args.hidden, "vocab": args.vocab, "threads": args.threads,
                          "dtype": args.dtype, "cases": results}, indent=2))
        return
    blas = "as installed" if torch_env is None else \
        f"BLIS_ARCH_TYPE={torch_env.get('BLIS_ARCH_TYPE', 'unset')} BLIS_NUM_THREADS={torch_env['BLIS_NUM_THREADS']}"
    print(f"torch_compare: N={args.n} H={args.hidden} V={args.vocab}, {args.dtype}, {args.threads} threads, "
          f"torch {torch.__version__}{' without oneDNN' if args.torch_without_onednn else ''}"
          f" (BLAS: {blas}), best of {args.reps}\n")
    print(f"{'case':<15} {'best ms':>10} {'GFLOP/s':>9} {'first ms':>10} {'peak RSS +':>12} {'vs eager':>9}")
    for r in results:
        print(f"{r['case']:<15} {r['best_ms']:>10.1f} {r['gflops']:>9.1f} {r['first_ms']:>10.1f} "
              f"{r['peak_rss_growth_bytes'] / 2**20:>8.1f} MiB {r['speedup_vs_torch_eager']:>8.2f}x")
    o = results[-1]["binding_overhead"]
    print(f"\nbinding overhead (fusedhead process, interleaved, best of {args.reps}): C train step "
          f"(fusedhead.numpy.forward_backward, preallocated outputs) {o['c_step_ms']:.1f} ms")
    for key, label in (("set_to_none_false", "zero_grad(set_to_none=False), torch 1.13's default"),
                       ("set_to_none_true", "zero_grad(set_to_none=True), torch 2's default")):
        print(f"  fusedhead.torch, {label + ':':<52} {o['binding_ms'][key]:>8.1f} ms  "
              f"{o['ratio_to_c_step'][key]:.3f}x the C step")


if __name__ == "__main__":
    main()
