"""Waiting on a condition another thread makes true (a stream closing, a drain starting), with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.005) -> bool:
    """Poll `condition` until it is true; fail the test when `timeout` seconds pass first. Returns True."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(interval)
    return True
