"""Long audio split at the quietest stretch near each window edge (codecs/audio_split.py)."""

from __future__ import annotations

import numpy as np
import pytest
from support.audio_checkpoints import espeak_wav, noise, tone

from omnivox.codecs.audio_input import AudioLimits, decode_audio
from omnivox.codecs.audio_split import split_at_quiet


def _check_cover(segments, n, max_len):
    assert segments[0][0] == 0 and segments[-1][1] == n
    for (s0, e0), (s1, _) in zip(segments, segments[1:], strict=False):
        assert e0 == s1 and s0 < e0
    assert all(e - s <= max_len for s, e in segments)


def test_short_audio_is_one_segment():
    x = tone(2.0)
    assert split_at_quiet(x, 16000, 30.0) == [(0, 32000)]
    assert split_at_quiet(x, 16000, 2.0) == [(0, 32000)]


def test_cuts_land_in_the_gaps():
    """Loud 7 s blocks with 200 ms of silence between them; windows of 10 s cut inside a gap each time."""
    rate = 16000
    block, gap = tone(7.0, amp=0.5) + noise(7.0, amp=0.05), np.zeros(int(0.2 * rate), np.float32)
    x = np.concatenate([block, gap, block, gap, block, gap, block])
    gaps = [(k * (len(block) + len(gap)) + len(block), (k + 1) * (len(block) + len(gap))) for k in range(3)]
    segments = split_at_quiet(x, rate, 10.0, search_seconds=4.0)
    _check_cover(segments, len(x), 10 * rate)
    assert len(segments) == 4
    for (_, cut), (g0, g1) in zip(segments, gaps, strict=False):
        assert g0 <= cut <= g1


def test_no_quiet_spot_still_respects_the_limit():
    x = noise(65.0, amp=0.3, seed=5)
    segments = split_at_quiet(x, 16000, 30.0)
    _check_cover(segments, len(x), 30 * 16000)
    assert len(segments) == 3 and all(e - s >= 15 * 16000 for s, e in segments[:-1])


def test_silence_prefers_long_windows():
    x = np.zeros(16000 * 70, np.float32)
    segments = split_at_quiet(x, 16000, 30.0)
    _check_cover(segments, len(x), 30 * 16000)
    assert segments[0][1] > 29 * 16000  # ties go to the latest stretch


def test_bad_window():
    with pytest.raises(ValueError):
        split_at_quiet(tone(1.0), 16000, 0.0)


def test_espeak_sentences_split_between_words():
    wav = espeak_wav("One sentence here. " * 6)
    if wav is None:
        pytest.skip("espeak-ng is not installed")
    x = decode_audio(wav, limits=AudioLimits(max_seconds=600)).samples
    segments = split_at_quiet(x, 16000, 3.0, search_seconds=1.0)
    _check_cover(segments, len(x), 3 * 16000)
    for _, cut in segments[:-1]:  # each cut sits in a stretch quieter than the speech around it
        around = x[max(0, cut - 8000) : cut + 8000]
        at = x[max(0, cut - 800) : cut + 800]
        assert np.sqrt(np.mean(at**2)) < 0.5 * np.sqrt(np.mean(around**2))
