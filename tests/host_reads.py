"""Counting the ways a test's code reads a tensor's value on the host (each one waits for the device on a GPU)."""

from __future__ import annotations

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
