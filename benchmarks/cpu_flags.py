"""The CPU's instruction-set flags that decide which kernels run (recorded in every speed result: a figure from an
AVX-512 VNNI host is not one from an AVX2 host)."""

from __future__ import annotations

from pathlib import Path

# The flags the kernels dispatch on (models/, torch's ATen and oneDNN), as /proc/cpuinfo names them.
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """{"model": the CPU's name, "flags": the KERNEL_FLAGS it has, in that order}; empty off Linux."""
    model, flags = "", set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in KERNEL_FLAGS if f in flags]}
