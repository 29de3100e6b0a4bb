"""bench/peers.py end to end at a tiny shape: one head (DPO: two case processes, Liger's and fusedhead's), one rep,
one round, --json, fusedhead also under --memory-budget. Checks that the report has a row for every peer of the head,
each either measured or with its status and reason (a missing peer is never dropped), and that the measured cases
computed the same loss (the benchmark's semantic match of Liger's options to fusedhead's). Skipped, with the reason, where torch or Liger-Kernel
is not importable (python/requirements-bench.txt; scripts/install-deps installs it into .venv). 26 s of CPU time
(two processes that import torch, Liger compiling its loss); 69 s wall measured on a 2-core machine busy with a build.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytest.importorskip("torch")
if importlib.util.find_spec("liger_kernel") is None:
    pytest.skip("liger-kernel not importable: bench/peers.py's Liger peers need it (python/requirements-bench.txt, "
                "installed into .venv by scripts/install-deps)", allow_module_level=True)

PEERS_PY = REPO_ROOT / "bench" / "peers.py"


def test_peers_dpo_tiny_every_row():
    sys.path.insert(0, str(PEERS_PY.parent))
    import peers
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(PEERS_PY), "--shapes", "32x32x256", "--heads", "dpo", "--reps", "1",
                          "--rounds", "1", "--seq-len", "8", "--case-timeout", "120", "--memory-budget", "1", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    (block,) = report["blocks"]
    assert (block["head"], block["n"], block["sequences"], block["tokens_per_sequence"]) == ("dpo", 32, 4, 8)
    rows = {r["case"]: r for r in block["cases"]}
    budget_case = "fusedhead[memory_budget=1 MiB]"
    assert list(rows) == [budget_case if p == "fusedhead[budget]" else p for p in peers.PEERS["dpo"]]
    for r in rows.values():
        if r["status"] != "ok":
            assert r.get("error"), r  # a peer that did not run says why
            continue
        assert r["best_ms"] > 0 and r["peak_rss_growth_bytes"] >= 0 and r["gflops"] > 0, r
    assert rows["fusedhead"]["status"] == "ok", rows["fusedhead"]
    # The same loss under another budget: only the blocking (fp32 summation order) may differ.
    assert rows[budget_case]["loss"] == pytest.approx(rows["fusedhead"]["loss"], rel=1e-6)
    if rows["liger_dpo"]["status"] == "ok":
        assert rows["liger_dpo"]["loss"] == pytest.approx(rows["fusedhead"]["loss"], rel=1e-4)
        assert rows["fusedhead"]["vs_fastest_peer"] > 0
