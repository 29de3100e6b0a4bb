"""The ctypes layer: struct layouts against the C header, enums, library lookup, contexts, errors, import."""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fusedhead
from fusedhead import _core, _lib
from conftest import REPO_ROOT, make_data, subprocess_env

HEADER_DIR = REPO_ROOT / "include"
ENUMS = ((_lib.Status, "FH_"), (_lib.Param, "FH_PARAM_"), (_lib.Layout, "FH_LAYOUT_"), (_lib.Dtype, "FH_DTYPE_"),
         (_lib.Reduction, "FH_REDUCTION_"), (_lib.GRPOLossType, "FH_GRPO_LOSS_"), (_lib.GRPOISLevel, "FH_GRPO_IS_"),
         (_lib.GRPOVllmISMode, "FH_GRPO_VLLM_IS_"),
         (_lib.PreferenceLoss, "FH_PREFERENCE_"), (_lib.PreferenceLossType, "FH_PREFERENCE_"),
         (_lib.DPOSemantics, "FH_PREFERENCE_"),
         (_lib.FilterTail, "FH_FILTER_TAIL_"), (_lib.KTOLossType, "FH_KTO_LOSS_"))


# ------------------------------------------------------------------------------------------------------------
# Struct layouts and enum values, checked by compiling against include/fusedhead.h
# ------------------------------------------------------------------------------------------------------------
def _layout_program() -> str:
    lines = ["#include <fusedhead.h>", "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for cls in _lib.STRUCTS:
        name = cls.__name__
        lines.append(f'  printf("{name} sizeof %zu\\n", sizeof({name}));')
        for field, _ in cls._fields_:
            lines.append(f'  printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    for enum_cls, prefix in ENUMS:
        for member in enum_cls:
            lines.append(f'  printf("enum {prefix}{member.name} %d\\n", (int){prefix}{member.name});')
    lines += ["  return 0;", "}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (HEADER_DIR / "fusedhead.h").exists():
        pytest.skip("no C compiler or header to check the struct layouts against")
    d = tmp_path_factory.mktemp("layout")
    (d / "layout.c").write_text(_layout_program())
    subprocess.run([cc, "-std=c11", "-I", str(HEADER_DIR), str(d / "layout.c"), "-o", str(d / "layout")], check=True,
                   capture_output=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return dict((" ".join(line.split()[:-1]), int(line.split()[-1])) for line in out.splitlines())


@pytest.mark.parametrize("cls", _lib.STRUCTS, ids=lambda c: c.__name__)
def test_struct_layout_matches_header(cls, c_layout):
    name = cls.__name__
    assert ctypes.sizeof(cls) == c_layout[f"{name} sizeof"]
    for field, _ in cls._fields_:
        assert getattr(cls, field).offset == c_layout[f"{name} {field}"], field


def test_enum_values_match_header(c_layout):
    enums = {k[len("enum "):]: v for k, v in c_layout.items() if k.startswith("enum ")}
    assert enums and all(enums[f"{p}{m.name}"] == int(m) for enum_cls, p in ENUMS for m in enum_cls)


def test_options_init_defaults_match_python_defaults():
    opts = _lib.fh_ce_options()
    assert fusedhead.load_library().fh_ce_options_init(ctypes.byref(opts)) == 0
    assert (opts.ignore_index, opts.reduction, opts.label_smoothing, bool(opts.class_weights), opts.softcap,
            opts.z_loss, opts.logit_scale, opts.token_scaling) == (-100, 0, 0.0, False, 0.0, 0.0, 1.0, 0)
    # the preference front ends' defaults are TRL's, which fh_preference_options_init also sets
    init = _lib.fh_preference_options()
    assert fusedhead.load_library().fh_preference_options_init(ctypes.byref(init)) == 0
    ours = _core.preference_options()
    value = lambda o, f: list(getattr(o, f)) if isinstance(getattr(o, f), ctypes.Array) else getattr(o, f)  # noqa: E731
    assert [value(ours, f) for f, _ in init._fields_] == [value(init, f) for f, _ in init._fields_]
    # GRPO: TRL GRPOConfig's defaults (loss_type dapo, sequence_mask, clip_max 3, VESPO's k and lambda, ...) in both,
    # None (absent) being the library's NaN
    init = _lib.fh_grpo_options()
    assert fusedhead.load_library().fh_grpo_options_init(ctypes.byref(init)) == 0
    ours = _core.grpo_options()
    same = lambda a, b: a == b or (a != a and b != b)  # noqa: E731
    for field, _ in init._fields_:
        assert same(getattr(ours, field), getattr(init, field)), (field, getattr(ours, field), getattr(init, field))


# ------------------------------------------------------------------------------------------------------------
# Package, version, library lookup
# ------------------------------------------------------------------------------------------------------------
def test_version_matches_cmake():
    m = re.search(r"project\(fusedhead VERSION ([0-9.]+)", (REPO_ROOT / "CMakeLists.txt").read_text())
    assert m and fusedhead.__version__ == m.group(1)


def test_version_of_a_package_outside_a_checkout(tmp_path):
    """Away from CMakeLists.txt, __version__ is the installed distribution's, or "unknown" for a copy made by hand."""
    shutil.copytree(REPO_ROOT / "python" / "fusedhead", tmp_path / "fusedhead",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-c", "import fusedhead; print(fusedhead.__version__)"], capture_output=True,
                       text=True, env=subprocess_env(PYTHONPATH=str(tmp_path)), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    try:
        expected = importlib.metadata.version("fusedhead")
    except importlib.metadata.PackageNotFoundError:
        expected = "unknown"
    assert r.stdout.strip() == expected


def test_wheel_version_comes_from_cmake():
    """pyproject.toml's version regex reads the same version from CMakeLists.txt (an installed wheel's
    __version__ is its metadata's; python/tests/test_wheel.py checks that)."""
    tomllib = pytest.importorskip("tomllib")
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["scikit-build"]["metadata"]["version"]
    assert config["input"] == "CMakeLists.txt"
    m = re.search(config["regex"], (REPO_ROOT / "CMakeLists.txt").read_text())
    assert m and m.group("value") == fusedhead.__version__


def test_kernel_info():
    info = fusedhead.kernel_info()
    assert isinstance(info.kernel_set, str) and info.kernel_set
    assert info.elementwise in ("avx512", "avx2", "portable")
    assert isinstance(info.selected_by_library, bool) and isinstance(info.user_override, bool)
    assert info.bf16_path in ("native", "convert", "refused") and info.bf16_gemm.startswith(info.bf16_path + " (")
    assert info.fp32_path in ("blis", "onednn", "refused") and info.fp32_gemm.startswith(info.fp32_path + " (")
    assert fusedhead.bf16_available() == (info.refusal is None)


@pytest.mark.parametrize("variable, value", [("FH_ROW_KERNELS", "sse9"), ("FH_BF16_GEMM", "fast"),
                                             ("FH_FP32_GEMM", "mkl")])
def test_refused_kernels(variable, value):
    """A forced kernel choice that cannot run is reported, bf16_available() says so, and a call raises
    KernelsUnavailableError naming the variable."""
    code = ("import numpy as np, fusedhead, fusedhead.numpy as fnp\n"
            "info = fusedhead.kernel_info()\n"
            "print(info.refusal); print(fusedhead.bf16_available())\n"
            "x = np.full((2, 4), 0x3f80, np.uint16); w = np.full((8, 4), 0x3f80, np.uint16)\n"
            "try:\n"
            "    fnp.cross_entropy(x, w, np.zeros(2, np.int64), dtype='bf16')\n"
            "except fusedhead.errors.KernelsUnavailableError as e:\n"
            "    print('raised', e.status)\n")
    r = _run_python(code, **{variable: value})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert variable in lines[0] and value in lines[0] and lines[1] == "False" and lines[2] == "raised 32", r.stdout


def _run_python(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(**env),
                          cwd=str(REPO_ROOT))


def test_import_does_not_import_torch():
    r = _run_python("import sys, fusedhead; fusedhead.kernel_info(); fusedhead.numpy.forward; "
                    "print('torch' in sys.modules, fusedhead.library_path())")
    assert r.returncode == 0, r.stderr
    imported, path = r.stdout.split()
    assert imported == "False"


def test_env_var_selects_library():
    lib = fusedhead.library_path()
    r = _run_python("import fusedhead; print(fusedhead.library_path())", FUSEDHEAD_LIBRARY=lib)
    assert r.returncode == 0 and r.stdout.strip() == lib


def test_env_var_bad_path_is_an_error():
    r = _run_python("import fusedhead; fusedhead.kernel_info()", FUSEDHEAD_LIBRARY="/nonexistent/libfusedhead.so")
    assert r.returncode != 0
    assert "LibraryNotFoundError" in r.stderr and "FUSEDHEAD_LIBRARY" in r.stderr


def test_build_tree_lookup_without_env_var():
    if not _lib.build_tree_candidates():
        pytest.skip("no build*/libfusedhead.so* in the repository")
    r = _run_python("import fusedhead; print(fusedhead.library_path())", FUSEDHEAD_LIBRARY=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(REPO_ROOT / "build"))


def test_import_from_build_tree_loads_that_build(tmp_path):
    # CMake links <build>/fusedhead to python/fusedhead; `python3 -c "import fusedhead"` run in <build> (no
    # PYTHONPATH, no FUSEDHEAD_LIBRARY) must load <build>'s library, even when another build/ exists.
    build = tmp_path / "build-elsewhere"
    build.mkdir()
    shutil.copy(fusedhead.library_path(), build / "libfusedhead.so")
    (build / "fusedhead").symlink_to(REPO_ROOT / "python" / "fusedhead")
    env = subprocess_env(FUSEDHEAD_LIBRARY=None, PYTHONPATH=None)
    r = subprocess.run([sys.executable, "-c", "import fusedhead; print(fusedhead.library_path())"],
                       capture_output=True, text=True, env=env, cwd=str(build))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(build / "libfusedhead.so")


def test_build_tree_candidate_order(tmp_path):
    pkg = tmp_path / "python" / "fusedhead"
    pkg.mkdir(parents=True)
    for rel in ("build-z/libfusedhead.so", "build/libfusedhead.so.0", "build/libfusedhead.so.0.1.0",
                "build-a/libfusedhead.so", "build-a/libfusedhead.so.0", "other/libfusedhead.so"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    got = [str(p.relative_to(tmp_path)) for p in _lib.build_tree_candidates(pkg)]
    assert got == ["build/libfusedhead.so.0", "build/libfusedhead.so.0.1.0", "build-a/libfusedhead.so",
                   "build-a/libfusedhead.so.0", "build-z/libfusedhead.so"]


def _package_copy(root, library=None):
    """A copy of the package at root/python/fusedhead, with `library` copied in as its bundled libfusedhead.so, as
    `pip install .` puts it; root/CMakeLists.txt makes root a checkout for __version__."""
    package = root / "python" / "fusedhead"
    shutil.copytree(REPO_ROOT / "python" / "fusedhead", package,
                    ignore=shutil.ignore_patterns("__pycache__", "libfusedhead*"))
    shutil.copy(REPO_ROOT / "CMakeLists.txt", root / "CMakeLists.txt")
    if library is not None:
        shutil.copy(library, package / "libfusedhead.so")
    return package


def test_bundled_library_comes_before_the_build_tree(tmp_path):
    # An installed package loads the library built with it, even beside a build tree.
    package = _package_copy(tmp_path, fusedhead.library_path())
    (tmp_path / "build").mkdir()
    shutil.copy(fusedhead.library_path(), tmp_path / "build" / "libfusedhead.so")
    env = subprocess_env(FUSEDHEAD_LIBRARY=None, PYTHONPATH=str(package.parent))
    r = subprocess.run([sys.executable, "-c", "import fusedhead; print(fusedhead.library_path())"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(package / "libfusedhead.so")


@pytest.mark.parametrize("dependency, package", sorted(_lib.DEPENDENCY_PACKAGES.items()))
def test_dependency_error_names_the_debian_package(dependency, package):
    message = f"{dependency}: cannot open shared object file: No such file or directory"
    e = _lib.dependency_error("/site-packages/fusedhead/libfusedhead.so", message)
    assert isinstance(e, fusedhead.MissingDependencyError) and isinstance(e, fusedhead.LibraryNotFoundError)
    assert (e.dependency, e.package) == (dependency, package)
    assert f"needs {dependency}" in str(e) and f"apt-get install {package}" in str(e)


def test_dependency_error_only_for_dependencies():
    library = "/x/libfusedhead.so"
    assert _lib.dependency_error(library, f"{library}: cannot open shared object file: No such file or directory") \
        is None  # the library itself is missing
    assert _lib.dependency_error(library, f"{library}: invalid ELF header") is None
    e = _lib.dependency_error(library, "libquux.so.7: cannot open shared object file: No such file or directory")
    assert e is not None and (e.dependency, e.package) == ("libquux.so.7", None)
    assert "apt-file search libquux.so.7" in str(e)


def test_dependency_table_covers_the_library():
    """Every shared library libfusedhead needs, glibc's aside, has its Debian package in DEPENDENCY_PACKAGES."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not found")
    dynamic = subprocess.run([readelf, "-d", fusedhead.library_path()], capture_output=True, text=True,
                             check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
    glibc = {n for n in needed if re.match(r"(libc|libm|libpthread|libdl|ld-linux[-\w]*)\.so", n)}
    assert needed - glibc and needed - glibc <= set(_lib.DEPENDENCY_PACKAGES), needed


@pytest.mark.parametrize("how", ["env_var", "bundled"])
def test_missing_dependency_raises_missing_dependency_error(tmp_path, how):
    """A libfusedhead.so whose dependency is absent raises MissingDependencyError naming it, not ctypes's OSError,
    whether named by FUSEDHEAD_LIBRARY or found bundled in the package."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library with a missing dependency")
    dep_dir = tmp_path / "dep"
    dep_dir.mkdir()
    (tmp_path / "dep.c").write_text("int fh_absent_dep(void) { return 1; }\n")
    (tmp_path / "lib.c").write_text("int fh_absent_dep(void);\nint fh_lib(void) { return fh_absent_dep(); }\n")
    dep = dep_dir / "libfh_absent_dep.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libfh_absent_dep.so.1", "-o", str(dep),
                    str(tmp_path / "dep.c")], check=True, capture_output=True)
    lib = tmp_path / "libfusedhead.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "lib.c"), str(dep)], check=True,
                   capture_output=True)
    shutil.rmtree(dep_dir)
    if how == "env_var":
        env = subprocess_env(FUSEDHEAD_LIBRARY=str(lib))
    else:
        env = subprocess_env(FUSEDHEAD_LIBRARY=None, PYTHONPATH=str(_package_copy(tmp_path / "repo", lib).parent))
    code = ("import fusedhead\n"
            "try:\n"
            "    fusedhead.load_library()\n"
            "except fusedhead.MissingDependencyError as e:\n"
            "    print(e.dependency, e.package)\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "libfh_absent_dep.so.1 None", r.stdout
    assert "needs libfh_absent_dep.so.1, which is not installed" in lines[1], r.stdout


# ------------------------------------------------------------------------------------------------------------
# Context and errors
# ------------------------------------------------------------------------------------------------------------
def test_context_parameters():
    with fusedhead.Context(threads=2, tile_rows=16, tile_vocab=128, memory_budget=1 << 20) as ctx:
        assert (ctx.threads, ctx.tile_rows, ctx.tile_vocab, ctx.memory_budget) == (2, 16, 128, 1 << 20)
        ctx.threads = 1
        assert ctx.get("threads") == 1 and ctx.get(fusedhead.Param.THREADS) == 1
        lo, hi = fusedhead.Context.bounds("threads")
        assert lo == 0 and hi >= 1
        with pytest.raises(fusedhead.errors.InvalidParamValueError) as info:
            ctx.threads = hi + 1
        e = info.value
        assert e.status == 31 and e.status_name == "FH_ERR_INVALID_PARAM_VALUE"
        assert f"{hi + 1} is outside [0, {hi}]" in e.message and e.message in str(e)
        assert ctx.message == e.message
        assert ctx.threads == 1  # unchanged
        with pytest.raises(ValueError, match="unknown parameter"):
            ctx.get("warp_size")
        with pytest.raises(fusedhead.errors.InvalidParamError):
            ctx.set(99, 1)
        assert "threads=1" in repr(ctx)
    assert ctx.closed and "closed" in repr(ctx)
    with pytest.raises(ValueError, match="closed"):
        ctx.threads = 1


def test_threads_clamped_to_the_cpus_available():
    cpus = len(os.sched_getaffinity(0))
    with fusedhead.Context(threads=64) as ctx:
        assert ctx.threads == 64 and 1 <= ctx.threads_in_use <= cpus
        ctx.oversubscribe = True
        assert ctx.threads_in_use == 64 and "oversubscribe" not in repr(ctx)
    with fusedhead.Context(threads=1) as ctx:
        assert ctx.threads_in_use == 1


def test_integers_beyond_int64_are_refused_not_wrapped():
    with fusedhead.Context() as ctx:
        with pytest.raises(OverflowError, match="threads"):
            ctx.threads = 2**64 + 2
        assert ctx.threads == 0
    x = np.zeros((4, 3), np.float32)
    w = np.zeros((5, 3), np.float32)
    with pytest.raises(OverflowError, match="ignore_index"):
        fusedhead.numpy.forward(x, w, np.zeros(4, np.int64), ignore_index=2**64 - 100)


def test_filter_stats_describe_the_last_call_even_a_refused_one():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (64, 16)).astype(np.float32)
    w = rng.uniform(-1, 1, (500, 16)).astype(np.float32)
    with fusedhead.Context(grad_filter_eps=1e-3) as ctx:
        fusedhead.numpy.forward_backward(x, w, rng.integers(0, 500, 64), context=ctx)
        assert ctx.filter_stats()[0] > 0
        with pytest.raises(fusedhead.errors.TargetOutOfRangeError):
            fusedhead.numpy.forward_backward(x, w, np.full(64, 900), context=ctx)
        assert ctx.filter_stats() == (0.0, 0.0)


def test_bad_wisdom_file_fails_context_creation_at_once():
    # /dev/zero never ends: refused as not a regular file, within the subprocess's timeout, naming FH_WISDOM.
    r = subprocess.run([sys.executable, "-c", "import fusedhead; fusedhead.Context()"], capture_output=True, text=True,
                       env=subprocess_env(FH_WISDOM="/dev/zero"), cwd=str(REPO_ROOT), timeout=60)
    assert r.returncode != 0
    assert "WisdomIOError" in r.stderr, r.stderr
    assert "FH_WISDOM=/dev/zero" in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_workspace_over_an_input_raises_overlapping_buffers_error():
    rng = np.random.default_rng(3)
    arena = np.zeros(1 << 16, np.float32)
    x = arena[:64].reshape(16, 4)
    x[:] = rng.uniform(-1, 1, (16, 4))
    w = rng.uniform(-1, 1, (32, 4)).astype(np.float32)
    y = np.arange(16) % 32
    with fusedhead.Context() as ctx:
        ctx.set_workspace(arena[32:])  # starts inside x
        before = arena.copy()
        with pytest.raises(fusedhead.errors.OverlappingBuffersError, match="workspace overlaps x"):
            fusedhead.numpy.forward_backward(x, w, y, context=ctx)
        assert np.array_equal(arena, before)  # nothing written


def test_context_budget_too_small():
    x, w, t, _, _ = make_data(seed=1)
    with fusedhead.Context(memory_budget=1024) as ctx:
        with pytest.raises(fusedhead.errors.BudgetTooSmallError, match="budget"):
            fusedhead.numpy.forward(x, w, t, context=ctx)


def test_context_check_finite():
    x, w, t, _, _ = make_data(seed=2)
    try:
        ctx = fusedhead.Context(check_finite=True)
    except fusedhead.errors.InvalidParamError:
        pytest.skip("library without FH_PARAM_CHECK_FINITE")
    x[5, 3] = np.nan
    with pytest.raises(fusedhead.errors.NonfiniteInputError, match=r"x\[5\]\[3\] is not finite"):
        fusedhead.numpy.forward(x, w, t, context=ctx)
    assert np.isnan(fusedhead.numpy.forward(x, w, t).loss)  # default: NaN propagates
    ctx.close()


def test_status_strings_and_error_classes():
    for status in fusedhead.Status:
        assert fusedhead.status_string(status)
    assert set(fusedhead.errors.ERROR_CLASSES) == set(fusedhead.Status) - {fusedhead.Status.OK}  # one class each
    assert fusedhead.status_string(999)  # generic text for unknown values
    for status, cls in fusedhead.errors.ERROR_CLASSES.items():
        e = fusedhead.errors.error_for(status, fusedhead.status_string(status), "detail", "fh_x")
        assert type(e) is cls and e.status == status and isinstance(e, fusedhead.FusedheadError)
        if status in (32, 40, 60):  # the CPU, the GEMM provider or MPI: neither the caller's values nor memory
            assert not isinstance(e, (ValueError, MemoryError, OSError))
        else:
            assert isinstance(e, MemoryError if 20 <= status <= 22 else OSError if status == 23 else ValueError)
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and str(again) == str(e)
    assert type(fusedhead.errors.error_for(999, "?")) is fusedhead.FusedheadError


def test_status_values_follow_the_header():
    """fusedhead.Status holds exactly fh_status of include/fusedhead.h (every module's codes, one enum)."""
    text = (REPO_ROOT / "include" / "fusedhead.h").read_text()
    enum = text[text.index("typedef enum fh_status"):text.index("} fh_status;")]
    values = {m.group(1): int(m.group(2)) for m in re.finditer(r"FH_(\w+) = (\d+)", enum)}
    assert values == {s.name: int(s) for s in fusedhead.Status}
    assert len(set(values.values())) == len(values)  # no value shared


def test_default_context_settings():
    before = fusedhead.default_context_settings()
    try:
        fusedhead.set_default_context_settings(tile_vocab=32)
        assert fusedhead.default_context().tile_vocab == 32
        fusedhead.set_default_context_settings(tile_vocab=None)
        assert fusedhead.default_context().tile_vocab == 0
        with pytest.raises(ValueError, match="unknown settings"):
            fusedhead.set_default_context_settings(tiles=3)
    finally:
        fusedhead.set_default_context_settings(**{k: before.get(k) for k in ("tile_vocab", "threads")})


def test_library_dtype_status_raises_invalid_dtype_error():
    """The front ends refuse bf16 gradients of fp32 inputs themselves; called below them, the library's own
    FH_ERR_INVALID_DTYPE arrives as InvalidDtypeError, with the library's message naming the field."""
    from fusedhead.numpy import _view
    x, w, t, _, _ = make_data(seed=3)
    dx = np.empty_like(x)
    head = _core.LinearHead(_view(x, "hidden"), _view(w, "weight"), None, "vh")
    grads = head.grads(dx=_view(dx, "dhidden"), dtypes=(fusedhead.Dtype.BF16, fusedhead.Dtype.F32,
                                                         fusedhead.Dtype.F32))
    problem = _core.CEProblem(head, _view(t, "targets"))
    grad_output = np.ones(1, np.float32)
    before = dx.copy()
    with pytest.raises(fusedhead.errors.InvalidDtypeError, match="dx_dtype"):
        problem.forward_backward(fusedhead.default_context(), grad_output.ctypes.data, grads)
    assert np.array_equal(dx, before, equal_nan=True)  # outputs untouched on error
