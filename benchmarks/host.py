"""What every benchmark results file says about the machine it ran on: the CPU's model name and instruction-set
flags (AVX2, AVX-512, VNNI, ...) and the kernel build the engine ran on. One "AMD EPYC" model name covers hosts with
and without AVX-512 (BENCHMARKS.md once called one such host "AVX2, no AVX-512" and a VNNI "Zen 4"), and the C
kernels take other paths on each, so a figure means little without the flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omnivox.native.kernel_build import cpu_flags, cpu_model, read_cpuinfo

# The flags that decide which kernel paths run (x86 vector extensions, FMA, half floats, bit manipulation, AMX; ARM).
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "vnni", "neon", "asimd", "sve")


def instruction_sets(cpuinfo: str | None = None) -> list[str]:
    """This host's instruction-set flags from /proc/cpuinfo (sorted; empty where there is none)."""
    return sorted(f for f in cpu_flags(cpuinfo) if f.startswith(_ISA_PREFIXES))


def host_record(cpuinfo: str | None = None) -> dict[str, Any]:
    """The machine's CPU as a results file records it."""
    from omnivox.models import cpu_kernels

    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return {
        "cpu_model": cpu_model(text),
        "cpu_count": os.cpu_count(),
        "cpu_flags": instruction_sets(text),
        "kernel_target": cpu_kernels.active_target(),
    }


def with_host(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the machine's `host` record (kept where the result already has one)."""
    return {"host": host_record(), **result}


def write_results(path: str | os.PathLike, result: dict[str, Any], indent: int = 2) -> None:
    """Write a benchmark's results JSON, with the machine's `host` record."""
    Path(path).write_text(json.dumps(with_host(result), indent=indent, default=str) + "\n")
