"""native/kernel_build.py: a kernel build is keyed by the instruction-set features it targets, so a -march=native
build from an AVX-512 host is never reused on an AVX2 host that reports the same model name (issue 28: SIGILL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnivox.native import kernel_build

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass

MODEL = "model name\t: AMD EPYC Processor\n"
AVX2 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm"
AVX512 = AVX2 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni"


def cpuinfo(flags: str, model: str = MODEL, processors: int = 2) -> str:
    """/proc/cpuinfo's text for a host with `flags` (one block per processor, as Linux writes it)."""
    block = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\n{model}flags\t\t: {flags}\n\n"
    return "".join(block.format(i) for i in range(processors))


@pytest.fixture
def source(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "k.c"
    path.write_text("int f(void) { return 1; }\n")
    return path


def _path(source: Path, target: str, info: str) -> Path:
    return kernel_build.library_path("k", [source], ["-O3"], ["-shared"], target, "cc", cpuinfo=info)


def test_same_model_name_different_flags_get_different_native_builds(source):
    avx2_host, avx512_host = cpuinfo(AVX2), cpuinfo(AVX512)
    assert _path(source, "native", avx2_host) != _path(source, "native", avx512_host)
    # the features decide, not the name: another name with the same flags shares the build
    other_name = cpuinfo(AVX2, model="model name\t: Intel Xeon Processor\n")
    assert _path(source, "native", other_name) == _path(source, "native", avx2_host)


def test_named_targets_share_one_build_across_hosts(source):
    assert _path(source, "x86-64-v3", cpuinfo(AVX2)) == _path(source, "x86-64-v3", cpuinfo(AVX512))
    assert _path(source, "x86-64-v3", cpuinfo(AVX2)) != _path(source, "native", cpuinfo(AVX2))


def test_cpu_flags_and_runnable_targets():
    assert kernel_build.cpu_flags(cpuinfo(AVX2)) == frozenset(AVX2.split())
    assert kernel_build.cpu_flags("") == frozenset()
    assert kernel_build.runnable_targets(cpuinfo(AVX2)) == ["native", "x86-64-v3"]
    assert kernel_build.runnable_targets(cpuinfo(AVX512)) == ["native", "x86-64-v3", "x86-64-v4"]
    assert kernel_build.runnable_targets(cpuinfo("fpu sse2 avx")) == ["native"]  # AVX without AVX2


def test_this_host_is_read_through_the_seam(monkeypatch, tmp_path: Path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo(AVX2))
    monkeypatch.setattr(kernel_build, "CPUINFO", fake)
    assert kernel_build.cpu_flags() == frozenset(AVX2.split())
    assert kernel_build.target_key("native") == "native:" + " ".join(sorted(AVX2.split()))


def test_unknown_target_is_refused(source):
    with pytest.raises(ValueError, match="unknown kernel target"):
        kernel_build.build_library("k", [source], [], ["-shared"], target="avx9")


def test_forced_target_runs_the_engine_on_its_build():
    """cpu_kernels.use_target (what OMNIVOX_TEST_KERNEL_TARGET sets in tests/conftest.py) switches the library every
    kernel call of the engine goes through."""
    from support.kernel_support import KERNEL_TARGETS, target_library

    from omnivox.models import cpu_kernels

    if "x86-64-v3" not in KERNEL_TARGETS:
        pytest.skip("this host cannot run the AVX2 build")
    before = cpu_kernels.active_target()
    avx2 = target_library("x86-64-v3")
    try:
        cpu_kernels.use_target("x86-64-v3")
        assert cpu_kernels.kernel_available() and cpu_kernels._active() is avx2
        assert not cpu_kernels.vnni_available()  # x86-64-v3 has no AVX-512: the many-row VNNI kernel is not built
    finally:
        cpu_kernels.use_target(before)
    assert cpu_kernels.kernel_available() and cpu_kernels._active() is cpu_kernels.library(before)
    with pytest.raises(ValueError, match="unknown kernel target"):
        cpu_kernels.use_target("avx9")
