"""Shared helpers for the fusedhead Python tests.

Run from the repository root:
    FUSEDHEAD_LIBRARY=$PWD/build-py/libfusedhead.so PYTHONPATH=python /usr/bin/python3 -m pytest -q python/tests

Tolerances (fusedhead: fp32 storage and fp32 BLIS GEMMs, per-token statistics and reductions in double):
  - against torch float64 on the same (fp32-representable) inputs, the only error is fusedhead's fp32 GEMM
    rounding (about sqrt(K) * 6e-8 relative per dot product, K = H for logits, V or N for the gradient
    GEMMs) and fp32 storage of per-token values: loss relative error <= 1e-6 (the C test suite's bound vs its
    double reference), gradients normwise relative error <= 1e-5.
  - against torch float32, torch's own fp32 rounding (logits stored in fp32, fp32 log-softmax and
    reductions) adds to that: loss rtol 1e-5, gradients normwise 1e-4.
torch.autograd.gradcheck does not apply: it needs float64 inputs and the library computes in fp32, so finite
differences in fp32 would be noise; the float64 torch comparison replaces it (the C suite also checks its
double reference against central finite differences).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# The tests build their models and data locally: no Hugging Face Hub look-up (none can succeed on a machine without
# network access, and a look-up that waits for a timeout would only slow the suite).
for _offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_offline, "1")

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = PYTHON_DIR.parent
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

import fusedhead  # noqa: E402

LOSS_RTOL_F32, GRAD_RTOL_F32 = 1e-5, 1e-4
LOSS_RTOL_F64, GRAD_RTOL_F64 = 1e-6, 1e-5
# The per-token entropy against float64: its error is sum_j p_j (z_j - sum p z) dz_j, at most the fp32 logit error
# (~sqrt(H) 6e-8 |z| ~ 1e-6 at H = 24, |z| ~ 3-7) times the logits' spread (a few): ~5e-6 at worst here; 1e-5
# absolute, as tests/cases/ce_case.c's CE_ENTROPY_ABS_TOL for larger H.
ENTROPY_ATOL = 1e-5


def normwise(a, b) -> float:
    """||a - b|| / ||b|| (b the reference); 0 when both are 0."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)


def make_data(seed=0, n=37, h=24, v=300, *, bias=False, class_weights=False, ignore_frac=0.0, ignore_index=-100,
              logit_scale=3.0, layout="vh"):
    """float32 hidden [n, h], weight ([v, h] or [h, v]), int64 targets, optional bias and class weights, with
    logits of standard deviation about logit_scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * (logit_scale / np.sqrt(h))).astype(np.float32)
    if layout == "hv":
        w = np.ascontiguousarray(w.T)
    t = rng.integers(0, v, n).astype(np.int64)
    if ignore_frac > 0:
        t[rng.random(n) < ignore_frac] = ignore_index
    b = (rng.standard_normal(v) * 0.5).astype(np.float32) if bias else None
    cw = rng.uniform(0.2, 2.0, v).astype(np.float32) if class_weights else None
    return x, w, t, b, cw


TEST_THREADS = int(os.environ.get("FUSEDHEAD_TEST_THREADS", "1"))


@pytest.fixture(scope="session", autouse=True)
def single_threaded_defaults():
    """Default contexts (and torch) on one thread: the problems are tiny, and OpenMP barriers on a loaded
    2-core machine can cost a scheduler time slice each. Multi-threaded runs: the small_tiles and
    streaming contexts below use 2 threads (FUSEDHEAD_TEST_THREADS=0 runs everything on all processors)."""
    fusedhead.set_default_context_settings(threads=TEST_THREADS)
    try:
        import torch
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        torch = None
    yield
    fusedhead.set_default_context_settings(threads=None)
    if torch is not None:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def small_tiles():
    """Several vocabulary tiles and row blocks even at test sizes; 2 threads."""
    with fusedhead.Context(tile_rows=8, tile_vocab=64, threads=2) as ctx:
        yield ctx


@pytest.fixture(scope="session")
def streaming():
    """A budget too small for fh_ce_forward_backward's row blocks (64 full rows of V=517 floats), so the
    train step streams (forward, then backward); 2 threads."""
    with fusedhead.Context(memory_budget=64 * 1024, threads=2) as ctx:
        yield ctx


def subprocess_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: v for k, v in extra.items() if v is not None})
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
    return env


# The tests of fusedhead's glue rather than its kernels (the ctypes layer, torch.compile's tracing, autograd's gradient
# buffers, the example's training run, the transformers and TRL integrations, the peers benchmark, the Python MPI
# front end: ctest runs the MPI kernels per variant) give the same
# results on every kernel variant: scripts/test runs them in one variant and sets FH_KERNEL_TESTS_ONLY=1 in the others.
GLUE_MODULES = {"test_lib", "test_compile", "test_torch_grad_buffers", "test_example_train", "test_transformers",
                "test_trl", "test_trl_own_losses", "test_trl_trainers", "test_bench_peers", "test_mpi", "test_dtensor",
                "test_distributed"}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FH_KERNEL_TESTS_ONLY") != "1":
        return
    skip = pytest.mark.skip(reason="a test of fusedhead's glue, not of its kernels: run in one kernel variant "
                                   "(scripts/test: the first); FH_KERNEL_TESTS_ONLY=1 skips it here")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in GLUE_MODULES:
            item.add_marker(skip)
