"""Skip helpers for tests of the C kernels: they need a C compiler on the host."""

from __future__ import annotations

import pytest

from omnivox.models import cpu_kernels


def require_kernels() -> None:
    """Skip without a C compiler (only the portable path exists); fail when one exists and the kernels did not build."""
    if cpu_kernels.kernel_available():
        return
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler: only the portable path exists")
    pytest.fail(f"a C compiler exists but the CPU kernels are unavailable: {cpu_kernels.build_failure()}")
