"""The CPU's instruction-set flags that decide which kernels run (recorded in every speed result: a figure from an
AVX-512 VNNI host is not one from an AVX2 host)."""

from __future__ import annotations

from omnivox.native.kernel_build import cpu_flags as flag_set
from omnivox.native.kernel_build import cpu_model

# The flags the kernels dispatch on (models/, torch's ATen and oneDNN), as /proc/cpuinfo names them.
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_flags(cpuinfo: str | None = None) -> dict:
    """{"model": the CPU's name, "flags": the KERNEL_FLAGS it has, in that order}; empty off Linux. `cpuinfo`:
    /proc/cpuinfo's text (default: this host's, read by native/kernel_build.py, the one reader)."""
    flags = flag_set(cpuinfo)
    return {"model": cpu_model(cpuinfo), "flags": [f for f in KERNEL_FLAGS if f in flags]}
