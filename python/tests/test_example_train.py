"""Smoke run of examples/train_tiny_lm.py: a few training steps of a tiny model on a few standard-library files,
with a 2048-piece tokenizer, in a temporary folder; then fh_bench replays the batch it saved (when fh_bench is
built beside the library).

Tolerances:
  - per-step loss agreement, fused against torch's materialized logits, 1e-5 relative (conftest LOSS_RTOL_F32:
    fp32 rounding of the logits, log-softmax and reductions). It holds for the two trajectories as well as on
    the same state because over the first tens of steps rounding differences have not yet been amplified: the
    example's default run stays below 3e-7 up to step 90, and its --control run, which only changes the rounding
    of torch's own logits, diverges as fast later on. A gradient 1% off in its structure breaks the bound within
    these 30 steps (tried: dhidden mixed across rows, step 1; dweight with 1% noise, step 27); a uniform scale of
    the gradients would not (Adam's steps do not depend on it).
  - the saved batch's loss, recomputed here in float64 from the .npy files, against the example's own
    (torch, fp32) value printed to 4 decimals: 1e-4 absolute (the printing's 5e-5 plus fp32 rounding).
"""
from __future__ import annotations

import csv
import glob
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import LOSS_RTOL_F32, REPO_ROOT, subprocess_env

pytest.importorskip("torch")
pytest.importorskip("sentencepiece", reason="the example's tokenizer needs sentencepiece (python3-sentencepiece)")
if not glob.glob("/usr/lib/python3.*/*.py"):
    pytest.skip("no Python standard library sources under /usr/lib/python3.*/", allow_module_level=True)

import fusedhead  # noqa: E402

VOCAB, HIDDEN, STEPS, ROWS = 2048, 32, 30, 128
EXAMPLE = REPO_ROOT / "examples" / "train_tiny_lm.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_lm")
    # One thread: a loaded 2-core machine makes OpenMP barriers cost a time slice each (conftest).
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--vocab", str(VOCAB), "--files", "6",
           "--tokenizer-bytes", "200000", "--corpus-bytes", "200000", "--hidden", str(HIDDEN), "--heads", "2",
           "--layers", "1", "--seq", "16", "--batch", "8", "--steps", str(STEPS), "--log-every", "1",
           "--stat-rows", "16", "--filter-tile-rows", "8", "--filter-eps", "2e-3", "--threads", "1", "--save-batch", str(out / "batch"), "--save-rows", str(ROWS)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "curves.csv") as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return out, rows, done.stdout


def test_curves_finite_and_decreasing(run):
    _, rows, _ = run
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    for name in ("loss_torch", "loss_fused", "loss_filtered", "held_out_torch", "held_out_fused", "held_out_filtered"):
        losses = np.array([r[name] for r in rows])
        assert np.all(np.isfinite(losses)), name
        # From about ln V = 7.6: the last three steps' mean at least 1 nat below the first three's.
        assert losses[-3:].mean() < losses[:3].mean() - 1.0, (name, losses)


def test_fused_tracks_materialized_at_every_step(run):
    _, rows, _ = run
    for r in rows:
        assert r["rel_diff"] <= LOSS_RTOL_F32, r
        assert r["same_state_rel_diff"] <= LOSS_RTOL_F32, r
        assert r["held_out_rel_diff"] <= LOSS_RTOL_F32, r


def test_filtered_run(run):
    """Run (c) trains through the filtered backward: at step 0 (one state, the forward is not filtered) its loss is
    run (b)'s bit for bit, it skips part of the backward work once the model has learned a little (the smoke's eps,
    2e-3, is about 4 / V: its 30 steps leave the softmax far flatter than the full example's 300 at 2^-12), and the
    skipped share is a fraction. How closely it tracks the exact run is measured on the full example (README), not
    here: a perturbation of the gradient of relative size ~eps grows along a trajectory, as rounding does in the
    --control run."""
    _, rows, _ = run
    assert rows[0]["loss_filtered"] == rows[0]["loss_fused"], rows[0]
    for r in rows:
        assert 0.0 <= r["skipped"] < 1.0, r
    assert max(r["skipped"] for r in rows) > 0.0, [r["skipped"] for r in rows]


def test_peakedness_statistics_in_range(run):
    _, rows, _ = run
    for r in rows:
        assert 0.0 < r["entropy"] <= math.log(VOCAB) + 1e-9, r
        for k in ("p_lt_2m12", "p_lt_2m28", "blocks_lt_2m12", "sorted_blocks_lt_2m12"):
            assert 0.0 <= r[k] <= 1.0, (k, r)
        assert r["p_lt_2m28"] <= r["p_lt_2m12"], r


def test_plot_or_its_script(run):
    out, _, _ = run
    assert (out / "curves.gp").is_file()
    if shutil.which("gnuplot"):
        assert (out / "loss.png").stat().st_size > 0 and (out / "distribution.png").stat().st_size > 0


def test_saved_batch(run):
    out, _, stdout = run
    hidden, targets, weight = (np.load(out / "batch" / f"{k}.npy") for k in ("hidden", "targets", "weight"))
    assert hidden.shape == (ROWS, HIDDEN) and hidden.dtype == np.float32 and hidden.flags.c_contiguous
    assert targets.shape == (ROWS,) and targets.dtype == np.int64
    assert weight.shape == (VOCAB, HIDDEN) and weight.dtype == np.float32 and weight.flags.c_contiguous
    assert np.all(np.isfinite(hidden)) and np.all((targets >= 0) & (targets < VOCAB))
    # The files are the trained model's: their loss is the one the example printed, and it has learned (a
    # misaligned or untrained batch would sit near ln V).
    z = hidden.astype(np.float64) @ weight.astype(np.float64).T
    m = z.max(axis=1)
    loss = float(np.mean(m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - z[np.arange(ROWS), targets]))
    printed = float(re.search(r"held-out loss ([0-9.]+)", stdout).group(1))
    assert abs(loss - printed) <= 1e-4, (loss, printed)
    assert loss < math.log(VOCAB) - 1.0, loss


def fh_bench() -> Path:
    """fh_bench of the build tree the tests' library comes from, if built."""
    path = Path(fusedhead.library_path()).resolve().parent / "bench" / "fh_bench"
    if not path.is_file():
        pytest.skip(f"fh_bench is not built beside the library ({path})")
    return path


def test_fh_bench_replays_the_saved_batch(run):
    out, _, _ = run
    done = subprocess.run([str(fh_bench()), "--distribution", str(out / "batch"), "--n", "100", "--reps", "1",
                           "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert f"N=100 H={HIDDEN} V={VOCAB}," in first and "inputs replay of" in first and "(real data)" in first, first
    assert "failed" not in done.stdout


@pytest.mark.parametrize("damage, message", [
    (lambda d: np.save(d / "hidden.npy", np.load(d / "hidden.npy").astype(np.float64)),
     "hidden.npy: dtype '<f8', expected '<f4' (float32)"),
    (lambda d: np.save(d / "weight.npy", np.asfortranarray(np.load(d / "weight.npy"))), "weight.npy: Fortran order"),
    (lambda d: np.save(d / "targets.npy", np.load(d / "targets.npy")[:-1]), "do not make a batch"),
    (lambda d: np.save(d / "targets.npy", np.full(ROWS, VOCAB, dtype=np.int64)), f"is outside [0, {VOCAB})"),
    (lambda d: (d / "weight.npy").write_bytes((d / "weight.npy").read_bytes()[:-4]), "weight.npy: truncated"),
    (lambda d: (d / "hidden.npy").write_bytes(b"not an array"), "hidden.npy: not a .npy file"),
], ids=["dtype", "fortran", "rows", "target_range", "truncated", "magic"])
def test_fh_bench_rejects_a_damaged_batch(run, tmp_path, damage, message):
    out, _, _ = run
    batch = tmp_path / "batch"
    shutil.copytree(out / "batch", batch)
    damage(batch)
    done = subprocess.run([str(fh_bench()), "--distribution", str(batch), "--reps", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stdout + done.stderr
