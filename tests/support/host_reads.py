"""Counting the ways a test's code reads a tensor's value on the host (each one waits for the device on a GPU)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Patch torch.Tensor's host reads to count into the returned dict (by name) until `monkeypatch.undo()`."""
    calls: dict[str, int] = {}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@contextlib.contextmanager
def synchronising_calls(device: torch.device) -> Iterator[list[str]]:
    """Record, into the yielded list, the first line of each warning torch's CUDA sync debug mode gives for a call
    in the block that waits for the GPU (an event wait is not one). The device is synchronised first, so work queued
    before the block cannot be blamed on it; the list is filled when the block ends. CUDA only."""
    found: list[str] = []
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message))
