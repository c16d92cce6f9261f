"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model's .gguf (SmolLM2-135M-Instruct, Q4_1), fetched once into the stable cache.

    The cache is `$OMNIVOX_CACHE`, else `~/.cache/omnivox`, so one download serves the whole run (and later runs).
    """
    from omnivox.services.defaults import ensure_default_model

    return ensure_default_model(progress=False)


def pytest_configure(config: pytest.Config) -> None:
    """One torch compute thread for every in-process engine.

    torch defaults to one thread per core; on the 2-core test machines an in-process server's two compute threads
    contend with the gRPC thread and the test's client threads, and an aborted request then took over a second to
    free its KV blocks (one engine step stalled behind the others). `omnivox serve` sets its own count (--threads).
    """
    import torch

    torch.set_num_threads(1)
    _force_kernel_target()


def _force_kernel_target() -> None:
    """`OMNIVOX_TEST_KERNEL_TARGET=x86-64-v3 make test` runs every in-process engine on the AVX2 + FMA kernel build
    (native/kernel_build.py TARGETS) instead of the host's native one: an AVX-512 host then tests what AVX2-only
    users run. Read here only, never by the product; servers started as subprocesses keep their native build."""
    import os

    target = os.environ.get("OMNIVOX_TEST_KERNEL_TARGET")
    if not target:
        return
    from omnivox.models import cpu_kernels
    from omnivox.native.kernel_build import TARGETS, runnable_targets

    if target not in TARGETS or target not in runnable_targets():
        raise pytest.UsageError(f"OMNIVOX_TEST_KERNEL_TARGET={target}: this host runs {runnable_targets()}")
    cpu_kernels.use_target(target)
