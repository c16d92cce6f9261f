"""Small C kernels for decode on CPU, built on first use with cc: paged decode attention, the batch-1 float32
matrix-vector product, the Q8_0 / Q4_1 block matmuls of quantised layers (models/quant.py) and a whole decoder step
in one call (models/fused_decode.py).

torch has no paged attention on CPU: the portable path gathers each request's KV blocks into a contiguous copy before
attending, which at large batch moves the KV cache through memory three times per step. The kernel reads the cache
in place, once. It is compiled with `cc -O3 -march=native -fopenmp` into the omnivox cache (keyed by source, compiler
flags and the CPU's instruction-set flags: native/kernel_build.py), loaded with ctypes (which releases the GIL during
the call), and used for float32 CPU decode. `library(target)` builds for a named instruction set instead
(`x86-64-v3`: AVX2 + FMA), and `use_target` makes the engine run on it (tests force the AVX2 kernels that way).
Without a compiler, or when the build fails, the portable path serves and a warning says so once.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from omnivox.native.kernel_build import TARGETS, BuildError, build_library, compiler, cpu_flags, runnable_targets

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name) for name in ("cpu_kernels.c", "block_kernels_vnni.c", "block_kernels_avx2.c")
]
_HEADER = Path(__file__).with_name("intrinsics_scalar.h")
_COMPILE = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC"]  # -march comes from the target (native/kernel_build.py)
_LINK = ["-shared", "-fopenmp", "-lm"]
_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}  # per target, built and loaded once per process (None: unavailable)
_failures: dict[str, str] = {}  # per target: why it is unavailable although a compiler exists (a build or load error)
_target = "native"  # the build the engine's kernels run on (use_target)
_lib: ctypes.CDLL | None = None  # the loaded library of _target, once kernel_available() said True
_resolved = False  # whether kernel_available() has asked for _target's library (it is called per layer per step)
_many: dict[str, str | None] = {}  # per target: its many-row kernel (many_row_kernel)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The argument types of every kernel entry point."""
    fn = lib.paged_decode_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    gemv = lib.gemv_f32
    gemv.restype = None
    gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2
    for name in ("q4", "q8"):
        mm = getattr(lib, f"{name}_matmul_f32")
        mm.restype = None
        mm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        deq = getattr(lib, f"{name}_dequantize_f32")
        deq.restype = None
        deq.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    lib.vnni_available.restype = ctypes.c_int
    lib.vnni_available.argtypes = []
    lib.avx2_rows_available.restype = ctypes.c_int
    lib.avx2_rows_available.argtypes = []
    for name in ("block_matmul_vnni", "block_matmul_avx2"):
        many = getattr(lib, name)
        many.restype = None
        many.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    layers = lib.decoder_layers_f32
    layers.restype = None
    layers.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 4
    layers.argtypes += [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return lib


def library(target: str = "native") -> ctypes.CDLL | None:
    """The kernels built for `target` (native/kernel_build.py TARGETS), built and loaded once per process; None
    without a compiler, when the build failed (build_failure says why) or when this CPU cannot run the target."""
    with _lock:
        if target not in _libraries:
            _libraries[target] = _load(target)
        return _libraries[target]


def _load(target: str) -> ctypes.CDLL | None:
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}: one of {sorted(TARGETS)}")
    if target not in runnable_targets():
        missing = sorted(TARGETS[target].requires - cpu_flags())
        _failures[target] = f"this CPU cannot run {target} (no {', '.join(missing)})"
        return None
    if compiler() is None:
        log.warning("no C compiler: CPU decode attention uses the portable (slower) path")
        return None
    try:
        return _declare(ctypes.CDLL(str(build_library("cpu_kernels", _SOURCES, _COMPILE, _LINK, target))))
    except BuildError as err:
        _failures[target] = str(err)
        log.warning("building the CPU kernels for %s failed: %s", target, err)
    except Exception as exc:  # never let an optional speed-up stop the engine
        _failures[target] = f"{type(exc).__name__}: {exc}"
        log.warning("CPU kernels for %s unavailable: %s", target, exc)
    return None


def vnni_emulation() -> ctypes.CDLL | None:
    """block_kernels_vnni.c built against scalar versions of its intrinsics (models/intrinsics_scalar.h), once per
    process: the many-row kernel's logic on any host, for its twin tests (slow; never serves). None without a
    compiler or when the build failed (build_failure("emulation") says why)."""
    with _lock:
        if "emulation" not in _libraries:
            _libraries["emulation"] = _load_emulation()
        return _libraries["emulation"]


def _load_emulation() -> ctypes.CDLL | None:
    if compiler() is None:
        return None
    try:
        flags = [*_COMPILE, "-DOMNIVOX_SCALAR_INTRINSICS"]
        lib = ctypes.CDLL(str(build_library("vnni_emulation", [_SOURCES[1]], flags, _LINK, depends=[_HEADER])))
    except BuildError as err:
        _failures["emulation"] = str(err)
        return None
    lib.vnni_available.restype = ctypes.c_int
    lib.block_matmul_vnni.restype = None
    lib.block_matmul_vnni.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    return lib


def use_target(target: str) -> None:
    """Run the engine's kernels from the build for `target` from now on (default "native").

    For tests (tests/conftest.py): an AVX-512 host forced to "x86-64-v3" runs the AVX2 kernels every AVX2-only user
    runs. Call it before a model is loaded: a fused decode table (models/fused_decode.py) keeps the routes it chose.
    """
    global _target, _lib, _resolved
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}: one of {sorted(TARGETS)}")
    with _lock:
        _target, _lib, _resolved = target, None, False


def active_target() -> str:
    """The target use_target chose ("native" unless forced)."""
    return _target


def kernel_available() -> bool:
    global _lib, _resolved
    if not _resolved:  # without kernels, a plain flag test per call, not the build lock
        _lib, _resolved = library(_target), True
    return _lib is not None


def build_failure(target: str | None = None) -> str | None:
    """Why the kernels for `target` (default: the active one) are unavailable when a compiler exists (None: built,
    or no compiler at all).

    The engine serves on the portable path either way; the kernel tests fail on this rather than skip, so that a
    kernel that stops compiling cannot hide behind the fallback.
    """
    target = target or _target
    vnni_emulation() if target == "emulation" else library(target)
    return _failures.get(target)


def _active() -> ctypes.CDLL:
    assert kernel_available(), "call kernel_available() first"
    return _lib


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] float32
    k_cache: torch.Tensor,  # [num_slots, KVH, D] float32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    block_size: int,
    scale: float,
    window: int | None = None,  # sliding window: each query sees only its last `window` keys
    lib: ctypes.CDLL | None = None,  # a library() of another target (default: the active build)
) -> torch.Tensor:  # [B, H, D]
    lib = lib or _active()
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    b, h, d = q.shape
    out = torch.empty_like(q)
    lib.paged_decode_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        k_cache.shape[1],
        d,
        block_size,
        tables.shape[1],
        scale,
        torch.get_num_threads(),
        window or 0,
    )
    return out


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias): one row, float32, contiguous weight (batch-1 decode)."""
    lib = lib or _active()
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype)
    lib.gemv_f32(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), n, k)
    return out


def block_matmul(
    kind: str,
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ W.T (+ bias) for W held as GGUF blocks of 32: kind "q4" (Q4_1, 20 bytes a block) or "q8"
    (Q8_0, 34 bytes); `blocks` uint8 [n, K / 32 * bytes], K % 32 == 0.

    Activations are quantised to int8 per group of 32 inside the call (see cpu_kernels.c); returns [M, n] float32.
    """
    lib = lib or _active()
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    fn = lib.q4_matmul_f32 if kind == "q4" else lib.q8_matmul_f32
    bias_ptr = None if bias is None else bias.data_ptr()
    fn(blocks.data_ptr(), x.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, torch.get_num_threads())
    return out


def vnni_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the many-row VNNI block kernel (block_kernels_vnni.c) is in `lib` (default: the active build)."""
    lib = lib or library(_target)
    return lib is not None and bool(lib.vnni_available())


def many_row_kernel(lib: ctypes.CDLL | None = None) -> str | None:
    """The many-row integer block kernel in `lib` (default: the active build): "vnni" (block_kernels_vnni.c, AVX-512
    VNNI), else "avx2" (block_kernels_avx2.c, AVX2 + FMA), else None (the int16 kernels and float GEMM serve)."""
    if lib is None:
        if _target not in _many:  # asked per layer call: looked up once per target
            _many[_target] = many_row_kernel(library(_target)) if library(_target) is not None else None
        return _many[_target]
    if lib.vnni_available():
        return "vnni"
    if getattr(lib, "avx2_rows_available", None) is not None and lib.avx2_rows_available():  # the emulation has none
        return "avx2"
    return None


def block_matmul_many(
    kind: str,
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    act_bits: int = 15,
    lib: ctypes.CDLL | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """As block_matmul, through the many-row kernel `kernel` ("vnni" / "avx2"; default many_row_kernel(lib)).

    act_bits: activations per group of 32 as 15 bits (two int8 passes) or 8 (one pass, llama.cpp's Q8_1)."""
    if act_bits not in (8, 15):
        raise ValueError(f"act_bits must be 8 or 15, got {act_bits}")
    lib = lib or _active()
    kernel = kernel or many_row_kernel(lib)
    if kernel not in ("vnni", "avx2"):
        raise ValueError(f"no many-row kernel {kernel!r} in this build")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    fn = lib.block_matmul_vnni if kernel == "vnni" else lib.block_matmul_avx2
    passes = 1 if act_bits == 8 else 2
    fn(
        blocks.data_ptr(),
        int(kind == "q4"),
        x.data_ptr(),
        bias_ptr,
        out.data_ptr(),
        m,
        n,
        k,
        passes,
        torch.get_num_threads(),
    )
    return out


def block_dequantize(kind: str, blocks: torch.Tensor, n: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """GGUF blocks ("q4" / "q8", see block_matmul) [n, k / 32 * bytes] -> float32 [n, k] (k % 32 == 0)."""
    lib = lib or _active()
    out = torch.empty(n, k, dtype=torch.float32)
    fn = lib.q4_dequantize_f32 if kind == "q4" else lib.q8_dequantize_f32
    fn(blocks.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def decoder_layers(
    table: ctypes.Array,  # fused_layer entries (models/fused_decode.py), one per layer
    num_layers: int,
    x: torch.Tensor,  # [M, H] float32, contiguous: the residual stream, updated in place
    cos: torch.Tensor,  # [M, D] float32
    sin: torch.Tensor,  # [M, D]
    slots: torch.Tensor,  # [M] int64 KV slot of each row
    tables: torch.Tensor,  # [M, max_blocks] int64
    lens: torch.Tensor,  # [M] int64 context length of each row (its own token included)
    intermediate_size: int,
    block_size: int,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Every decoder layer of one decode step in one call (decoder_layers_f32 in cpu_kernels.c)."""
    lib = lib or _active()
    m, h = x.shape
    lib.decoder_layers_f32(
        ctypes.addressof(table),
        num_layers,
        x.data_ptr(),
        m,
        h,
        cos.shape[1],
        intermediate_size,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        block_size,
        tables.shape[1],
        torch.get_num_threads(),
    )
