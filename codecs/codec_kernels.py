"""C kernels for the SNAC decoder on CPU (codecs/codec_kernels.c): the Snake activation and the depthwise convolutions.

Profile of 2 streams served (BENCHMARKS.md, "Speech start-up"): the Snake activations were 21 % of the codec's time.
The eager form (codecs/snac.py `_EagerSnake`, bit-identical to snac's) makes five passes over memory and its sin runs
at scalar rate; the kernel makes one, with glibc's vectorised sinf. Measured on this machine, one thread,
(2 x 64 x 40960) float32: 22.5 -> 3.7 ms, max difference 1e-6 from the eager form; the whole streamed decode stays
within the 1e-5 of the float32 one-shot decode that tests/codecs/test_codec_snac_fast.py holds.

The depthwise 7-tap convolutions (22 % of the codec in the same profile, as snac_fast.ShiftedDepthwise's 7 shifted
multiply-adds: 7 passes over memory) run as one pass per channel row, the same sums in the same order: bit-identical
here, and 3-4x faster per layer (64 ch x 36864 steps, dilation 1: 40 -> 9 ms; 512 x 2304: 20 -> 5.5 ms).

Built on first use with cc into the omnivox cache (keyed by source, flags and CPU) and called through ctypes (which
releases the GIL, so the codec worker and the engine thread run side by side). Compiled to an object with -ffast-math
and linked without it: GCC before 13 links crtfastmath.o into a -ffast-math shared library, which turns on
flush-to-zero for the whole process when it loads. Without a compiler, or off CPU float32, the eager form serves.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch
from torch import nn

from omnivox.native.kernel_build import BuildError, build_library, compiler

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("codec_kernels.c")
_COMPILE = ["-O3", "-ffast-math", "-fopenmp-simd", "-fPIC"]  # -march=native: build_library's default target
_LINK = ["-shared", "-lm"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    if compiler() is None:  # found as for the model kernels, keyed by the same CPU flags (native/kernel_build.py)
        log.info("no C compiler: the SNAC decoder runs in torch alone")
        return None
    try:
        target = build_library("codec_kernels", [_SOURCE], _COMPILE, _LINK)
    except BuildError as err:
        log.warning("building the codec kernels failed (torch serves): %s", err)
        return None
    lib = ctypes.CDLL(str(target))
    lib.snake_f32.restype = None
    lib.snake_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.depthwise_f32.restype = None
    lib.depthwise_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
    return lib


def codec_kernels() -> ctypes.CDLL | None:
    """The compiled kernel, built once per process (None: unavailable, the eager form serves)."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except Exception as exc:  # an optional speed-up never stops the codec
                log.warning("codec kernels unavailable: %s", exc)
                _lib = None
    return _lib


class FusedSnake(nn.Module):
    """Snake1d with the same parameter (alpha, 1 x C x 1) through the C kernel where it applies."""

    def __init__(self, alpha: nn.Parameter) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C x T)
        lib = codec_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        alpha = self.alpha.detach().reshape(-1).to(x.dtype).contiguous()  # (C,)
        inv_alpha = (alpha + 1e-9).reciprocal()
        if lib is None or x.dim() != 3 or self.alpha.dtype != torch.float32:
            t = torch.mul(alpha[:, None], x)
            t.sin_().square_().mul_(inv_alpha[:, None])
            return t.add_(x)
        x = x.contiguous()
        y = torch.empty_like(x)
        lib.snake_f32(x.data_ptr(), y.data_ptr(), alpha.data_ptr(), inv_alpha.data_ptr(), *x.shape)
        return y


def fuse_snakes(module: nn.Module, snake_type: type[nn.Module]) -> int:
    """Replace every `snake_type` child (a module with `alpha`) by FusedSnake in place; returns how many."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is snake_type:
                setattr(parent, name, FusedSnake(child.alpha))
                replaced += 1
    return replaced


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int, padding: int):
    """A depthwise stride-1 Conv1d (weight C x K, bias C) through the C kernel, or None where it does not apply
    (off CPU float32, or no kernel): the caller then runs its torch form."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 3:
        return None
    lib = codec_kernels()
    if lib is None:
        return None
    x = x.contiguous()
    k = weight.shape[1]
    out_len = x.shape[-1] + 2 * padding - dilation * (k - 1)
    if out_len <= 0:
        return None
    y = torch.empty(x.shape[0], x.shape[1], out_len, dtype=x.dtype)
    w, b = weight.detach().contiguous(), bias.detach().contiguous()
    lib.depthwise_f32(x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr(), *x.shape, k, dilation, padding)
    return y
