"""Shared pytest fixtures, and the suite's time by subject folder at the end of a run."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model's .gguf (SmolLM2-135M-Instruct, Q4_1), fetched once into the stable cache.

    The cache is `$OMNIVOX_CACHE`, else `~/.cache/omnivox`, so one download serves the whole run (and later runs).
    """
    from omnivox.services.parts.defaults import ensure_default_model

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


# Issue 26: where the suite's time goes, by subject folder, printed after every run (setup + call + teardown of each
# test; collection and start-up are the rest of the wall time), so a slow host's run says what to trim.
_FOLDER_SECONDS: collections.Counter[str] = collections.Counter()
_FOLDER_TESTS: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("::")[0].split("/")
    folder = "/".join(parts[1:3] if len(parts) > 3 else parts[1:2])
    _FOLDER_SECONDS[folder] += report.duration
    if report.when == "call":
        _FOLDER_TESTS[folder] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FOLDER_SECONDS or sum(_FOLDER_TESTS.values()) < 50:
        return
    terminalreporter.section("time by subject folder (setup + call + teardown)")
    for folder, seconds in _FOLDER_SECONDS.most_common():
        terminalreporter.write_line(f"{seconds:8.1f} s  {_FOLDER_TESTS[folder]:5d} tests  tests/{folder}")
    terminalreporter.write_line(f"{sum(_FOLDER_SECONDS.values()):8.1f} s  in tests")
