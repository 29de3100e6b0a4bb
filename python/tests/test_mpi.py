"""fusedhead.mpi (mpi4py communicators, layouts from libfusedhead_mpi) under mpirun with 2 and 4 ranks: every grid
those allow (vocab-parallel, data-parallel, 2 x 2), fp32 and bf16, cross-entropy, log-probs, GRPO and KTO against the
single process (python/tests/parallel_ranks.py: what is compared and the bounds), a mismatch of options across ranks,
one rank's bad argument (an error on every rank, not a hang: the run's timeout fails the test), and a head without a
parallel entry point (python/tests/test_distributed.py: the same over torch.distributed). Skipped, saying why,
without mpirun, mpi4py or libfusedhead_mpi."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed (python/requirements-test.txt pins it)")
torch = pytest.importorskip("torch")

import fusedhead.mpi  # noqa: E402
from conftest import subprocess_env  # noqa: E402

RANKS = Path(__file__).with_name("parallel_ranks.py")


def _mpirun() -> str:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH (Debian: openmpi-bin)")
    try:
        fusedhead.mpi.load_mpi_library()
    except fusedhead.LibraryNotFoundError as e:
        pytest.skip(f"no libfusedhead_mpi: {e}")
    return mpirun


def _mpi_run(ranks: int, *script: str) -> subprocess.CompletedProcess:
    mpirun = _mpirun()
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    # Open MPI: more ranks than cores needs --oversubscribe, and root needs the two variables (CI runs as root)
    flags = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    env = subprocess_env(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                         OMPI_MCA_btl_vader_single_copy_mechanism="none", HF_HUB_OFFLINE="1",
                         FUSEDHEAD_LIBRARY=fusedhead.library_path(),
                         FUSEDHEAD_MPI_LIBRARY=fusedhead.mpi._mpi_library_path())
    return subprocess.run([mpirun, "-np", str(ranks), *flags, sys.executable, *script], env=env,
                          capture_output=True, text=True, timeout=300)  # a run takes 10-30 s; a hang fails


@pytest.mark.parametrize("ranks", [2, 4])
def test_heads_across_ranks_equal_the_single_process(ranks: int):
    run = _mpi_run(ranks, str(RANKS), "mpi")
    # mpirun forwards the ranks' output as it comes: their lines may run together
    summary = re.findall(r"rank \d+/\d+: \d+ checks, \d+ failures|rank \d+: FAILED [^\n]*", run.stdout)
    assert run.returncode == 0, "\n".join(summary) + "\n" + run.stderr[-4000:]
    assert len([s for s in summary if s.endswith(" 0 failures")]) == ranks, run.stdout


@pytest.mark.parametrize("parallel", ["data", "vocab"])
def test_example_trains_as_one_process(parallel: str):
    """examples/distributed/train_lm_mpi4py.py, 5 steps on 2 ranks: each step's loss within 1e-5 relative of one process
    training the same model on the same batches (the heads' own bound is 1e-6 per call; five Adam steps on weights
    whose gradients differ in their last bits let the losses drift a little further: 20 steps measured 8e-8)."""
    pytest.importorskip("transformers", reason="the example builds a transformers model")
    example = Path(__file__).parents[2] / "examples" / "distributed" / "train_lm_mpi4py.py"
    run = _mpi_run(2, str(example), "--parallel", parallel, "--steps", "5")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    worst = re.search(r"largest relative loss difference (\S+)", run.stdout)
    assert worst is not None and float(worst.group(1)) <= 1e-5, run.stdout
