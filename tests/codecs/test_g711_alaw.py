"""G.711 A-law (codecs/g711_alaw.py): every code decodes and encodes back to itself, and the companding error stays
within each segment's half step (the standard's tables: 2..64 in 13-bit units, x8 at 16 bits)."""

from __future__ import annotations

import numpy as np

from omnivox.codecs.g711_alaw import alaw_to_int16, int16_to_alaw


def test_every_code_round_trips() -> None:
    codes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(int16_to_alaw(alaw_to_int16(codes)), codes)


def test_companding_error_within_half_a_step() -> None:
    pcm = np.arange(-32768, 32768, 3, dtype=np.int64)
    back = alaw_to_int16(int16_to_alaw(pcm.astype(np.int16))).astype(np.int64)
    magnitude = np.minimum(np.abs(pcm), 32767) >> 3
    step = np.where(magnitude < 32, 2, 2 ** np.floor(np.log2(np.maximum(magnitude, 1)) - 3)) * 8  # at 16 bits
    assert np.all(np.abs(back - pcm) <= step / 2 + 8)
    assert np.all(np.sign(back[np.abs(pcm) > 16]) == np.sign(pcm[np.abs(pcm) > 16]))


def test_known_values() -> None:
    """G.711's A-law of 0 is 0xD5 (0x80 | 0 XOR 0x55), of full scale 0xAA / 0x2A."""
    assert int16_to_alaw(np.array([0, 32767, -32768], np.int16)).tolist() == [0xD5, 0xAA, 0x2A]
