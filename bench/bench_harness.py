"""The machinery the Python benchmarks share (bench/torch_compare.py, bench/peers.py): each case in a process of its
own, a warm-up step and the best of several, peak RSS growth, and what runs the GEMMs on either side.

Why a process per case: peak RSS (VmHWM) is per process and never goes down, and the allocator keeps what one case
freed for the next, so two cases in one process would read each other's memory. A case process prints one JSON
line as its last line of stdout; run_case_process reads it back, or the failure's last stderr line.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(BENCH_DIR, os.pardir, "python")


def rss_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now, VmHWM: its peak since the last reset_peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0), so that the peak measured is the steps' own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(step: Callable[[], Any], reps: int, zero_grads: Callable[[], None]) -> Dict[str, Any]:
    """A warm-up step, then the best of reps steps, each after zero_grads (a trainer keeps .grad across steps).

    Returns best_ms, first_ms (the warm-up), peak_rss_growth_bytes (the peak over all the steps above the RSS
    before the first; set-up done before the call, compilation included, is not counted) and loss (the last
    step's return value as a float, when it returns a tensor or a number: the cases of one head compute the same
    loss, so the values show that they agree)."""
    base = rss_bytes("VmRSS:")
    reset_peak()
    t = time.perf_counter()
    value = step()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(reps):
        zero_grads()
        t = time.perf_counter()
        value = step()
        best = min(best, time.perf_counter() - t)
    peak = rss_bytes("VmHWM:") - base
    loss = None
    if value is not None:
        try:
            loss = float(value)
        except (TypeError, ValueError, RuntimeError):
            loss = None
    return {"best_ms": best * 1e3, "first_ms": first * 1e3, "peak_rss_growth_bytes": peak, "loss": loss}


def run_case_process(cmd: List[str], env: Dict[str, str],
                     timeout: Optional[float] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """Runs one case process; returns (its JSON result, "") or (None, why it failed: the last line of its stderr
    that says something, or the time-out). A result may itself carry a "status" other than "ok" (a peer missing or
    refusing, as the case process decided)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = out.stdout.strip().splitlines()
    if lines:
        try:
            result = json.loads(lines[-1])
            if isinstance(result, dict):
                return result, out.stderr if out.returncode else ""
        except json.JSONDecodeError:
            pass
    said = [line.strip() for line in out.stderr.splitlines() if line.strip()]
    return None, (said[-1] if said else f"exit status {out.returncode}, nothing on stderr")


def import_fusedhead():
    """The package from this checkout (and the library it finds in build/, or FUSEDHEAD_LIBRARY) unless one is on
    the path already."""
    sys.path.append(PYTHON_DIR)
    import fusedhead
    return fusedhead


def fusedhead_setup(threads: int, dtype=None) -> Dict[str, str]:
    """Sets fusedhead's default context to `threads` threads, runs one tiny train step in `dtype` (a torch dtype;
    None: float32) and says which library and kernels it runs (as fh_bench's first line): the report keys
    fusedhead_library and fusedhead_kernels.

    The tiny step keeps one-time set-up out of the measurement, as the compile cases compile before it: the first
    call in a process starts OpenMP's threads and BLIS's packing-buffer pools (about 75 MiB of RSS here, whatever
    the shape), which a training run pays once, not per step. The context's workspace is not among it: sized for
    the tiny step, it grows in the measured steps, which count it."""
    fusedhead = import_fusedhead()
    fusedhead.set_default_context_settings(threads=threads)
    import torch
    from fusedhead.torch import fused_linear_cross_entropy
    hidden, weight = (torch.ones(shape, dtype=dtype or torch.float32, requires_grad=True)
                      for shape in ((2, 8), (16, 8)))
    fused_linear_cross_entropy(hidden, weight, torch.zeros(2, dtype=torch.int64)).backward()
    k = fusedhead.kernel_info()
    blis = k.kernel_set + (" (selected by fusedhead)" if k.selected_by_library else
                           " (BLIS_ARCH_TYPE set)" if k.user_override else "")
    return {"fusedhead_library": fusedhead.library_path(),
            "fusedhead_kernels": f"BLIS {blis}, row kernels {k.elementwise}, fp32 GEMM {k.fp32_gemm}, "
                                 f"bf16 GEMM {k.bf16_gemm}"}


def torch_gemm(torch) -> Tuple[str, bool]:
    """(description of what runs torch's GEMMs, whether its BLAS is a BLIS libblas), from its build configuration
    and the libraries it mapped."""
    config = torch.__config__.show()

    def find(pattern: str) -> Optional[str]:
        m = re.search(pattern, config)
        return m.group(1) if m else None
    blas_info = find(r"BLAS_INFO=(\w+)") or "unknown"
    with open("/proc/self/maps") as f:
        libblas = sorted({line.split()[-1] for line in f if "/libblas" in line})
    mkl, onednn = find(r"Math Kernel Library Version ([\w.]+)"), find(r"MKL-DNN (v[\d.]+)")
    fp32 = (f"MKL {mkl}" if blas_info == "mkl" and mkl else
            ", ".join(libblas) if blas_info == "generic" and libblas else "BLAS_INFO=" + blas_info)
    text = f"fp32 GEMM {fp32} (BLAS_INFO={blas_info}), bf16 GEMM oneDNN {onednn or '?'}"
    return text, any("blis" in path for path in libblas)


def torch_env(threads: int, blis: bool, as_installed: bool = False) -> Dict[str, str]:
    """The environment of the torch cases. For a BLIS libblas (Debian's torch): BLIS_ARCH_TYPE as fusedhead sets
    it when it loads (read back from the C environment, which os.environ does not see) and BLIS_NUM_THREADS, each
    unless already set, so that torch runs at its best on this machine (as_installed: neither). Always a copy of
    os.environ: a child started without env= would inherit the C environment, and with it the BLIS_ARCH_TYPE that
    loading fusedhead here sets."""
    env = dict(os.environ)
    if not blis or as_installed:
        return env
    env.setdefault("BLIS_NUM_THREADS", str(threads))
    if "BLIS_ARCH_TYPE" not in env:
        import_fusedhead().load_library()
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        arch = libc.getenv(b"BLIS_ARCH_TYPE")
        if arch is not None:
            env["BLIS_ARCH_TYPE"] = arch.decode()
    return env


def cpu_model() -> str:
    """The CPU's model name and its family/model/stepping, from /proc/cpuinfo (the tables name the CPU)."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}), {os.cpu_count()} CPUs")
