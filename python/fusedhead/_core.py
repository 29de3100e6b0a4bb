"""Backend-neutral core shared by fusedhead.numpy and fusedhead.torch (cross-entropy, GRPO, preference heads,
distillation).

Front ends turn their arrays into `View`s (address, shape, strides in elements) after checking dtype and
device; this module checks shapes and strides against each other, builds the C structs and calls the
library through a `Context`, turning a non-zero status into a FusedheadError.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import operator
import os
import threading
import warnings
import weakref
from typing import ContextManager, NamedTuple, Optional, Sequence, Tuple, Type, TypeVar, Union

from . import _lib
from ._lib import Dtype, FilterTail, Layout, Param, Reduction, Status, c_double_p, c_float_p, c_int64_p, fh_filter_stats, load_library
from .errors import FusedheadError, error_for


# ---------------------------------------------------------------------------------------------------------
# Status strings, BLIS info
# ---------------------------------------------------------------------------------------------------------
def status_string(status: int) -> str:
    """fh_status_string(status)."""
    s = load_library().fh_status_string(int(status))
    return s.decode() if s else ""


def int64(name: str, value) -> int:
    """value as a C int64_t: an integer (Python, NumPy, 0-d torch) within range, else OverflowError naming it
    (ctypes would wrap 2**64 + 2 to 2 silently)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None
    if not -(1 << 63) <= v < (1 << 63):
        raise OverflowError(f"{name} = {v} does not fit in a 64-bit signed integer")
    return v


def check_status(status: int, function: str, context: Optional["Context"] = None) -> None:
    """Raise the FusedheadError subclass for a non-zero status (with the context's message if any)."""
    if status != 0:
        message = context._message_unlocked() if context is not None else ""
        raise error_for(status, status_string(status), message, function)


class KernelInfo(NamedTuple):
    kernel_set: str  # BLIS configuration in use: "skx", "haswell", "generic", ...
    selected_by_library: bool  # fusedhead chose it (not BLIS or the user)
    user_override: bool  # BLIS_ARCH_TYPE was set in the environment
    elementwise: str  # fusedhead's row kernels: "avx512", "avx2" or "portable" (FH_ROW_KERNELS forces one)
    bf16_gemm: str  # the bf16 path and what runs it, e.g. "native (oneDNN 2.6.3 brg:avx512_core_bf16)" or
    #                 "convert (bf16 widened to f32, BLIS sgemm; oneDNN 2.6.3 unavailable)"
    bf16_path: str  # "native", "convert", or "refused" (FH_BF16_GEMM forces one this CPU or build lacks)
    refusal: Optional[str]  # why FH_ROW_KERNELS, FH_BF16_GEMM or FH_FP32_GEMM cannot be honoured, or None
    fp32_gemm: str  # the fp32 path and what runs it, e.g. "onednn (oneDNN 2.6.3: brg:avx512_core)" or
    # "blis (BLIS sgemm; oneDNN 2.6.3: gemm:jit)"
    fp32_path: str  # "blis", "onednn", or "refused" (FH_FP32_GEMM forces one this build lacks)


def kernel_info() -> KernelInfo:
    """What fh_kernel_query reports: the BLIS kernel set in use, fusedhead's element-wise kernels and the fp32 and
    bf16 GEMM providers."""
    info = _lib.fh_kernel_info()
    check_status(load_library().fh_kernel_query(ctypes.byref(info)), "fh_kernel_query")
    return KernelInfo((info.kernel_set or b"").decode(), bool(info.selected_by_library), bool(info.user_override),
                    (info.elementwise or b"").decode(), (info.bf16_gemm or b"").decode(),
                    (info.bf16_path or b"").decode(), info.refusal.decode() if info.refusal else None,
                    (info.fp32_gemm or b"").decode(), (info.fp32_path or b"").decode())


def bf16_available() -> bool:
    """Whether bf16 calls run here: true on every CPU (oneDNN's bf16 matmul, or bf16 widened to f32 for BLIS),
    false only when FH_ROW_KERNELS, FH_BF16_GEMM or FH_FP32_GEMM forces kernels this CPU or build lacks, or names none
    (kernel_info().refusal)."""
    return kernel_info().refusal is None


# ---------------------------------------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------------------------------------
ParamLike = Union[Param, int, str]
_REAL_PARAMS = frozenset({int(Param.GRAD_FILTER_EPS)})  # set with fh_context_set_real


def _param(param: ParamLike) -> int:
    if isinstance(param, str):
        try:
            return int(Param[param.upper()])
        except KeyError:
            raise ValueError(f"unknown parameter {param!r}; expected one of "
                             f"{', '.join(p.name.lower() for p in Param)}") from None
    return int(param)


class Context:
    """An fh_context: threads, tile sizes, memory budget, workspace, last error message.

    Settings (0 = the library's default): threads (0 = OpenMP's default; either is clamped to the CPUs this
    process may use unless oversubscribe is set; `threads_in_use` is what calls run), tile_rows, tile_vocab,
    memory_budget (bytes; default 512 MiB), check_finite (1: reject NaN/Inf inputs, if the library has it),
    fp32_du (1: with bf16 inputs keep dU (the logits' gradient) in fp32 for the gradient GEMMs: fp32-accurate, at the fp32 rate),
    grad_filter_eps (a float; 0 = off: gradient filtering skips the backward GEMMs' vocabulary columns whose
    softmax terms are below eps times their row's scale in every row of a block, as Cut Cross-Entropy does;
    `filter_stats()` tells what it skipped), grad_filter_tail ("estimate", the default: the skipped softmax terms
    are replaced by a rank-one estimate that keeps each row's skipped total; "drop": left out, as Cut
    Cross-Entropy does), batch_invariant (True: every per-token result, a token's loss, log-prob, entropy, its
    hidden-state gradient, is bit for bit the same whatever batch it is computed in: tiles and GEMMs chosen
    independently of the number of tokens, at some cost in speed; docs/correctness.md, "Batch invariance").
    Calls on one context are serialised by a lock (the library forbids concurrent calls on one context);
    use one context per thread for parallel calls. `default_context()` gives each thread its own.
    """

    def __init__(self, *, threads: Optional[int] = None, tile_rows: Optional[int] = None,
                 tile_vocab: Optional[int] = None, memory_budget: Optional[int] = None,
                 check_finite: Optional[bool] = None, fp32_du: Optional[bool] = None,
                 oversubscribe: Optional[bool] = None, grad_filter_eps: Optional[float] = None,
                 grad_filter_tail: Optional[str] = None, batch_invariant: Optional[bool] = None):
        self._lib = load_library()
        self._lock = threading.RLock()
        self._workspace = None
        # names this context in a torch op's arguments (an integer, which a trace can hold; context_by_key)
        self.key = next(_context_keys)
        _contexts_by_key[self.key] = self
        handle = ctypes.c_void_p()
        status = self._lib.fh_context_create(ctypes.byref(handle))
        if status != 0:  # no context holds the message: the library keeps this thread's last one (an FH_WISDOM fault)
            message = ctypes.c_char_p()
            self._lib.fh_context_message(None, ctypes.byref(message))
            raise error_for(status, status_string(status), (message.value or b"").decode(errors="replace"),
                            "fh_context_create")
        self._handle: Optional[ctypes.c_void_p] = handle
        settings = dict(threads=threads, tile_rows=tile_rows, tile_vocab=tile_vocab, memory_budget=memory_budget,
                        check_finite=None if check_finite is None else int(bool(check_finite)),
                        fp32_du=None if fp32_du is None else int(bool(fp32_du)),
                        oversubscribe=None if oversubscribe is None else int(bool(oversubscribe)),
                        batch_invariant=None if batch_invariant is None else int(bool(batch_invariant)))
        try:
            for name, value in settings.items():
                if value is not None:
                    self.set(name, value)
            if grad_filter_eps is not None:
                self.grad_filter_eps = grad_filter_eps
            if grad_filter_tail is not None:
                self.grad_filter_tail = grad_filter_tail
        except BaseException:
            self.close()
            raise

    # -- lifetime --
    def close(self) -> None:
        """Destroy the context (idempotent); later calls on it raise ValueError."""
        with self._lock:
            if self._handle is not None:
                self._lib.fh_context_destroy(self._handle)
                self._handle = None
                self._workspace = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _require_open(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise ValueError("this fusedhead Context is closed")
        return self._handle

    def _message_unlocked(self) -> str:
        msg = ctypes.c_char_p()
        if self._handle is None or self._lib.fh_context_message(self._handle, ctypes.byref(msg)) != 0:
            return ""
        return (msg.value or b"").decode(errors="replace")

    # -- calls --
    def call(self, function: str, *args, pure: bool = False) -> None:
        """Call `function(ctx, *args)` under the context's lock; raise on a non-zero status. `pure` calls
        (queries taking a const context) neither set nor clear the context's message, so a failure is
        reported without it (it would be a stale one)."""
        fn = getattr(self._lib, function)
        with self._lock:
            status = fn(self._require_open(), *args)
            if status != 0:
                check_status(status, function, None if pure else self)

    def collective(self, function: str) -> ContextManager[None]:
        """Around the checks that precede a call of `function`: nothing on a single-process context
        (fusedhead.mpi.Context: its ranks' calls are collective)."""
        return contextlib.nullcontext()

    def keeps_logits(self, n: int, vocab: int) -> bool:
        """Whether a split log-prob call on this context keeps its N x V float32 logits from the forward to the backward
        (fh_logprob_forward_keep: the backward then makes two GEMMs instead of three): when they take at most half of
        the memory budget, which bounds the workspace a call allocates; they are held beside it, as outputs are."""
        budget = self.memory_budget or _lib.DEFAULT_MEMORY_BUDGET
        return _lib.has_symbol("fh_logprob_forward_keep") and 0 < n * vocab * 4 <= budget // 2

    @property
    def message(self) -> str:
        """fh_context_message: the last error's description ("" after a success)."""
        with self._lock:
            return self._message_unlocked()

    # -- parameters (a real-valued one goes through the library's _real entry points) --
    def set(self, param: ParamLike, value: Union[int, float]) -> None:
        number = _param(param)
        if number in _REAL_PARAMS:
            self.call("fh_context_set_real", number, float(value))
            return
        name = Param(number).name.lower() if number in Param._value2member_map_ else str(param)
        self.call("fh_context_set", number, int64(name, value))

    def get(self, param: ParamLike) -> Union[int, float]:
        number = _param(param)
        value = ctypes.c_double() if number in _REAL_PARAMS else ctypes.c_int64()
        self.call("fh_context_get_real" if number in _REAL_PARAMS else "fh_context_get", number, ctypes.byref(value),
                  pure=True)
        return value.value

    @staticmethod
    def bounds(param: ParamLike) -> Tuple[Union[int, float], Union[int, float]]:
        """fh_param_bounds (fh_param_real_bounds for a real-valued parameter): the inclusive (min, max) accepted."""
        number = _param(param)
        real = number in _REAL_PARAMS
        lo, hi = (ctypes.c_double(), ctypes.c_double()) if real else (ctypes.c_int64(), ctypes.c_int64())
        function = "fh_param_real_bounds" if real else "fh_param_bounds"
        check_status(getattr(load_library(), function)(number, ctypes.byref(lo), ctypes.byref(hi)), function)
        return lo.value, hi.value

    threads = property(lambda self: self.get(Param.THREADS), lambda self, v: self.set(Param.THREADS, v))
    tile_rows = property(lambda self: self.get(Param.TILE_ROWS), lambda self, v: self.set(Param.TILE_ROWS, v))
    tile_vocab = property(lambda self: self.get(Param.TILE_VOCAB), lambda self, v: self.set(Param.TILE_VOCAB, v))
    memory_budget = property(lambda self: self.get(Param.MEMORY_BUDGET),
                             lambda self, v: self.set(Param.MEMORY_BUDGET, v))
    check_finite = property(lambda self: bool(self.get(Param.CHECK_FINITE)),
                            lambda self, v: self.set(Param.CHECK_FINITE, int(bool(v))))
    fp32_du = property(lambda self: bool(self.get(Param.FP32_DU)), lambda self, v: self.set(Param.FP32_DU, int(bool(v))))
    oversubscribe = property(lambda self: bool(self.get(Param.OVERSUBSCRIBE)),
                             lambda self, v: self.set(Param.OVERSUBSCRIBE, int(bool(v))))
    batch_invariant = property(lambda self: bool(self.get(Param.BATCH_INVARIANT)),
                               lambda self, v: self.set(Param.BATCH_INVARIANT, int(bool(v))))

    @property
    def threads_in_use(self) -> int:
        """fh_context_threads: the threads a call runs (above the tiny-problem size)."""
        value = ctypes.c_int()
        self.call("fh_context_threads", ctypes.byref(value), pure=True)
        return value.value

    grad_filter_eps = property(lambda self: self.get(Param.GRAD_FILTER_EPS),
                               lambda self, v: self.set(Param.GRAD_FILTER_EPS, v))

    @property
    def grad_filter_tail(self) -> str:
        return FilterTail(self.get(Param.GRAD_FILTER_TAIL)).name.lower()

    @grad_filter_tail.setter
    def grad_filter_tail(self, tail: str) -> None:
        names = {t.name.lower(): t for t in FilterTail}
        if tail not in names:
            raise ValueError(f"grad_filter_tail: expected one of {sorted(names)}, got {tail!r}")
        self.set(Param.GRAD_FILTER_TAIL, int(names[tail]))

    def filter_stats(self) -> Tuple[float, float]:
        """fh_context_filter_stats: (gradient_flops, skipped_flops) of the last call on this context: the flops
        of the unfiltered dx and dweight GEMMs, and those gradient filtering skipped."""
        stats = fh_filter_stats()
        self.call("fh_context_filter_stats", ctypes.byref(stats), pure=True)
        return stats.gradient_flops, stats.skipped_flops

    def set_workspace(self, buffer=None) -> None:
        """Hand the context a caller-owned workspace: any writable C-contiguous buffer (bytearray, NumPy
        array; for a torch tensor pass tensor.numpy()). The context keeps a reference. None returns to a
        library-managed workspace."""
        if buffer is None:
            self.call("fh_context_set_workspace", None, 0)
            self._workspace = None
            return
        view = memoryview(buffer)
        if view.readonly or not view.c_contiguous:
            raise ValueError("workspace: expected a writable C-contiguous buffer")
        holder = (ctypes.c_char * view.nbytes).from_buffer(buffer)
        self.call("fh_context_set_workspace", ctypes.addressof(holder), view.nbytes)
        self._workspace = (buffer, holder)

    def __repr__(self) -> str:
        if self.closed:
            return "<fusedhead.Context (closed)>"
        fields = ", ".join(f"{p.name.lower()}={self.get(p)}" for p in Param
                           if p not in (Param.CHECK_FINITE, Param.FP32_DU, Param.OVERSUBSCRIBE, Param.GRAD_FILTER_TAIL,
                                        Param.GRAD_FILTER_EPS))
        return f"<fusedhead.Context {fields}>"


_thread_local = threading.local()
_context_keys = itertools.count(1)  # 0: the calling thread's default context
_contexts_by_key: "weakref.WeakValueDictionary[int, Context]" = weakref.WeakValueDictionary()


def collective(context: Optional[Context], function: str) -> ContextManager[None]:
    """Around the checks that precede a call of the library's `function`: a context whose calls are collective
    (fusedhead.mpi.Context) makes the call anyway when they fail, so that the other ranks return an error instead of
    waiting for this one forever. No context (the thread's default) or a plain one: nothing to do."""
    return context.collective(function) if context is not None else contextlib.nullcontext()


def context_by_key(key: int) -> "Context":
    """The Context whose `key` this is (0: this thread's default context); ValueError once it was freed."""
    if key == 0:
        return default_context()
    ctx = _contexts_by_key.get(key)
    if ctx is None:
        raise ValueError(f"the fusedhead Context with key {key} no longer exists (keep it alive while it is used)")
    return ctx

_SETTING_NAMES = ("threads", "tile_rows", "tile_vocab", "memory_budget", "check_finite", "fp32_du", "oversubscribe",
                  "grad_filter_eps", "grad_filter_tail", "batch_invariant")
_default_settings: dict = {}
_default_generation = 0


def _initial_settings() -> dict:
    threads = os.environ.get("FUSEDHEAD_NUM_THREADS")
    if threads:
        try:
            return {"threads": int(threads)}
        except ValueError:
            raise ValueError(f"FUSEDHEAD_NUM_THREADS={threads!r} is not an integer") from None
    return {}


def set_default_context_settings(**settings) -> None:
    """Settings for the per-thread default contexts (those used when no `context=` is passed), e.g.
    threads=1; None removes a setting. Applies to default contexts from their next use. The environment
    variable FUSEDHEAD_NUM_THREADS gives the initial `threads` (the library's own default, 0, uses every
    processor and ignores OMP_NUM_THREADS)."""
    global _default_generation
    unknown = set(settings) - set(_SETTING_NAMES)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; expected some of {list(_SETTING_NAMES)}")
    for name, value in settings.items():
        if value is None:
            _default_settings.pop(name, None)
        else:
            _default_settings[name] = value
    _default_generation += 1


def default_context_settings() -> dict:
    return dict(_default_settings)


def default_context() -> Context:
    """This thread's default Context (created on first use with set_default_context_settings()'s values)."""
    ctx = getattr(_thread_local, "context", None)
    if ctx is None or ctx.closed or getattr(_thread_local, "generation", -1) != _default_generation:
        if ctx is not None:
            ctx.close()
        ctx = _thread_local.context = Context(**_default_settings)
        _thread_local.generation = _default_generation
    return ctx


_default_settings.update(_initial_settings())


# ---------------------------------------------------------------------------------------------------------
# Views, shapes, strides
# ---------------------------------------------------------------------------------------------------------
class View(NamedTuple):
    """A strided array as the library sees it: base address, shape, strides in elements."""
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]


def normalize_strides(shape: Sequence[int], strides: Sequence[int]) -> Tuple[int, ...]:
    """Strides of size-1 dimensions never matter; give them the contiguous value so the library's stride
    checks (>= 1, non-overlapping) accept them."""
    out = list(strides)
    step = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 1:
            out[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(int(s) for s in out)


def disjoint(rows: int, cols: int, row_stride: int, col_stride: int) -> bool:
    """The library's rule for a valid matrix view: strides >= 1 and no two elements overlap."""
    if row_stride < 1 or col_stride < 1:
        return False
    if rows == 1 or cols == 1:
        return True
    if row_stride >= col_stride:
        return row_stride // cols >= col_stride
    return col_stride // rows >= row_stride


def rows_view_ok(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """hidden / dhidden: [N, H] with unit column stride and a row stride >= H (rows may be padded)."""
    shape, strides = tuple(shape), normalize_strides(shape, strides)
    return len(shape) == 2 and strides[1] == 1 and strides[0] >= max(shape[1], 1)


def matrix_view_ok(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """weight: any view with positive, non-overlapping strides (contiguous, transposed, sliced)."""
    shape, strides = tuple(shape), normalize_strides(shape, strides)
    return len(shape) == 2 and disjoint(shape[0], shape[1], strides[0], strides[1])


def vector_view_ok(shape: Sequence[int], strides: Sequence[int]) -> bool:
    shape, strides = tuple(shape), normalize_strides(shape, strides)
    return len(shape) == 1 and strides[0] == 1


def parse_layout(layout: Union[str, Layout]) -> Layout:
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str) and layout.lower() in ("vh", "hv"):
        return Layout.VH if layout.lower() == "vh" else Layout.HV
    raise ValueError(f"layout must be 'vh' (weight [V, H], torch nn.Linear.weight) or 'hv' (weight [H, V], "
                     f"flax kernel), got {layout!r}")


def parse_reduction(reduction: Union[str, Reduction]) -> Reduction:
    if isinstance(reduction, Reduction):
        return reduction
    if isinstance(reduction, str) and reduction in ("mean", "sum", "none"):
        return Reduction[reduction.upper()]
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _fp(ptr: Optional[int]):
    return None if ptr is None else ctypes.cast(ptr, c_float_p)


def _ip(ptr: Optional[int]):
    return None if ptr is None else ctypes.cast(ptr, c_int64_p)


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_sizes(hidden: int, vocab: int) -> None:
    """A zero hidden or vocabulary size raises the library's own error (InvalidSizeError, its message) before an
    array library reports something about strides or reshapes."""
    if hidden < 1 or vocab < 1:
        raise error_for(Status.ERR_INVALID_SIZE, status_string(Status.ERR_INVALID_SIZE),
                        f"sizes must be >= 1: hidden = {int(hidden)}, vocab = {int(vocab)}")


class LinearHead:
    """hidden [N, H] x weight (either layout) + bias [V], checked and described as an fh_linear. hidden and
    weight hold `dtype` elements (fp32, or bf16 bits: strides count elements either way); bias is fp32.

    Raises ValueError (naming the argument and what was expected) for inconsistent shapes or unsupported
    strides; front ends that copy instead call rows_view_ok / matrix_view_ok first.
    """

    def __init__(self, x: View, weight: View, bias: Optional[View], layout: Union[str, Layout] = "vh",
                 dtype: Dtype = Dtype.F32):
        self.layout = parse_layout(layout)
        self.dtype = Dtype(dtype)
        if len(x.shape) != 2:
            raise ValueError(f"hidden: expected a 2-D [N, H] view, got shape {_shape(x.shape)}")
        n, h = x.shape
        if len(weight.shape) != 2:
            raise ValueError(f"weight: expected a 2-D matrix, got shape {_shape(weight.shape)}")
        if self.layout == Layout.VH:
            v, wh = weight.shape
            sv, sh = normalize_strides(weight.shape, weight.strides)
            expect = f"[V, H] = [*, {h}] (layout 'vh', torch nn.Linear.weight; pass layout='hv' for [H, V])"
        else:
            wh, v = weight.shape
            sh, sv = normalize_strides(weight.shape, weight.strides)
            expect = f"[H, V] = [{h}, *] (layout 'hv'; pass layout='vh' for a torch [V, H] weight)"
        if wh != h:
            raise ValueError(f"weight: expected shape {expect}, got {_shape(weight.shape)} (hidden is "
                             f"{_shape(x.shape)})")
        check_sizes(h, v)
        if not rows_view_ok(x.shape, x.strides):
            raise ValueError(f"hidden: expected rows with unit element stride (C-contiguous rows; a row stride "
                             f">= H is fine), got strides {x.strides} elements for shape {_shape(x.shape)}")
        if not matrix_view_ok(weight.shape, weight.strides):
            raise ValueError(f"weight: expected positive, non-overlapping strides (contiguous or transposed), "
                             f"got strides {weight.strides} elements for shape {_shape(weight.shape)}")
        if bias is not None:
            if tuple(bias.shape) != (v,):
                raise ValueError(f"bias: expected shape [V] = [{v}], got {_shape(bias.shape)}")
            if not vector_view_ok(bias.shape, bias.strides):
                raise ValueError("bias: expected a contiguous vector")
        self.n, self.hidden, self.vocab = int(n), int(h), int(v)
        self.x, self.weight, self.bias = x, weight, bias
        self.weight_strides = tuple(weight.strides)
        x_row_stride = normalize_strides(x.shape, x.strides)[0]
        self.c = _lib.fh_linear(self.n, self.hidden, self.vocab, x.ptr, x_row_stride, weight.ptr, sh, sv,
                                _fp(bias.ptr if bias is not None else None), self.dtype, self.dtype)

    # -- gradients --
    def check_dx(self, dx: View) -> None:
        if tuple(dx.shape) != (self.n, self.hidden):
            raise ValueError(f"dhidden: expected shape {_shape((self.n, self.hidden))}, got {_shape(dx.shape)}")
        if not rows_view_ok(dx.shape, dx.strides):
            raise ValueError(f"dhidden: expected rows with unit element stride, got strides {dx.strides}")

    def check_dweight(self, dw: View) -> None:
        if tuple(dw.shape) != tuple(self.weight.shape) or \
                normalize_strides(dw.shape, dw.strides) != normalize_strides(self.weight.shape, self.weight.strides):
            raise ValueError(f"dweight: expected the weight's shape {_shape(self.weight.shape)} and strides "
                             f"{self.weight.strides} (the library writes dweight with the weight's strides), got "
                             f"shape {_shape(dw.shape)} strides {dw.strides}")

    def check_dbias(self, db: View) -> None:
        if self.bias is None:
            raise ValueError("dbias requested but there is no bias")
        if tuple(db.shape) != (self.vocab,) or not vector_view_ok(db.shape, db.strides):
            raise ValueError(f"dbias: expected a contiguous [{self.vocab}] vector, got shape {_shape(db.shape)} "
                             f"strides {db.strides}")

    def grads(self, dx: Optional[View] = None, dweight: Optional[View] = None, dbias: Optional[View] = None,
              accumulate: bool = False, dtypes: Tuple[Dtype, Dtype, Dtype] = (Dtype.F32,) * 3
              ) -> _lib.fh_linear_grads:
        """fh_linear_grads for the requested gradients (None: skipped); beta 1 when accumulating, else 0; dtypes:
        of dx, dweight and dbias (bf16: bits in the views' memory, for bf16 inputs only)."""
        beta = 1.0 if accumulate else 0.0
        if dx is not None:
            self.check_dx(dx)
        if dweight is not None:
            self.check_dweight(dweight)
        if dbias is not None:
            self.check_dbias(dbias)
        dx_stride = normalize_strides(dx.shape, dx.strides)[0] if dx is not None else self.hidden
        return _lib.fh_linear_grads(dx.ptr if dx is not None else None, dx_stride, beta,
                                    dweight.ptr if dweight is not None else None, beta,
                                    dbias.ptr if dbias is not None else None, beta, *(int(d) for d in dtypes))


# ---------------------------------------------------------------------------------------------------------
# Cross-entropy
# ---------------------------------------------------------------------------------------------------------
class CEProblem:
    """A linear head, targets [N] and cross-entropy options: the arguments every fh_ce_* call shares."""

    def __init__(self, head: LinearHead, targets: View, *, ignore_index: int = -100,
                 reduction: Union[str, Reduction] = "mean", label_smoothing: float = 0.0,
                 class_weights: Optional[View] = None, softcap: float = 0.0, z_loss: float = 0.0,
                 logit_scale: Optional[float] = None, token_scaling: bool = False):
        self.head = head
        self.reduction = parse_reduction(reduction)
        if tuple(targets.shape) != (head.n,) or not vector_view_ok(targets.shape, targets.strides):
            raise ValueError(f"targets: expected a contiguous [N] = [{head.n}] int64 vector, got shape "
                             f"{_shape(targets.shape)} strides {targets.strides}")
        if class_weights is not None and (tuple(class_weights.shape) != (head.vocab,) or
                                          not vector_view_ok(class_weights.shape, class_weights.strides)):
            raise ValueError(f"class_weights: expected a contiguous [V] = [{head.vocab}] float32 vector, got shape "
                             f"{_shape(class_weights.shape)}")
        self.targets = _ip(targets.ptr)
        self.options = _lib.fh_ce_options(int64("ignore_index", ignore_index), int(self.reduction), float(label_smoothing),
                                          _fp(class_weights.ptr if class_weights is not None else None),
                                          float(softcap), float(z_loss),
                                          1.0 if logit_scale is None else _real(logit_scale, "logit_scale"),
                                          int(bool(token_scaling)))

    @property
    def grad_count(self) -> int:
        """How many upstream-gradient values the library reads: N for 'none', else 1."""
        return self.head.n if self.reduction == Reduction.NONE else 1

    def _outputs(self, loss: ctypes.c_double, z: ctypes.c_double, per_token_loss, per_token_logp, lse, argmax,
                 entropy, correct):
        return _lib.fh_ce_outputs(ctypes.cast(ctypes.byref(loss), c_double_p),
                                  ctypes.cast(ctypes.byref(z), c_double_p), _fp(per_token_loss),
                                  _fp(per_token_logp), _fp(lse), _ip(argmax), _fp(entropy), _ip(correct))

    def forward(self, ctx: Context, *, per_token_loss: Optional[int] = None, per_token_logp: Optional[int] = None,
                lse: Optional[int] = None, argmax: Optional[int] = None, entropy: Optional[int] = None,
                correct: Optional[int] = None) -> Tuple[float, float]:
        """fh_ce_forward; output addresses may be None (per_token_loss is required for 'none'; correct: one int64).
        Returns (loss, z_loss) as Python floats (for 'none': their sums over tokens)."""
        loss, z = ctypes.c_double(), ctypes.c_double()
        out = self._outputs(loss, z, per_token_loss, per_token_logp, lse, argmax, entropy, correct)
        ctx.call("fh_ce_forward", ctypes.byref(self.head.c), self.targets, ctypes.byref(self.options),
                 ctypes.byref(out))
        return loss.value, z.value

    def backward(self, ctx: Context, lse: int, grad_output: int, grads: _lib.fh_linear_grads) -> None:
        """fh_ce_backward from the forward's lse; grad_output holds grad_count float32 values."""
        ctx.call("fh_ce_backward", ctypes.byref(self.head.c), self.targets, ctypes.byref(self.options), _fp(lse),
                 _fp(grad_output), ctypes.byref(grads))

    def forward_backward(self, ctx: Context, grad_output: int, grads: _lib.fh_linear_grads, *,
                         per_token_loss: Optional[int] = None, per_token_logp: Optional[int] = None,
                         lse: Optional[int] = None, argmax: Optional[int] = None, entropy: Optional[int] = None,
                         correct: Optional[int] = None) -> Tuple[float, float]:
        """fh_ce_forward_backward: the forward outputs and the gradients in one call."""
        loss, z = ctypes.c_double(), ctypes.c_double()
        out = self._outputs(loss, z, per_token_loss, per_token_logp, lse, argmax, entropy, correct)
        ctx.call("fh_ce_forward_backward", ctypes.byref(self.head.c), self.targets, ctypes.byref(self.options),
                 _fp(grad_output), ctypes.byref(out), ctypes.byref(grads))
        return loss.value, z.value

    def workspace_size(self, ctx: Context, train_step: bool = False) -> int:
        """fh_ce_workspace_size / fh_ce_forward_backward_workspace_size (pure queries)."""
        size = ctypes.c_size_t()
        name = "fh_ce_forward_backward_workspace_size" if train_step else "fh_ce_workspace_size"
        ctx.call(name, ctypes.byref(self.head.c), ctypes.byref(self.options), ctypes.byref(size), pure=True)
        return size.value


# ---------------------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------------------
class LogprobProblem:
    """A linear head, targets [N] and log-prob options: the arguments every fh_logprob_* call shares; with a support
    (Support), those of fh_logprob_support_*. Outputs and upstream gradients are addresses of [N] float32 vectors (or
    None)."""

    def __init__(self, head: LinearHead, targets: View, *, ignore_index: int = -100, temperature: float = 1.0,
                 softcap: Optional[float] = None, logit_scale: Optional[float] = None,
                 support: Optional["Support"] = None):
        self.head = head
        if tuple(targets.shape) != (head.n,) or not vector_view_ok(targets.shape, targets.strides):
            raise ValueError(f"targets: expected a contiguous [N] = [{head.n}] int64 vector, got shape "
                             f"{_shape(targets.shape)} strides {targets.strides}")
        self.targets = _ip(targets.ptr)
        self.options = _lib.fh_logprob_options(int64("ignore_index", ignore_index), float(temperature),
                                               float(softcap or 0.0), 1.0 if logit_scale is None else float(logit_scale))
        self.support = support

    def _entry(self, name: str) -> str:
        return name.replace("fh_logprob_", "fh_logprob_support_") if self.support is not None else name

    def _head_args(self) -> tuple:
        support = (ctypes.byref(self.support.c),) if self.support is not None else ()
        return (ctypes.byref(self.head.c), self.targets, *support, ctypes.byref(self.options))

    def forward(self, ctx: Context, *, logp=None, entropy=None, lse=None, logits: Optional[int] = None) -> None:
        """fh_logprob_forward; with logits (the address of [N, V] float32), fh_logprob_forward_keep."""
        out = _lib.fh_logprob_outputs(_fp(logp), _fp(entropy), _fp(lse))
        if logits is None:
            ctx.call(self._entry("fh_logprob_forward"), *self._head_args(), ctypes.byref(out))
        else:
            ctx.call("fh_logprob_forward_keep", *self._head_args(), ctypes.byref(out), _fp(logits))

    def backward(self, ctx: Context, lse: int, entropy: Optional[int], g_logp: Optional[int],
                 g_entropy: Optional[int], g_lse: Optional[int], grads: _lib.fh_linear_grads, *,
                 logits: Optional[int] = None) -> None:
        """fh_logprob_backward; with the logits a forward kept, fh_logprob_backward_kept."""
        if logits is None:
            ctx.call(self._entry("fh_logprob_backward"), *self._head_args(), _fp(lse), _fp(entropy), _fp(g_logp),
                     _fp(g_entropy), _fp(g_lse), ctypes.byref(grads))
        else:
            ctx.call("fh_logprob_backward_kept", *self._head_args(), _fp(logits), _fp(lse), _fp(entropy),
                     _fp(g_logp), _fp(g_entropy), _fp(g_lse), ctypes.byref(grads))

    def forward_backward(self, ctx: Context, g_logp: Optional[int], g_entropy: Optional[int], g_lse: Optional[int],
                         grads: _lib.fh_linear_grads, *, logp=None, entropy=None, lse=None) -> None:
        out = _lib.fh_logprob_outputs(_fp(logp), _fp(entropy), _fp(lse))
        ctx.call(self._entry("fh_logprob_forward_backward"), *self._head_args(), _fp(g_logp), _fp(g_entropy),
                 _fp(g_lse), ctypes.byref(out), ctypes.byref(grads))


def padded_support_width(shape, token_shape, n: int) -> int:
    """k of a padded support_ids of the tokens' shape + [k] (or [N, k]); ValueError saying what was expected."""
    if len(shape) < 1 or tuple(shape[:-1]) not in (tuple(token_shape), (n,)):
        raise ValueError(f"support_ids: expected the tokens' shape {list(token_shape)} + [k] (padded with -1) or, with "
                         f"support_offsets, a 1-D CSR list of ids; got {list(shape)}")
    return int(shape[-1])


class Support:
    """A support per token (fh_support): CSR, ids [E] with offsets [N + 1], or padded, ids [N, k] with -1 as
    padding (offsets None). Views of int64 memory that owners (the arrays or tensors behind them) keep alive as long
    as the support is."""

    def __init__(self, n: int, ids: View, offsets: Optional[View], owners: tuple = ()):
        self.owners = owners
        if offsets is None:
            padded = len(ids.shape) == 2 and ids.shape[0] == n
            if not padded or normalize_strides(ids.shape, ids.strides) != (ids.shape[1], 1):
                raise ValueError(f"support_ids: expected a contiguous [N, k] = [{n}, k] int64 matrix (padded with -1) "
                                 f"when no support_offsets are given, got shape {_shape(ids.shape)} strides "
                                 f"{ids.strides}")
            if ids.shape[1] < 1:
                raise ValueError("support_ids: a padded support has at least one entry per token (k >= 1), got k = 0")
            self.c = _lib.fh_support(_ip(ids.ptr), None, int(ids.shape[1]))
            return
        if tuple(offsets.shape) != (n + 1,) or not vector_view_ok(offsets.shape, offsets.strides):
            raise ValueError(f"support_offsets: expected a contiguous [N + 1] = [{n + 1}] int64 vector, got shape "
                             f"{_shape(offsets.shape)} strides {offsets.strides}")
        if len(ids.shape) != 1 or not vector_view_ok(ids.shape, ids.strides):
            raise ValueError(f"support_ids: expected a contiguous 1-D int64 vector of ids with support_offsets (CSR), "
                             f"got shape {_shape(ids.shape)} strides {ids.strides}")
        self.c = _lib.fh_support(_ip(ids.ptr), _ip(offsets.ptr), 0)


# ---------------------------------------------------------------------------------------------------------
# Shared by the batch heads (GRPO, preference)
# ---------------------------------------------------------------------------------------------------------
E = TypeVar("E", bound=enum.IntEnum)


def parse_choice(value: Union[str, E], choices: Type[E], name: str) -> E:
    """A member of `choices` from itself or its name in any case; ValueError naming the argument otherwise."""
    if isinstance(value, choices):
        return value
    if isinstance(value, str) and value.upper() in choices.__members__:
        return choices[value.upper()]
    raise ValueError(f"{name} must be one of {', '.join(repr(m.name.lower()) for m in choices)}, got {value!r}")


def _vector_ptr(v: Optional[View], name: str, length: int, expected: str) -> Optional[int]:
    """The address of a contiguous vector of `length` elements (None for None); ValueError naming it otherwise."""
    if v is None:
        return None
    if tuple(v.shape) != (length,) or not vector_view_ok(v.shape, v.strides):
        raise ValueError(f"{name}: expected a contiguous {expected}, got shape {_shape(v.shape)}")
    return v.ptr


def _sequence_rows(head: LinearHead, sequences: int, seq: int, cu_seqlens: Optional[View], dims: str,
                   what: str) -> Tuple[Optional[int], str]:
    """The address of cu_seqlens (None: [S, T] rows, S x T of them) and the per-token arrays' dims for messages. Packed
    (cu_seqlens, [S + 1] int64 offsets), seq must be 0 and the arrays are [N]; the library checks the offsets."""
    if cu_seqlens is None:
        if sequences * seq != head.n:
            product = dims[1:-1].replace(", ", "*")
            raise ValueError(f"hidden: expected {product} = {sequences}*{seq} = {sequences * seq} rows{what}, got "
                             f"{head.n}")
        return None, f"{dims} = [{sequences}, {seq}]"
    ptr = _vector_ptr(cu_seqlens, "cu_seqlens", sequences + 1,
                      f"[{sequences + 1}] int64 vector (the sequences' offsets)")
    return ptr, f"[N] = [{head.n}] (packed rows)"


def _metrics_dict(keys, values) -> dict:
    """TRL's metric names -> values (a metrics struct, or numbers in its field order), NaN entries omitted (TRL
    logs nothing there)."""
    if isinstance(values, ctypes.Structure):
        values = [getattr(values, f) for f, _ in keys]
    return {key: float(v) for (_, key), v in zip(keys, values) if float(v) == float(v)}


class _BatchProblem:
    """A linear head, a batch struct (self.c) and options: what every call of a batch head shares. Its outputs
    struct starts with loss and metrics; the rest are float32 arrays, passed by name as addresses (or None)."""
    _prefix: str  # "fh_grpo", "fh_preference"
    _metrics_struct: type
    _outputs_struct: type

    def __init__(self, head: LinearHead, batch: ctypes.Structure, options: ctypes.Structure):
        self.head, self.c, self.options = head, batch, options

    def _call(self, ctx: Context, function: str, outputs: dict, gradient_args: tuple = ()):
        names = [f for f, _ in self._outputs_struct._fields_[2:]]
        if not set(outputs) <= set(names):  # a ctypes struct would keep an unknown name as a plain attribute
            raise TypeError(f"unknown outputs {sorted(set(outputs) - set(names))}; expected some of {names}")
        loss, metrics = ctypes.c_double(), self._metrics_struct()
        out = self._outputs_struct(ctypes.cast(ctypes.byref(loss), c_double_p), ctypes.pointer(metrics),
                                   **{k: _fp(v) for k, v in outputs.items()})
        grad_output, grads = gradient_args or (None, None)
        args = (ctypes.byref(self.head.c), ctypes.byref(self.c), ctypes.byref(self.options))
        if grads is None:
            ctx.call(function, *args, ctypes.byref(out))
        else:
            ctx.call(function, *args, _fp(grad_output), ctypes.byref(out), ctypes.byref(grads))
        return loss.value, metrics

    def forward(self, ctx: Context, **outputs: Optional[int]):
        """<prefix>_forward; returns (loss, metrics struct)."""
        return self._call(ctx, self._prefix + "_forward", outputs)

    def forward_backward(self, ctx: Context, grad_output: int, grads: _lib.fh_linear_grads,
                         **outputs: Optional[int]):
        """<prefix>_forward_backward (grad_output: one float32, d(objective)/d(loss)); returns (loss, metrics)."""
        return self._call(ctx, self._prefix + "_forward_backward", outputs, (grad_output, grads))

    def workspace_size(self, ctx: Context) -> int:
        size = ctypes.c_size_t()
        ctx.call(self._prefix + "_workspace_size", ctypes.byref(self.head.c), ctypes.byref(size), pure=True)
        return size.value


# ---------------------------------------------------------------------------------------------------------
# GRPO (TRL GRPOTrainer._compute_loss semantics)
# ---------------------------------------------------------------------------------------------------------
# fh_grpo_metrics field -> TRL's logged key (huggingface/trl f2cd5771 GRPOTrainer: _compute_loss and the sampling/...
# metrics of _generate_and_score_completions), in the struct's field order
GRPO_METRIC_KEYS = (("kl", "kl"), ("entropy", "entropy"), ("clip_ratio_low_mean", "clip_ratio/low_mean"),
                    ("clip_ratio_high_mean", "clip_ratio/high_mean"),
                    ("clip_ratio_region_mean", "clip_ratio/region_mean"), ("cispo_clip_ratio", "cispo_clip_ratio"),
                    ("clip_ratio_low_min", "clip_ratio/low_min"), ("clip_ratio_high_max", "clip_ratio/high_max"),
                    ("policy_loss", "policy_loss"), ("entropy_coef", "entropy_coef"),
                    ("vespo_phi_seq_mean", "vespo/phi_seq_mean"),
                    ("sampling_logp_difference_mean", "sampling/sampling_logp_difference/mean"),
                    ("sampling_logp_difference_max", "sampling/sampling_logp_difference/max"),
                    ("importance_sampling_ratio_min", "sampling/importance_sampling_ratio/min"),
                    ("importance_sampling_ratio_mean", "sampling/importance_sampling_ratio/mean"),
                    ("importance_sampling_ratio_max", "sampling/importance_sampling_ratio/max"))

# TRL GRPOConfig's names and defaults for every fh_grpo_options field (f2cd5771; loss_type "dapo" as TRL's). The
# front ends take these keywords; None: absent (epsilon_high: = epsilon_low; delta, off_policy_mask_threshold: off;
# the importance-sampling bounds: no bound; num_items_in_batch: the mask's sum; max_completion_length: T).
GRPO_OPTION_DEFAULTS = dict(
    loss_type="dapo", importance_sampling_level="token", temperature=1.0, epsilon_low=0.2, epsilon_high=None,
    delta=None, beta=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, num_items_in_batch=None,
    max_completion_length=None, entropy_coef=0.0, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
    use_bias_correction_kl=False, vllm_importance_sampling_correction=True,
    vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=None,
    vllm_importance_sampling_clip_max=3.0, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
    vespo_lambda_neg=2.0)
GRPO_OPTION_NAMES = tuple(GRPO_OPTION_DEFAULTS)


def parse_grpo_loss_type(loss_type) -> "_lib.GRPOLossType":
    return parse_choice(loss_type, _lib.GRPOLossType, "loss_type")


def parse_grpo_is_level(level) -> "_lib.GRPOISLevel":
    return parse_choice(level, _lib.GRPOISLevel, "importance_sampling_level")


def parse_grpo_vllm_is_mode(mode) -> "_lib.GRPOVllmISMode":
    return parse_choice(mode, _lib.GRPOVllmISMode, "vllm_importance_sampling_mode")


def _optional_float(value) -> float:
    """None -> NaN (the library's "absent"), else the float."""
    return float("nan") if value is None else float(value)


def grpo_option_dict(*, epsilon=None, vllm_importance_sampling_cap=None, **options) -> dict:
    """TRL-named GRPO options with TRL's defaults filled in and TRL's aliases resolved: `epsilon` is
    `epsilon_low` (passing both with different values is a ValueError), the deprecated
    `vllm_importance_sampling_cap` sets `vllm_importance_sampling_clip_max` (as GRPOConfig.__post_init__ does,
    with its FutureWarning); a tensor num_items_in_batch (what TRL passes) becomes a float. Names and choices
    are checked (ValueError / TypeError); the values are the library's to check."""
    unknown = set(options) - set(GRPO_OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown GRPO option(s) {sorted(unknown)}; expected some of {list(GRPO_OPTION_NAMES)}")
    if epsilon is not None:
        if options.get("epsilon_low") is not None and float(options["epsilon_low"]) != float(epsilon):
            raise ValueError("pass epsilon or epsilon_low (its alias), not both")
        options["epsilon_low"] = epsilon
    if options.get("epsilon_low", 0.2) is None:
        options["epsilon_low"] = 0.2
    if vllm_importance_sampling_cap is not None:
        warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL): use vllm_importance_sampling_clip_max",
                      FutureWarning, stacklevel=3)
        options["vllm_importance_sampling_clip_max"] = vllm_importance_sampling_cap
    out = dict(GRPO_OPTION_DEFAULTS)
    out.update(options)
    nib = out["num_items_in_batch"]
    if nib is not None and hasattr(nib, "item") and not isinstance(nib, (int, float)):  # a tensor / NumPy scalar
        out["num_items_in_batch"] = float(nib.item())
    parse_grpo_loss_type(out["loss_type"])
    parse_grpo_is_level(out["importance_sampling_level"])
    parse_grpo_vllm_is_mode(out["vllm_importance_sampling_mode"])
    return out


def grpo_options(**options) -> _lib.fh_grpo_options:
    """fh_grpo_options from TRL-named keyword arguments (grpo_option_dict: TRL's defaults and aliases; None:
    absent). The library validates the values (InvalidGRPOOptionError / InvalidTemperatureError)."""
    o = grpo_option_dict(**options)
    opt = _lib.fh_grpo_options()
    check_status(load_library().fh_grpo_options_init(ctypes.byref(opt)), "fh_grpo_options_init")
    opt.loss_type = int(parse_grpo_loss_type(o["loss_type"]))
    opt.importance_sampling_level = int(parse_grpo_is_level(o["importance_sampling_level"]))
    opt.temperature = float(o["temperature"])
    opt.epsilon_low = float(o["epsilon_low"])
    opt.epsilon_high = _optional_float(o["epsilon_high"])
    opt.delta = _optional_float(o["delta"])
    opt.beta = float(o["beta"])
    opt.sapo_temperature_pos = float(o["sapo_temperature_pos"])
    opt.sapo_temperature_neg = float(o["sapo_temperature_neg"])
    opt.num_items_in_batch = 0.0 if o["num_items_in_batch"] is None else float(o["num_items_in_batch"])
    mcl = o["max_completion_length"]
    opt.max_completion_length = 0 if mcl is None else int64("max_completion_length", mcl)
    opt.entropy_coef = float(o["entropy_coef"])
    opt.top_entropy_quantile = float(o["top_entropy_quantile"])
    opt.off_policy_mask_threshold = _optional_float(o["off_policy_mask_threshold"])
    opt.use_bias_correction_kl = int(bool(o["use_bias_correction_kl"]))
    opt.vllm_importance_sampling_correction = int(bool(o["vllm_importance_sampling_correction"]))
    opt.vllm_importance_sampling_mode = int(parse_grpo_vllm_is_mode(o["vllm_importance_sampling_mode"]))
    opt.vllm_importance_sampling_clip_min = _optional_float(o["vllm_importance_sampling_clip_min"])
    opt.vllm_importance_sampling_clip_max = _optional_float(o["vllm_importance_sampling_clip_max"])
    opt.vespo_k_pos = float(o["vespo_k_pos"])
    opt.vespo_lambda_pos = float(o["vespo_lambda_pos"])
    opt.vespo_k_neg = float(o["vespo_k_neg"])
    opt.vespo_lambda_neg = float(o["vespo_lambda_neg"])
    return opt


def grpo_metrics_dict(values) -> dict:
    """TRL's metric names -> values (a fh_grpo_metrics or its numbers in field order), NaN entries omitted."""
    return _metrics_dict(GRPO_METRIC_KEYS, values)


class GRPOProblem(_BatchProblem):
    """A linear head over B*T tokens and a GRPO micro-batch: the arguments every fh_grpo_* call shares.
    Token vectors (completion_ids int64, completion_mask, old/ref/sampling logps float32) are contiguous [B*T] views,
    advantages a contiguous [B] view; or packed sequences: cu_seqlens an int64 [B + 1] view of their offsets, seq 0,
    the token vectors [N]. forward / forward_backward take the fh_grpo_outputs arrays by name
    (per_token_logp, per_token_loss, entropy, lse: float32 [B*T] addresses)."""
    _prefix, _metrics_struct, _outputs_struct = "fh_grpo", _lib.fh_grpo_metrics, _lib.fh_grpo_outputs

    def __init__(self, head: LinearHead, batch: int, seq: int, completion_ids: View, completion_mask: View,
                 advantages: View, old_per_token_logps: Optional[View] = None,
                 ref_per_token_logps: Optional[View] = None, options: Optional[_lib.fh_grpo_options] = None,
                 sampling_per_token_logps: Optional[View] = None, support: Optional["Support"] = None,
                 cu_seqlens: Optional[View] = None):
        b, t = int(batch), int(seq)
        cu, bt = _sequence_rows(head, b, t, cu_seqlens, "[B, T]", "")
        n = head.n
        ids = _vector_ptr(completion_ids, "completion_ids", n, f"{bt} int64 array")
        mask = _vector_ptr(completion_mask, "completion_mask", n, f"{bt} float32 array")
        old = _vector_ptr(old_per_token_logps, "old_per_token_logps", n, f"{bt} float32 array")
        ref = _vector_ptr(ref_per_token_logps, "ref_per_token_logps", n, f"{bt} float32 array")
        samp = _vector_ptr(sampling_per_token_logps, "sampling_per_token_logps", n, f"{bt} float32 array")
        adv = _vector_ptr(advantages, "advantages", b, f"[B] = [{b}] float32 vector")
        self.batch, self.seq = b, t
        self.support = support  # the fh_support the batch points to lives as long as the problem
        super().__init__(head, _lib.fh_grpo_batch(b, t, _ip(ids), _fp(mask), _fp(adv), _fp(old), _fp(ref),
                                                   _fp(samp), None if support is None else ctypes.pointer(support.c),
                                                   _ip(cu)),
                         options if options is not None else grpo_options())

    def backward(self, ctx: Context, per_token_logp: int, lse: int, entropy: Optional[int], grad_output: int,
                 grads: _lib.fh_linear_grads) -> None:
        """fh_grpo_backward from the forward's per_token_logp, lse (and entropy when entropy_coef != 0 or
        top_entropy_quantile < 1)."""
        ctx.call("fh_grpo_backward", ctypes.byref(self.head.c), ctypes.byref(self.c), ctypes.byref(self.options),
                 _fp(per_token_logp), _fp(lse), _fp(entropy), _fp(grad_output), ctypes.byref(grads))


# ---------------------------------------------------------------------------------------------------------
# Preference heads: DPO, ORPO, SimPO, CPO (TRL DPOTrainer, ORPOTrainer, CPOTrainer semantics; Liger's layout:
# the chosen sequences, then the rejected ones, in one batch)
# ---------------------------------------------------------------------------------------------------------
# fh_preference_metrics field -> TRL's logged key
PREFERENCE_METRIC_KEYS = (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                          ("rewards_accuracies", "rewards/accuracies"), ("rewards_margins", "rewards/margins"),
                          ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected"),
                          ("logits_chosen", "logits/chosen"), ("logits_rejected", "logits/rejected"),
                          ("nll_loss", "nll_loss"), ("log_odds_ratio", "log_odds_ratio"),
                          ("log_odds_chosen", "log_odds_chosen"), ("entropy", "entropy"),
                          ("mean_token_accuracy", "mean_token_accuracy"))


def _flag(value, name: str) -> int:
    """A bool (or 0 / 1) as a C int."""
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return int(value)


def _real(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {value!r}") from None


def preference_options(*, loss="dpo", loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5,
                       rpo_alpha=0.0, cpo_alpha=1.0, loss_weights=None, dpo_semantics="current",
                       discopop_tau=0.05, use_weighting=False) -> _lib.fh_preference_options:
    """fh_preference_options from TRL-named keyword arguments (rpo_alpha None, TRL's default, is 0: no NLL term).
    loss_type: a name, or TRL's current list of names (dpo), combined with loss_weights (default 1 each);
    dpo_semantics: "current" (TRL >= v0.29.0, as at f2cd5771) or "trl_0_28" (v0.28.0's DPOTrainer).
    The library validates the values (InvalidPreferenceOptionError)."""
    opt = _lib.fh_preference_options()
    check_status(load_library().fh_preference_options_init(ctypes.byref(opt)), "fh_preference_options_init")
    opt.loss = int(parse_choice(loss, _lib.PreferenceLoss, "loss"))
    types = [loss_type] if isinstance(loss_type, (str, _lib.PreferenceLossType)) else list(loss_type)
    if not types or len(types) > _lib.PREFERENCE_MAX_LOSS_TYPES:
        raise ValueError(f"loss_type: expected a name or a list of 1 .. {_lib.PREFERENCE_MAX_LOSS_TYPES} names, "
                         f"got {loss_type!r}")
    parsed = [int(parse_choice(t, _lib.PreferenceLossType, "loss_type")) for t in types]
    opt.loss_type = parsed[0]
    if len(parsed) > 1 or loss_weights is not None:
        weights = [1.0] * len(parsed) if loss_weights is None else [_real(w, "loss_weights") for w in loss_weights]
        if len(weights) != len(parsed):
            raise ValueError(f"loss_weights: expected {len(parsed)} weights (one per loss type), got {len(weights)}")
        opt.loss_type_count = len(parsed)
        for k, (t, w) in enumerate(zip(parsed, weights)):
            opt.loss_types[k], opt.loss_weights[k] = t, w
    opt.beta = _real(beta, "beta")
    opt.label_smoothing = _real(label_smoothing, "label_smoothing")
    opt.simpo_gamma = _real(simpo_gamma, "simpo_gamma")
    opt.rpo_alpha = 0.0 if rpo_alpha is None else _real(rpo_alpha, "rpo_alpha")
    opt.cpo_alpha = _real(cpo_alpha, "cpo_alpha")
    semantics = "trl_current" if isinstance(dpo_semantics, str) and dpo_semantics.lower() == "current" else dpo_semantics
    opt.dpo_semantics = int(parse_choice(semantics, _lib.DPOSemantics, "dpo_semantics"))
    opt.discopop_tau = _real(discopop_tau, "discopop_tau")
    opt.use_weighting = int(bool(use_weighting))
    return opt


def preference_metrics_dict(values) -> dict:
    """TRL's metric names -> values (a fh_preference_metrics or 13 numbers in its order), NaN entries omitted."""
    return _metrics_dict(PREFERENCE_METRIC_KEYS, values)


def pairs_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """(2B, T) from the targets' shape: an even number of sequences (the chosen ones, then the rejected ones), at
    least one pair and one token (the loss is a mean over pairs)."""
    if len(shape) != 2 or shape[0] % 2 or shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"targets: expected [2B, T] with B, T >= 1 (the chosen sequences, then the rejected ones), "
                         f"got shape {list(shape)}")
    return int(shape[0]), int(shape[1])


class PreferenceProblem(_BatchProblem):
    """A linear head over 2B*T tokens, the chosen sequences first and then the rejected ones (pair b: sequences b
    and B + b), and a preference micro-batch: the arguments every fh_preference_* call shares. targets (int64) and
    mask (float32) are contiguous [2B*T] views; dpo's reference log-probs either ref_logps, a contiguous [2B]
    view (aggregated as the loss aggregates), or ref_per_token_logps [2B*T]; or packed sequences: cu_seqlens an int64
    [2B + 1] view of their offsets (chosen, then rejected), seq 0, the token vectors [N]. forward / forward_backward
    take the fh_preference_outputs arrays by name (sequence_logps, rewards: float32 [2B]; per_token_logp [2B*T])."""
    _prefix, _metrics_struct, _outputs_struct = ("fh_preference", _lib.fh_preference_metrics,
                                                 _lib.fh_preference_outputs)

    def __init__(self, head: LinearHead, pairs: int, seq: int, targets: View, mask: View,
                 ref_logps: Optional[View] = None, ref_per_token_logps: Optional[View] = None,
                 options: Optional[_lib.fh_preference_options] = None, cu_seqlens: Optional[View] = None):
        b, t = int(pairs), int(seq)
        cu, bt = _sequence_rows(head, 2 * b, t, cu_seqlens, "[2B, T]", " (chosen sequences, then rejected)")
        n = head.n
        ids = _vector_ptr(targets, "targets", n, f"{bt} int64 array")
        m = _vector_ptr(mask, "mask", n, f"{bt} float32 array")
        ref = _vector_ptr(ref_logps, "ref_logps", 2 * b, f"[2B] = [{2 * b}] float32 vector")
        ref_tok = _vector_ptr(ref_per_token_logps, "ref_per_token_logps", n, f"{bt} float32 array")
        self.pairs, self.seq = b, t
        super().__init__(head, _lib.fh_preference_batch(b, t, _ip(ids), _fp(m), _fp(ref), _fp(ref_tok), _ip(cu)),
                         options if options is not None else preference_options())


# ---------------------------------------------------------------------------------------------------------
# KTO (TRL KTOTrainer semantics: loss types kto and apo_zero_unpaired; each sequence desirable or undesirable)
# ---------------------------------------------------------------------------------------------------------
# fh_kto_metrics field -> TRL's logged key (KTOTrainer._compute_loss, huggingface/trl f2cd5771)
KTO_METRIC_KEYS = (("kl", "kl"), ("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                   ("rewards_margins", "rewards/margins"), ("logps_chosen", "logps/chosen"),
                   ("logps_rejected", "logps/rejected"), ("logits_chosen", "logits/chosen"),
                   ("logits_rejected", "logits/rejected"), ("entropy", "entropy"))


def kto_options(*, loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0) -> _lib.fh_kto_options:
    """fh_kto_options from TRL KTOConfig's names. The library validates the values (InvalidPreferenceOptionError)."""
    opt = _lib.fh_kto_options()
    check_status(load_library().fh_kto_options_init(ctypes.byref(opt)), "fh_kto_options_init")
    opt.loss_type = int(parse_choice(loss_type, _lib.KTOLossType, "loss_type"))
    opt.beta = _real(beta, "beta")
    opt.desirable_weight = _real(desirable_weight, "desirable_weight")
    opt.undesirable_weight = _real(undesirable_weight, "undesirable_weight")
    return opt


def kto_metrics_dict(values) -> dict:
    """TRL's metric names -> values (a fh_kto_metrics or 9 numbers in its order), NaN entries omitted."""
    return _metrics_dict(KTO_METRIC_KEYS, values)


class KTOProblem(_BatchProblem):
    """A linear head over B*T tokens and a KTO micro-batch: the arguments every fh_kto_* call shares. targets
    (int64) and mask (float32) are contiguous [B*T] views, labels a contiguous [B] uint8 view (1: desirable); the
    reference either ref_logps [B] or ref_per_token_logps [B*T]; kto's KL term either kl (one float32) or
    kl_logratios [B]; or packed sequences: cu_seqlens an int64 [B + 1] view of their offsets, seq 0, the token vectors
    [N]. forward / forward_backward take the fh_kto_outputs arrays by name (sequence_logps, rewards:
    float32 [B]; per_token_logp [B*T])."""
    _prefix, _metrics_struct, _outputs_struct = "fh_kto", _lib.fh_kto_metrics, _lib.fh_kto_outputs

    def __init__(self, head: LinearHead, batch: int, seq: int, targets: View, mask: View, labels: View,
                 ref_logps: Optional[View] = None, ref_per_token_logps: Optional[View] = None,
                 kl: Optional[View] = None, kl_logratios: Optional[View] = None,
                 options: Optional[_lib.fh_kto_options] = None, cu_seqlens: Optional[View] = None):
        b, t = int(batch), int(seq)
        cu, bt = _sequence_rows(head, b, t, cu_seqlens, "[B, T]", "")
        n = head.n
        ids = _vector_ptr(targets, "targets", n, f"{bt} int64 array")
        m = _vector_ptr(mask, "mask", n, f"{bt} float32 array")
        lab = _vector_ptr(labels, "labels", b, f"[B] = [{b}] uint8 vector")
        ref = _vector_ptr(ref_logps, "ref_logps", b, f"[B] = [{b}] float32 vector")
        ref_tok = _vector_ptr(ref_per_token_logps, "ref_per_token_logps", n, f"{bt} float32 array")
        kl_ptr = _vector_ptr(kl, "kl", 1, "[1] float32 value")
        klr = _vector_ptr(kl_logratios, "kl_logratios", b, f"[B] = [{b}] float32 vector")
        self.batch, self.seq = b, t
        labels_p = ctypes.cast(lab, ctypes.POINTER(ctypes.c_uint8)) if lab else None
        super().__init__(head, _lib.fh_kto_batch(b, t, _ip(ids), _fp(m), labels_p, _fp(ref), _fp(ref_tok),
                                                 _fp(kl_ptr), _fp(klr), _ip(cu)),
                         options if options is not None else kto_options())


# ---------------------------------------------------------------------------------------------------------
# Distillation: forward KL, reverse KL, generalized JSD (TRL's GKD generalized_jsd_loss, Liger's fused linear
# JSD and distillation losses), plus a hard-label cross-entropy on the student
# ---------------------------------------------------------------------------------------------------------
def prefixed_errors(prefix: str, make, *args):
    """make(*args), its plain TypeError / ValueError messages prefixed with what they are about (a head of two:
    "student", "teacher"); FusedheadErrors pass unchanged."""
    try:
        return make(*args)
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"{prefix} {e}") from None


def distill_options(*, divergence="jsd", beta=0.5, temperature=1.0, weight_soft_loss=1.0, weight_hard_loss=0.0,
                    ignore_index=-100, reduction="mean", top_k=0, add_tail=True) -> _lib.fh_distill_options:
    """fh_distill_options from TRL/Liger-named keyword arguments (divergence "forward_kl", "reverse_kl" or "jsd";
    beta: jsd's mixture weight, 0 is forward_kl and 1 reverse_kl; top_k and add_tail: TRL's generalized_jsd_loss's,
    top_k 0 the whole vocabulary). The library validates the values (InvalidDistillOptionError,
    InvalidTemperatureError)."""
    opt = _lib.fh_distill_options()
    check_status(load_library().fh_distill_options_init(ctypes.byref(opt)), "fh_distill_options_init")
    opt.divergence = int(parse_choice(divergence, _lib.Divergence, "divergence"))
    opt.beta = _real(beta, "beta")
    opt.temperature = _real(temperature, "temperature")
    opt.weight_soft_loss = _real(weight_soft_loss, "weight_soft_loss")
    opt.weight_hard_loss = _real(weight_hard_loss, "weight_hard_loss")
    opt.ignore_index = int64("ignore_index", ignore_index)  # int, NumPy and 0-d torch integers
    opt.reduction = int(parse_reduction(reduction))
    opt.top_k = int64("top_k", top_k)
    opt.add_tail = _flag(add_tail, "add_tail")
    return opt


class DistillProblem:
    """A student head and a teacher head over the same N tokens and vocabulary (the teacher's hidden size and
    layout may differ; it gets no gradient), optional targets (a contiguous [N] int64 view; None: every token
    counts, and weight_hard_loss must be 0) and options: the arguments every fh_distill_* call shares. The
    library checks that the heads agree (TeacherMismatchError)."""

    def __init__(self, student: LinearHead, teacher: LinearHead, targets: Optional[View] = None,
                 options: Optional[_lib.fh_distill_options] = None):
        self.head, self.teacher = student, teacher
        if targets is not None and (tuple(targets.shape) != (student.n,) or
                                    not vector_view_ok(targets.shape, targets.strides)):
            raise ValueError(f"targets: expected a contiguous [N] = [{student.n}] int64 vector, got shape "
                             f"{_shape(targets.shape)} strides {targets.strides}")
        self.targets = _ip(None if targets is None else targets.ptr)
        self.options = options if options is not None else distill_options()
        self.reduction = Reduction(self.options.reduction)

    @property
    def grad_count(self) -> int:
        """How many upstream-gradient values the library reads: N for 'none', else 1."""
        return self.head.n if self.reduction == Reduction.NONE else 1

    def _call(self, ctx: Context, function: str, per_token_loss: Optional[int], gradient_args: tuple = ()):
        loss, soft, hard = ctypes.c_double(), ctypes.c_double(), ctypes.c_double()
        out = _lib.fh_distill_outputs(*(ctypes.cast(ctypes.byref(v), c_double_p) for v in (loss, soft, hard)),
                                      _fp(per_token_loss))
        args = self._inputs()
        if gradient_args:
            grad_output, grads = gradient_args
            ctx.call(function, *args, _fp(grad_output), ctypes.byref(out), ctypes.byref(grads))
        else:
            ctx.call(function, *args, ctypes.byref(out))
        return loss.value, soft.value, hard.value

    PREFIX = "fh_distill"  # the calls: PREFIX_forward, PREFIX_forward_backward

    def _inputs(self) -> tuple:
        return ctypes.byref(self.head.c), ctypes.byref(self.teacher.c), self.targets, ctypes.byref(self.options)

    def forward(self, ctx: Context, per_token_loss: Optional[int] = None) -> Tuple[float, float, float]:
        """fh_distill_forward; returns (loss, soft_loss, hard_loss) (for 'none': sums over tokens, and the
        float32 [N] per_token_loss address is required)."""
        return self._call(ctx, self.PREFIX + "_forward", per_token_loss)

    def forward_backward(self, ctx: Context, grad_output: int, grads: _lib.fh_linear_grads,
                         per_token_loss: Optional[int] = None) -> Tuple[float, float, float]:
        """fh_distill_forward_backward: the loss and the student's gradients (grad_output: grad_count float32
        values, d(objective)/d(loss)); returns (loss, soft_loss, hard_loss)."""
        return self._call(ctx, self.PREFIX + "_forward_backward", per_token_loss, (grad_output, grads))

    def workspace_size(self, ctx: Context) -> int:
        size = ctypes.c_size_t()
        ctx.call("fh_distill_workspace_size", ctypes.byref(self.head.c), ctypes.byref(self.teacher.c),
                 ctypes.byref(self.options), ctypes.byref(size), pure=True)
        return size.value


# ---------------------------------------------------------------------------------------------------------
# Top-k teacher distillation: the teacher as k token ids and log-probs per token (TRL's server distillation)
# ---------------------------------------------------------------------------------------------------------
def distill_topk_options(*, add_tail=True, temperature=1.0, weight_soft_loss=1.0, weight_hard_loss=0.0,
                         ignore_index=-100, reduction="mean") -> _lib.fh_distill_topk_options:
    """fh_distill_topk_options from TRL-named keyword arguments (add_tail: ServerDistillationConfig's
    loss_add_tail). The library validates the values (InvalidDistillOptionError, InvalidTemperatureError)."""
    opt = _lib.fh_distill_topk_options()
    check_status(load_library().fh_distill_topk_options_init(ctypes.byref(opt)), "fh_distill_topk_options_init")
    opt.add_tail = _flag(add_tail, "add_tail")
    opt.temperature = _real(temperature, "temperature")
    opt.weight_soft_loss = _real(weight_soft_loss, "weight_soft_loss")
    opt.weight_hard_loss = _real(weight_hard_loss, "weight_hard_loss")
    opt.ignore_index = int64("ignore_index", ignore_index)
    opt.reduction = int(parse_reduction(reduction))
    return opt


class DistillTopkProblem(DistillProblem):
    """A student head over N tokens, the teacher's contiguous [N, k] int64 ids and float32 log-probs (-inf marks a
    padded entry), optional targets and options: the arguments every fh_distill_topk_* call shares."""
    PREFIX = "fh_distill_topk"

    def __init__(self, student: LinearHead, ids: View, logprobs: View, targets: Optional[View] = None,
                 options: Optional[_lib.fh_distill_topk_options] = None):
        n = student.n
        if len(ids.shape) == 2 and ids.shape[1] == 0:  # the library's own refusal, before a stride complaint
            raise error_for(Status.ERR_INVALID_DISTILL_OPTION, status_string(Status.ERR_INVALID_DISTILL_OPTION),
                            f"the teacher's k = 0 is outside [1, {_lib.DISTILL_TOPK_MAX_K}]")
        for name, v in (("teacher_ids", ids), ("teacher_logprobs", logprobs)):
            if len(v.shape) != 2 or v.shape[0] != n or v.strides != (v.shape[1], 1):
                raise ValueError(f"{name}: expected a C-contiguous [N, k] = [{n}, k] array, got shape "
                                 f"{_shape(v.shape)} strides {v.strides}")
        if ids.shape != logprobs.shape:
            raise ValueError(f"teacher_ids {_shape(ids.shape)} and teacher_logprobs {_shape(logprobs.shape)} differ")
        super().__init__(student, None, targets, options if options is not None else distill_topk_options())
        self.teacher = _lib.fh_topk_teacher(ids.shape[1], _ip(ids.ptr), _fp(logprobs.ptr))

    def _inputs(self) -> tuple:
        return ctypes.byref(self.head.c), ctypes.byref(self.teacher), self.targets, ctypes.byref(self.options)

    def workspace_size(self, ctx: Context) -> int:
        size = ctypes.c_size_t()
        ctx.call("fh_distill_topk_workspace_size", ctypes.byref(self.head.c), ctypes.byref(size), pure=True)
        return size.value


__all__ = ["Context", "default_context", "set_default_context_settings", "default_context_settings", "kernel_info",
           "KernelInfo", "bf16_available", "status_string", "View", "LinearHead", "CEProblem", "GRPOProblem",
           "grpo_options", "grpo_option_dict", "GRPO_OPTION_NAMES", "GRPO_OPTION_DEFAULTS", "grpo_metrics_dict",
           "PreferenceProblem", "preference_options", "pairs_shape",
           "preference_metrics_dict", "KTOProblem", "kto_options", "kto_metrics_dict", "KTO_METRIC_KEYS",
           "DistillProblem", "distill_options", "prefixed_errors", "FusedheadError", "DistillTopkProblem",
           "distill_topk_options"]
