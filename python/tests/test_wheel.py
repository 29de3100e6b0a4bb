"""`pip install .` end to end: build the wheel (its build compiles libfusedhead), install it into a throwaway virtual
environment, and from a directory outside the repository, with neither PYTHONPATH nor FUSEDHEAD_LIBRARY set, run a
cross-entropy train step: the installed package must load the library inside it.

The build takes 1 to 3 minutes on 2 cores, so this runs only with FH_TEST_WHEEL=1 (scripts/test sets it in one kernel
variant's pass), and only where scikit-build-core is importable: the wheel is built without build isolation, which
would download it (.venv has it, python/requirements-test.txt).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from conftest import GRAD_RTOL_F64, LOSS_RTOL_F64, REPO_ROOT

if os.environ.get("FH_TEST_WHEEL") != "1":
    pytest.skip("builds and installs a wheel (1 to 3 minutes): set FH_TEST_WHEEL=1 to run it (scripts/test does, in "
                "one kernel variant)", allow_module_level=True)
pytest.importorskip("scikit_build_core", reason="scikit-build-core not importable: python/requirements-test.txt "
                    "installs it in .venv")
torch = pytest.importorskip("torch")

# Run inside the throwaway environment: a train step, checked against torch in float64 there, and what was loaded.
TRAIN_STEP = """
import json, pathlib
import torch
import torch.nn.functional as F
import fusedhead
import fusedhead.torch

torch.manual_seed(0)
x = torch.randn(6, 16, requires_grad=True)
w = (torch.randn(40, 16) * 0.5).requires_grad_()
y = torch.randint(0, 40, (6,))
loss = fusedhead.torch.fused_linear_cross_entropy(x, w, y)
loss.backward()
x64 = x.detach().double().requires_grad_()
w64 = w.detach().double().requires_grad_()
ref = F.cross_entropy(F.linear(x64, w64), y)
ref.backward()
rel = lambda a, b: float((a.double() - b).norm() / b.norm())
mpi = pathlib.Path(fusedhead.__file__).parent / "libfusedhead_mpi.so"
if mpi.exists():  # fusedhead.mpi finds it beside the package's libfusedhead; its dependencies resolve as installed
    import fusedhead.mpi
    fusedhead.mpi.load_mpi_library()
    assert pathlib.Path(fusedhead.mpi._mpi_library_path()).resolve() == mpi.resolve()
print(json.dumps({"loss_error": abs(loss.item() - ref.item()) / abs(ref.item()),
                  "dx_error": rel(x.grad, x64.grad), "dw_error": rel(w.grad, w64.grad),
                  "package": fusedhead.__file__, "library": fusedhead.library_path(),
                  "kernel_info": str(fusedhead.kernel_info()), "version": fusedhead.__version__,
                  "mpi": mpi.exists()}))
"""


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert r.returncode == 0, f"{' '.join(map(str, args))} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def test_wheel_installs_and_loads_its_own_library(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FUSEDHEAD_LIBRARY")}
    build_env = dict(env, CMAKE_BUILD_PARALLEL_LEVEL=str(len(os.sched_getaffinity(0))))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", REPO_ROOT, "--no-deps", "--no-build-isolation", "-w", wheels],
         env=build_env, timeout=1200)
    wheel, = wheels.glob("fusedhead-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], env=env, timeout=300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], env=env, timeout=300)
    # torch and NumPy come from this interpreter's environment, not reinstalled: a .pth file appends their
    # directories to the throwaway environment's path (after its own site-packages, which holds the wheel).
    # --system-site-packages would not do: it exposes the base installation, not a virtual environment running this.
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    deps = sorted({str(Path(m.__file__).resolve().parents[1]) for m in (torch, numpy)})
    (Path(site) / "fusedhead_test_deps.pth").write_text("\n".join(deps) + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    r = _run([python, "-c", TRAIN_STEP], env=env, cwd=outside, timeout=300)
    got = json.loads(r.stdout.splitlines()[-1])
    print(f"wheel {wheel.name}: library {got['library']}, {got['kernel_info']}, libfusedhead_mpi: {got['mpi']}")
    assert Path(got["package"]).resolve().is_relative_to(venv.resolve()), got
    assert Path(got["library"]).resolve().is_relative_to(venv.resolve()), got
    cmake = re.search(r"project\(fusedhead VERSION ([0-9.]+)", (REPO_ROOT / "CMakeLists.txt").read_text())
    assert cmake and got["version"] == cmake.group(1)
    assert got["loss_error"] <= LOSS_RTOL_F64, got
    assert got["dx_error"] <= GRAD_RTOL_F64 and got["dw_error"] <= GRAD_RTOL_F64, got
