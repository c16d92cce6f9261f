"""G.711 A-law (ITU-T G.711, the European telephone companding): 8-bit codes <-> 16-bit linear PCM. Mu-law lives with
the other formats (codecs/audio_input.py, codecs/audio_format.py); A-law is only spoken by the realtime WebSocket
(`audio/pcma`), so it is its own small module. Codes are transmitted with every even bit inverted (XOR 0x55)."""

from __future__ import annotations

import numpy as np


def alaw_to_int16(codes: np.ndarray) -> np.ndarray:
    """uint8 A-law codes [N] -> int16 PCM [N] (the centre of each code's interval, as G.711's tables)."""
    a = codes.astype(np.int32) ^ 0x55
    exponent, mantissa = (a >> 4) & 0x07, a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(a & 0x80, magnitude, -magnitude).astype(np.int16)


def int16_to_alaw(pcm: np.ndarray) -> np.ndarray:
    """int16 PCM [N] -> uint8 A-law codes [N]: 13-bit magnitude, segment = position of its top bit (0 and 1 share a
    step of 2), 4 mantissa bits below it."""
    x = pcm.astype(np.int32)
    sign = np.where(x >= 0, 0x80, 0x00)
    magnitude = np.minimum(np.abs(x), 32767) >> 3  # 0..4095
    exponent = np.zeros_like(magnitude)
    for e in range(1, 8):
        exponent = np.where(magnitude >= (16 << e), e, exponent)
    mantissa = np.where(exponent == 0, magnitude >> 1, (magnitude >> exponent) & 0x0F)
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)
