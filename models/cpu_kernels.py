"""Small C kernels for decode on CPU, built on first use with cc: paged decode attention, the batch-1 float32
matrix-vector product, the Q8_0 / Q4_1 block matmuls of quantised layers (models/quant.py) and a whole decoder step
in one call (models/fused_decode.py).

torch has no paged attention on CPU: the portable path gathers each request's KV blocks into a contiguous copy before
attending, which at large batch moves the KV cache through memory three times per step. The kernel reads the cache
in place, once. It is compiled with `cc -O3 -march=native -fopenmp` into the omnivox cache (keyed by source, compiler
flags and CPU), loaded with ctypes (which releases the GIL during the call), and used for float32 CPU decode.
Without a compiler, or when the build fails, the portable path serves and a warning says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .cache import build_cached, omnivox_cache_dir

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.c", "block_kernels_vnni.c")]
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_vnni: bool | None = None  # whether block_kernels_vnni.c was built with its VNNI kernel (checked once)
_failure: str | None = None  # why the kernels are unavailable although a compiler exists (a build or load error)


def _cache_dir() -> Path:
    return omnivox_cache_dir() / "kernels"


def cpu_id() -> str:
    """This CPU's model line from /proc/cpuinfo: part of a kernel build's cache key (-march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    """The C compiler the kernels are built with ($CC, else cc, else gcc), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


class _BuildError(Exception):
    """The compiler ran and failed (a compiler that is missing is not an error: the portable path serves)."""


def _build() -> ctypes.CDLL | None:
    global _failure
    cc = compiler()
    if cc is None:
        log.warning("no C compiler: CPU decode attention uses the portable (slower) path")
        return None
    source = b"".join(path.read_bytes() for path in _SOURCES)
    key = hashlib.sha256(source + " ".join([cc, *_FLAGS, cpu_id()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"

    def compile_to(staged: Path) -> None:
        proc = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", str(staged), "-lm"], capture_output=True)
        if proc.returncode != 0:
            raise _BuildError(f"{cc} failed: {proc.stderr.decode()[-500:]}")

    try:
        build_cached(target, compile_to, Path.exists)  # the one locked, atomic cache build (models/cache.py)
    except _BuildError as err:
        _failure = str(err)
        log.warning("building the CPU attention kernel failed: %s", _failure)
        return None
    lib = ctypes.CDLL(str(target))
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
    vnni = lib.block_matmul_vnni
    vnni.restype = None
    vnni.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    layers = lib.decoder_layers_f32
    layers.restype = None
    layers.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 4
    layers.argtypes += [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return lib


def kernel_available() -> bool:
    global _lib, _tried, _failure
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception as exc:  # never let an optional speed-up stop the engine
            _failure = f"{type(exc).__name__}: {exc}"
            log.warning("CPU attention kernel unavailable: %s", exc)
            _lib = None
    return _lib is not None


def build_failure() -> str | None:
    """Why the kernels are unavailable when a compiler exists (None: built, or no compiler at all).

    The engine serves on the portable path either way; the kernel tests fail on this rather than skip, so that a
    kernel that stops compiling cannot hide behind the fallback.
    """
    kernel_available()
    return _failure


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] float32
    k_cache: torch.Tensor,  # [num_slots, KVH, D] float32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    block_size: int,
    scale: float,
    window: int | None = None,  # sliding window: each query sees only its last `window` keys
) -> torch.Tensor:  # [B, H, D]
    assert _lib is not None, "call kernel_available() first"
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    b, h, d = q.shape
    out = torch.empty_like(q)
    _lib.paged_decode_attention_f32(
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


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias): one row, float32, contiguous weight (batch-1 decode)."""
    assert _lib is not None, "call kernel_available() first"
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype)
    _lib.gemv_f32(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), n, k)
    return out


def block_matmul(kind: str, x: torch.Tensor, blocks: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 @ W.T (+ bias) for W held as GGUF blocks of 32: kind "q4" (Q4_1, 20 bytes a block) or "q8"
    (Q8_0, 34 bytes); `blocks` uint8 [n, K / 32 * bytes], K % 32 == 0.

    Activations are quantised to int8 per group of 32 inside the call (see cpu_kernels.c); returns [M, n] float32.
    """
    assert _lib is not None, "call kernel_available() first"
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    fn = _lib.q4_matmul_f32 if kind == "q4" else _lib.q8_matmul_f32
    bias_ptr = None if bias is None else bias.data_ptr()
    fn(blocks.data_ptr(), x.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, torch.get_num_threads())
    return out


def vnni_available() -> bool:
    """Whether the many-row VNNI block kernel (block_kernels_vnni.c) was built for this CPU."""
    global _vnni
    if _vnni is None:
        _vnni = kernel_available() and bool(_lib.vnni_available())
    return _vnni


def block_matmul_vnni(
    kind: str, x: torch.Tensor, blocks: torch.Tensor, n: int, bias: torch.Tensor | None, act_bits: int = 15
) -> torch.Tensor:
    """As block_matmul, through the many-row VNNI kernel (block_kernels_vnni.c); vnni_available() only.

    act_bits: activations per group of 32 as 15 bits (two int8 passes) or 8 (one pass, llama.cpp's Q8_1)."""
    if act_bits not in (8, 15):
        raise ValueError(f"act_bits must be 8 or 15, got {act_bits}")
    assert _lib is not None, "call kernel_available() first"
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    _lib.block_matmul_vnni(
        blocks.data_ptr(),
        int(kind == "q4"),
        x.data_ptr(),
        bias_ptr,
        out.data_ptr(),
        m,
        n,
        k,
        1 if act_bits == 8 else 2,
        torch.get_num_threads(),
    )
    return out


def block_dequantize(kind: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """GGUF blocks ("q4" / "q8", see block_matmul) [n, k / 32 * bytes] -> float32 [n, k] (k % 32 == 0)."""
    assert _lib is not None, "call kernel_available() first"
    out = torch.empty(n, k, dtype=torch.float32)
    fn = _lib.q4_dequantize_f32 if kind == "q4" else _lib.q8_dequantize_f32
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
) -> None:
    """Every decoder layer of one decode step in one call (decoder_layers_f32 in cpu_kernels.c)."""
    assert _lib is not None, "call kernel_available() first"
    m, h = x.shape
    _lib.decoder_layers_f32(
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
