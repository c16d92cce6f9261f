"""Every benchmark results file records the CPU's instruction-set flags (benchmarks/host.py), not only its model
name: one "AMD EPYC" name covers hosts with and without AVX-512, whose kernels take other paths."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from support.paths import REPO_ROOT

from omnivox.benchmarks import host

ROOT = REPO_ROOT
# JSON written by benchmarks/ that is not a results file: a checkpoint's marker, a config copy.
NOT_RESULTS = {"make_random_checkpoint.py"}


def test_results_record_the_instruction_sets(tmp_path: Path):
    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2 hypervisor avx512_vnni\n"
    record = host.host_record(info)
    assert record["cpu_model"] == "AMD EPYC"
    assert record["cpu_flags"] == ["avx", "avx2", "avx512_vnni", "bmi2", "f16c", "fma", "sse2"]
    # The build the in-process kernels run: native, or what OMNIVOX_TEST_KERNEL_TARGET forced (tests/conftest.py).
    assert record["kernel_target"] == (os.environ.get("OMNIVOX_TEST_KERNEL_TARGET") or "native")
    host.write_results(tmp_path / "r.json", {"tps": 1.0})
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["tps"] == 1.0 and written["host"]["cpu_flags"] == host.instruction_sets()


def test_every_benchmark_writes_results_through_write_results():
    """No benchmark module writes JSON to a file except through host.write_results (which adds the host record)."""
    offenders = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        if path.name in NOT_RESULTS or path.name == "host.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            call = ast.unparse(node)
            writes_json = node.func.attr == "write_text" and "json.dumps" in call
            not_results = "config" in call or "baselines" in call  # a config copy, the speed gate's baselines
            if writes_json and not not_results or node.func.attr == "dump":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"results JSON written without the host record: {offenders}"


def test_one_reader_of_cpuinfo():
    """The CPU's flags and model name come from native/kernel_build.py alone (three modules read /proc/cpuinfo each
    their own way before); the benchmarks' two records agree on the same text."""
    offenders = [
        f"{path.relative_to(ROOT)}"
        for folder in ("benchmarks", "services", "engine", "models", "codecs", "native")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "kernel_build.py" and 'Path("/proc/cpuinfo")' in path.read_text()
    ]
    assert not offenders, offenders
    from omnivox.benchmarks.cpu_flags import cpu_flags

    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma f16c avx512_vnni\n"
    assert cpu_flags(info) == {"model": "AMD EPYC", "flags": ["avx", "avx2", "fma", "f16c", "avx512_vnni"]}
    assert cpu_flags("") == {"model": "", "flags": []}
    assert host.host_record(info)["cpu_model"] == cpu_flags(info)["model"]
