"""Building C kernels for the CPU they run on: the compiler, the CPU's instruction-set flags, the build targets, and
one cached build (models/cpu_kernels.py and codecs/codec_kernels.py both build through `build_library`).

A build is keyed by its sources, the compiler and its flags, and the instruction-set features its target enables.
For `-march=native` those are this host's: the `flags` line of /proc/cpuinfo, not the model name. Hosts with one
model name can differ in features (a cloud "AMD EPYC" or "Intel Xeon Processor" with or without AVX-512, by
hypervisor and generation), and a native build from an AVX-512 host reused on an AVX2 host dies with SIGILL on its
first AVX-512 instruction (issue 28; docker/Dockerfile prebuilds the kernels on the machine that builds the image).
A named target (`x86-64-v3`, ...) enables a fixed set, so its build is one for every host that has that set.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omnivox.native.cache import build_cached, omnivox_cache_dir

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class BuildTarget:
    """An instruction set a kernel library is compiled for."""

    name: str
    march: str  # the -march value
    requires: frozenset[str]  # /proc/cpuinfo flags a host needs to run the build (empty for native: the host's own)


# The x86-64 micro-architecture levels (psABI): v3 is AVX2 + FMA + F16C + BMI1/2 + MOVBE + LZCNT (cpuinfo "abm"),
# v4 adds AVX-512 F/BW/CD/DQ/VL. An AVX-512 host runs every level below its own.
TARGETS = {
    "native": BuildTarget("native", "native", frozenset()),
    "x86-64-v3": BuildTarget(
        "x86-64-v3", "x86-64-v3", frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
    ),
    "x86-64-v4": BuildTarget(
        "x86-64-v4",
        "x86-64-v4",
        frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
        | frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ),
}


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none): the seam the tests feed other hosts' text through. The one
    reader of it: the kernel builds, the benchmarks' host records (benchmarks/host.py, cpu_flags.py) all read here."""
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of the first processor in `cpuinfo` (default: this host's /proc/cpuinfo)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86 / ARM spelling
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first processor's model name in `cpuinfo` (default: this host's; "" where there is none)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def runnable_targets(cpuinfo: str | None = None) -> list[str]:
    """The targets a host with `cpuinfo` can run, native first."""
    flags = cpu_flags(cpuinfo)
    return [name for name, target in TARGETS.items() if target.requires <= flags]


def target_key(target: str, cpuinfo: str | None = None) -> str:
    """What a build for `target` depends on besides sources and flags: the host's flags for native, else the name."""
    if target != "native":
        return target
    return "native:" + " ".join(sorted(cpu_flags(cpuinfo)))


def compiler() -> str | None:
    """The C compiler kernels are built with ($CC, else cc, else gcc), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


class BuildError(Exception):
    """The compiler ran and failed (a missing compiler is not an error: the callers' portable paths serve)."""


def library_path(
    name: str,
    sources: Sequence[Path],
    compile_flags: Sequence[str],
    link_flags: Sequence[str],
    target: str,
    cc: str,
    cpuinfo: str | None = None,
    depends: Sequence[Path] = (),
) -> Path:
    """Where the build of `sources` for `target` lives in the omnivox cache (its name holds the cache key)."""
    digest = hashlib.sha256()
    for source in [*sources, *depends]:
        digest.update(source.read_bytes())
    digest.update(" ".join([cc, *compile_flags, "|", *link_flags, "|", target_key(target, cpuinfo)]).encode())
    return omnivox_cache_dir() / "kernels" / f"{name}-{target}-{digest.hexdigest()[:16]}.so"


def build_library(
    name: str,
    sources: Sequence[Path],
    compile_flags: Sequence[str],
    link_flags: Sequence[str],
    target: str = "native",
    cc: str | None = None,
    depends: Sequence[Path] = (),
) -> Path:
    """Compile `sources` (each to an object with `compile_flags` and `-march` of `target`), link them into a shared
    library with `link_flags`, once per cache key (native/cache.py's locked, atomic build); return its path.

    Raises BuildError when the compiler fails, ValueError for an unknown target or when there is no compiler.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}: one of {sorted(TARGETS)}")
    cc = cc or compiler()
    if cc is None:
        raise ValueError("no C compiler")
    march = [f"-march={TARGETS[target].march}"]
    path = library_path(name, sources, [*march, *compile_flags], link_flags, target, cc, depends=depends)

    def compile_to(staged: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            objects = [str(Path(tmp) / f"{i}-{source.stem}.o") for i, source in enumerate(sources)]
            commands = [
                [cc, *march, *compile_flags, "-c", str(s), "-o", o] for s, o in zip(sources, objects, strict=True)
            ]
            commands.append([cc, *march, *objects, *link_flags, "-o", str(staged)])
            for command in commands:
                proc = subprocess.run(command, capture_output=True)
                if proc.returncode != 0:
                    raise BuildError(f"{cc} failed: {proc.stderr.decode()[-500:]}")

    return build_cached(path, compile_to, Path.exists)
