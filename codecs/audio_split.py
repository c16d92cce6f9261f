"""Splitting long audio into windows a model accepts, cutting where it is quietest.

A transcription of audio longer than the model's window is done window by window. Cutting at a fixed 30 s splits a
word in two about as often as not; instead each cut goes to the middle of the quietest `quiet_ms` stretch within the
last `search_seconds` before the window's edge (lowest mean energy, the latest on ties, so windows stay long).
Segments therefore never exceed `max_seconds`, cover the audio exactly once, and come with their offsets.
"""

from __future__ import annotations

import numpy as np

DEFAULT_QUIET_MS = 100.0
DEFAULT_SEARCH_SECONDS = 5.0


def split_at_quiet(
    samples: np.ndarray,
    sample_rate: int,
    max_seconds: float,
    search_seconds: float = DEFAULT_SEARCH_SECONDS,
    quiet_ms: float = DEFAULT_QUIET_MS,
) -> list[tuple[int, int]]:
    """`[(start, end), ...]` sample ranges, each at most `max_seconds` long, covering `samples` in order.

    Audio within the limit comes back as one segment. `search_seconds` is clamped to half a window, so every
    segment is at least half a window long (except the last).
    """
    n = len(samples)
    max_len = int(max_seconds * sample_rate)
    if max_len <= 0:
        raise ValueError(f"max_seconds={max_seconds} gives an empty window")
    quiet = max(1, int(quiet_ms * sample_rate / 1000))
    search = min(int(search_seconds * sample_rate), max_len // 2)
    # Energy of every quiet-length stretch through one cumulative sum: energy[i] = sum(x[i : i + quiet] ** 2).
    power = np.concatenate([[0.0], np.cumsum(np.asarray(samples, dtype=np.float64) ** 2)])
    segments: list[tuple[int, int]] = []
    start = 0
    while n - start > max_len:
        edge = start + max_len
        lo = max(start + 1, edge - search)  # stretches [i, i + quiet) with lo <= i and i + quiet <= edge
        hi = edge - quiet
        if hi < lo:  # the window is shorter than a quiet stretch: cut at the edge
            cut = edge
        else:
            energy = power[lo + quiet : hi + quiet + 1] - power[lo : hi + 1]
            best = hi - int(np.argmin(energy[::-1]))  # the latest of the quietest
            cut = best + quiet // 2
        segments.append((start, cut))
        start = cut
    segments.append((start, n))
    return segments
