"""Changing a signal's rate: torchaudio's windowed-sinc resampler (its defaults), one shot or over a stream.

`resample` changes a whole signal's rate; `StreamingResampler` does it chunk by chunk with output equal to `resample`
of the whole stream (within float rounding): audio in (codecs/audio_input.py, codecs/audio_stream_input.py) and speech
out (codecs/audio_format.py) share them. A rate sharing no large factor with the target is resampled as a nearby rate
(`resampling_rate`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torchaudio.functional as AF
import torchaudio.transforms as AT

LOWPASS_FILTER_WIDTH, ROLLOFF = 6, 0.99  # torchaudio's resample defaults

# torchaudio's sinc resampler builds a table of new/g x (orig/g + 2 x width) float32 weights (g: the rates' gcd). For
# the usual rates it is small (44100 -> 16000: 160 x 475, 0.3 MB), but a rate with no common factor makes it huge: a
# client's sample_rate_hertz of 44101 built a 2.8 GB table in 95 s (12 GB resident) for every clip, and for every chunk
# of a stream. Such a rate is resampled as the nearest rate within 0.1 % whose table fits (`resampling_rate`), as
# ffmpeg's resampler approximates an awkward ratio by a bank of at most 1024 filter phases: 44101 Hz goes as 44100 Hz,
# a 2e-5 stretch of time (72 ms an hour) and of pitch (0.04 cents), which no recogniser hears.
MAX_RESAMPLE_TABLE_BYTES = 64 << 20
MAX_RATE_APPROXIMATION = 1e-3  # relative


def resample_table_bytes(orig_rate: int, new_rate: int) -> int:
    """Bytes of the weight table torchaudio's resampler builds for orig_rate -> new_rate (0: the same rate)."""
    if orig_rate == new_rate:
        return 0
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / (min(orig, new) * ROLLOFF))
    return new * (orig + 2 * width) * 4


def resampling_rate(orig_rate: int, new_rate: int) -> int:
    """The rate audio at orig_rate is resampled as: orig_rate itself when its table fits, else the nearest rate within
    MAX_RATE_APPROXIMATION whose table does (orig_rate when none does: check_resample then refuses it)."""
    if resample_table_bytes(orig_rate, new_rate) <= MAX_RESAMPLE_TABLE_BYTES:
        return orig_rate
    for d in range(1, int(orig_rate * MAX_RATE_APPROXIMATION) + 1):
        for rate in (orig_rate - d, orig_rate + d):
            if resample_table_bytes(rate, new_rate) <= MAX_RESAMPLE_TABLE_BYTES:
                return rate
    return orig_rate


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """torchaudio's windowed-sinc resampler (its defaults), from `resampling_rate`; the same rate returns the input."""
    if orig_rate == new_rate:
        return samples
    orig_rate = resampling_rate(orig_rate, new_rate)
    return AF.resample(torch.from_numpy(np.ascontiguousarray(samples)), orig_rate, new_rate).numpy()


class StreamingResampler:
    """torchaudio's sinc resampler over a stream, exact block by block.

    With both rates divided by their gcd (orig, new), torchaudio's resample produces output block k (`new` samples)
    from the inputs [k*orig - width, (k+1)*orig + width), zero beyond the ends. So block k is final once those inputs
    have arrived; it is computed by resampling a stretch that starts `ceil(width / orig)` blocks earlier (whose first
    blocks see a zero-padded edge and are dropped), or at sample 0, where the one-shot pads with zeros too.
    """

    def __init__(self, orig_rate: int, new_rate: int) -> None:
        orig_rate = resampling_rate(orig_rate, new_rate)  # as the one-shot resample: an awkward rate approximated
        g = math.gcd(orig_rate, new_rate)
        self.orig_rate, self.new_rate = orig_rate, new_rate
        self.orig, self.new = orig_rate // g, new_rate // g
        self.width = math.ceil(LOWPASS_FILTER_WIDTH * self.orig / (min(self.orig, self.new) * ROLLOFF))
        self.context_blocks = math.ceil(self.width / self.orig)
        # The sinc kernel made once (torchaudio's Resample module keeps it; functional.resample made it again on
        # every call): a 20 ms chunk at 11025 Hz took 3.24 ms to resample, 0.48 ms now (22050 Hz: 2.90 -> 0.62,
        # 44100 Hz: 1.76 -> 0.55; medians of 5 alternating runs on 2 s of audio, one thread).
        self._resample = (
            AT.Resample(
                orig_rate, new_rate, lowpass_filter_width=LOWPASS_FILTER_WIDTH, rolloff=ROLLOFF, dtype=torch.float32
            )
            if self.orig != self.new
            else None
        )
        self._buffer = np.zeros(0, np.float32)  # inputs from sample `_buffer_start` on
        self._buffer_start = 0  # a multiple of `orig`
        self._received = 0
        self._next_block = 0  # the first block not yet returned

    def _resample_from(self, first_block: int, last_block: int | None) -> np.ndarray:
        """Blocks [first_block, last_block) (None: to the end of what arrived, zero-padded) of the whole output."""
        start_block = max(0, first_block - self.context_blocks)
        a = start_block * self.orig - self._buffer_start
        stretch = torch.from_numpy(np.ascontiguousarray(self._buffer[a:]))
        assert self._resample is not None
        with torch.inference_mode():
            out = self._resample(stretch).numpy()
        lo = (first_block - start_block) * self.new
        hi = None if last_block is None else (last_block - start_block) * self.new
        return out[lo:hi]

    def feed(self, samples: np.ndarray) -> np.ndarray:
        if self.orig == self.new:
            return samples
        self._buffer = np.concatenate([self._buffer, samples.astype(np.float32, copy=False)])
        self._received += len(samples)
        complete = (self._received - self.width) // self.orig  # blocks whose inputs have all arrived
        if complete <= self._next_block:
            return np.zeros(0, np.float32)
        out = self._resample_from(self._next_block, complete)
        self._next_block = complete
        keep = max(0, complete - self.context_blocks) * self.orig  # inputs the next blocks may still need
        self._buffer = self._buffer[keep - self._buffer_start :]
        self._buffer_start = keep
        return out

    def flush(self) -> np.ndarray:
        """The remaining output, the stream's end zero-padded as the one-shot resample pads it."""
        if self.orig == self.new or self._received == 0:
            return np.zeros(0, np.float32)
        total = math.ceil(self.new * self._received / self.orig)
        out = self._resample_from(self._next_block, None)[: max(0, total - self._next_block * self.new)]
        self._next_block = math.ceil(total / self.new)
        return out
