"""Headerless audio arriving in chunks (a live stream) -> mono float32 at the model's rate, as it comes.

`StreamingAudioDecoder.feed(bytes)` returns the new samples at the target rate; `flush()` the rest at the end.
Chunks may split a sample (an odd LINEAR16 byte waits for the next chunk). Samples are scaled as
codecs/audio_input.py scales them (LINEAR16 / 32768, MULAW through the G.711 table), and the rate is changed with
the same torchaudio windowed-sinc resampler, run block by block so that the streamed output equals the one-shot
`resample` of the whole stream (within float rounding): see `StreamingResampler`.
"""

from __future__ import annotations

import struct

import numpy as np

from omnivox.codecs.audio_format import AudioEncoding
from omnivox.codecs.audio_input import (
    AudioInputError,
    AudioLimits,
    check_resample,
    detect_container,
    mulaw_to_int16,
)
from omnivox.codecs.resampling import StreamingResampler

STREAM_ENCODINGS = (AudioEncoding.LINEAR16, AudioEncoding.MULAW)


MAGIC_BYTES = 12  # what detect_container reads
MAX_HEADER_BYTES = 1 << 16  # a WAV header (with LIST / bext metadata) is looked for in a stream's first 64 KiB


def _container(data: bytes) -> str | None:
    return None if data[:1] == b"\xff" else detect_container(data[:MAGIC_BYTES])  # raw samples may open 0xFF..


def _wav_data_chunk(data: bytes) -> tuple[int, tuple[int, ...] | None] | None:
    """In a WAV file's first bytes: (where its samples start, its fmt fields or None); None: not within `data`."""
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if kind == b"fmt " and pos + 24 <= len(data):
            fmt = struct.unpack("<HHI", data[pos + 8 : pos + 16]) + struct.unpack("<H", data[pos + 22 : pos + 24])
        if kind == b"data":
            return pos + 8, fmt
        pos += 8 + size + size % 2
    return None


def header_pending(data: bytes) -> bool:
    """Whether a stream's first bytes are too few to tell whether, and where, a file header ends: hold them.

    Clients send a WAV file's first bytes in chunks of any size (an empty first message, 20-byte chunks); looking
    at the first chunk alone missed those headers, and a 44.1 kHz file under a 16 kHz config was decoded as
    16 kHz samples (its events and offsets 2.76x late, its text garbage). Holds at most MAX_HEADER_BYTES, and
    MAGIC_BYTES (6 LINEAR16 samples) of a headerless stream.
    """
    if len(data) >= MAX_HEADER_BYTES:
        return False
    if len(data) < MAGIC_BYTES:
        return data[:1] != b"\xff"
    return _container(data) == "WAV" and _wav_data_chunk(data) is None


def leading_file_header(data: bytes, encoding: AudioEncoding, sample_rate: int) -> int:
    """How many of a stream's first bytes (held while `header_pending`) are a file header to skip (0: none).

    Clients often stream a WAV file's bytes as they are: its 44-byte header decoded as samples is a click, but a
    header saying 44.1 kHz stereo under a 16 kHz mono config means the whole stream is garbled, and FLAC, Ogg or
    MP3 bytes are noise; those raise AudioInputError naming the field to change. A WAV header that does not reach
    its samples within `data` is not skipped (its bytes decode as samples).
    """
    container = _container(data)
    if container is None:
        return 0
    if container != "WAV":
        raise AudioInputError("audio", f"the stream holds {container} audio: send headerless LINEAR16 or MULAW")
    found = _wav_data_chunk(data)
    if found is None:
        return 0
    pos, fmt = found
    if fmt is None:
        return 0
    tag, channels, rate, bits = fmt
    wanted = (1, 16) if encoding is AudioEncoding.LINEAR16 else (7, 8)
    if (tag if tag != 0xFFFE else 1, bits) != wanted or channels != 1:
        raise AudioInputError(
            "audio",
            f"the stream is a WAV file of {channels}-channel {bits}-bit audio (format {tag}); the config says "
            f"mono {encoding.value}: send the samples in that form",
        )
    if rate != sample_rate:
        raise AudioInputError(
            "config.sample_rate_hertz", f"the stream is a WAV file at {rate} Hz; the config says {sample_rate} Hz"
        )
    return pos


class StreamingAudioDecoder:
    """LINEAR16 / MULAW bytes in chunks -> float32 samples at `target_rate`. Bad settings raise AudioInputError."""

    def __init__(
        self,
        encoding: AudioEncoding | None,
        sample_rate: int,
        target_rate: int = 16000,
        limits: AudioLimits = AudioLimits(),
    ) -> None:
        encoding = encoding or AudioEncoding.LINEAR16
        if encoding not in STREAM_ENCODINGS:
            raise AudioInputError(
                "encoding", f"a stream takes headerless LINEAR16 or MULAW audio, not {encoding.value}"
            )
        if not limits.min_sample_rate <= sample_rate <= limits.max_sample_rate:
            raise AudioInputError(
                "sample_rate_hertz",
                f"{sample_rate} Hz is outside [{limits.min_sample_rate}, {limits.max_sample_rate}]",
            )
        check_resample(sample_rate, target_rate, "sample_rate_hertz")
        self.encoding, self.sample_rate, self.target_rate = encoding, sample_rate, target_rate
        self.resampler = StreamingResampler(sample_rate, target_rate)
        self._carry = b""  # an odd LINEAR16 byte
        self.samples_in = 0  # at the source rate

    def feed(self, data: bytes) -> np.ndarray:
        if self.encoding is AudioEncoding.LINEAR16:
            data = self._carry + data
            even = len(data) - len(data) % 2
            self._carry = data[even:]
            pcm = np.frombuffer(data[:even], dtype="<i2")
        else:
            pcm = mulaw_to_int16(np.frombuffer(data, dtype=np.uint8))
        self.samples_in += len(pcm)
        return self.resampler.feed(pcm.astype(np.float32) / 32768.0)

    def flush(self) -> np.ndarray:
        """The rest at the end of the stream (a dangling odd byte is dropped)."""
        self._carry = b""
        return self.resampler.flush()

    @property
    def seconds_in(self) -> float:
        return self.samples_in / self.sample_rate
