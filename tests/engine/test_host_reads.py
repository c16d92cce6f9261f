"""The test helpers of tests/support/host_reads.py themselves, on the CPU: the sync recorder keeps only torch's sync-debug
warnings, leaves the debug mode at "default" even when the block raises, and the read counter counts what it should."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.host_reads import count_host_reads, synchronising_calls

SYNC = "called a synchronizing CUDA operation"  # torch's TORCH_WARN text in sync debug mode "warn"


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """torch.cuda's synchronize / set_sync_debug_mode record their calls instead (no CUDA driver here)."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: calls.append(("mode", mode)))
    return calls


def test_synchronising_calls_keeps_only_sync_warnings(cuda_calls) -> None:
    dev = torch.device("cuda:1")
    with synchronising_calls(dev) as syncs:
        warnings.warn(SYNC + "\nsecond line of the warning", UserWarning, stacklevel=1)
        warnings.warn("some other warning", UserWarning, stacklevel=1)
        warnings.warn(SYNC, UserWarning, stacklevel=1)  # the same warning twice is two calls (filter "always")
        assert syncs == []  # filled when the block ends
    assert syncs == [SYNC, SYNC]
    assert cuda_calls == [("synchronize", dev), ("mode", "warn"), ("mode", "default")]


def test_synchronising_calls_resets_the_mode_when_the_block_raises(cuda_calls) -> None:
    with pytest.raises(ValueError), synchronising_calls(torch.device("cuda")):
        raise ValueError("boom")
    assert cuda_calls[-1] == ("mode", "default")


def test_count_host_reads_counts_each_read(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.tensor([1, 2])
    calls = count_host_reads(monkeypatch)
    t.tolist()
    t[0].item()
    int(t[1])
    assert calls == {"tolist": 1, "item": 1, "__int__": 1}
    monkeypatch.undo()
    t.tolist()
    assert calls == {"tolist": 1, "item": 1, "__int__": 1}
