"""Shared helpers of the C-kernel tests: the build targets this host can run, and the checks that a kernel which a
compiler could build did build (a broken kernel must fail, not pass as "skipped")."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from omnivox.models import cpu_kernels
from omnivox.native.kernel_build import runnable_targets

# Every instruction set this host can run (an AVX-512 host runs the AVX2 build too), so that each kernel path a
# user's CPU can take is tested on whatever machine CI has.
KERNEL_TARGETS = runnable_targets()


def require_kernels() -> None:
    """Skip without a C compiler (only the portable path exists); fail when one exists and the kernels did not build."""
    if cpu_kernels.kernel_available():
        return
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler: only the portable path exists")
    pytest.fail(f"a C compiler exists but the CPU kernels are unavailable: {cpu_kernels.build_failure()}")


def target_library(target: str) -> ctypes.CDLL:
    """The kernels built for `target` (one of KERNEL_TARGETS), skipping only where there is no compiler."""
    lib = cpu_kernels.library(target)
    if lib is not None:
        return lib
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler: only the portable path exists")
    pytest.fail(f"a C compiler exists but the {target} kernels are unavailable: {cpu_kernels.build_failure(target)}")


@pytest.fixture(params=KERNEL_TARGETS)
def kernel_target(request) -> Iterator[str]:
    """Run the test with the whole in-process engine on the kernels of each runnable target, then restore."""
    before = cpu_kernels.active_target()
    target_library(request.param)
    cpu_kernels.use_target(request.param)
    try:
        yield request.param
    finally:
        cpu_kernels.use_target(before)
