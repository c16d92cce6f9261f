"""Audio output formats, encoded incrementally: float PCM chunks in, byte chunks out.

Concatenating every chunk an `AudioStreamEncoder` returns (then `finish()`) gives a complete stream of the encoding:
- LINEAR16: raw signed 16-bit little-endian PCM, mono, no header;
- MULAW: raw 8-bit G.711 mu-law, no header;
- WAV: a RIFF header whose sizes say "as long as the file" (0xFFFFFFFF, the usual streaming WAV), then 16-bit PCM;
- OGG_OPUS: libsndfile (through soundfile) writing to a forward-only sink; Ogg pages are flushed every ~20 ms of
  audio, so chunks leave as they are produced.
- FLAC: libsndfile as well, but held until `finish()`: FLAC's STREAMINFO header carries the total length, which
  libsndfile patches at close. A FLAC stream sent before that says "length unknown" (legal FLAC), and libsndfile
  (soundfile) then fails to read it (it reports 2^63 frames and cannot seek). So FLAC arrives as one chunk at the end;
  use OGG_OPUS, WAV, LINEAR16 or MULAW for low time-to-first-audio.
- MP3: libsndfile's LAME encoder at a constant bitrate (compression level 0.5: ~83 kb/s at 24 kHz), frames leaving as
  they are encoded. libsndfile writes a placeholder first frame and fills it with the Xing/LAME tag (frame count,
  encoder delay) at close; a stream has sent that frame long before, so the tag is dropped (the forward-only sink)
  and the first frame stays a silent one. Players and decoders stream such a file to its end; what they cannot know
  without the tag is its length up front (libsndfile estimates it from the bitrate, which is why the bitrate is
  constant: a variable-bitrate stream without the tag read back as 14184 of 48000 samples) and the encoder's
  ~1100-sample delay (gapless playback).
Resampling from the codec's rate uses torchaudio's windowed-sinc resampler applied to overlapping segments, so that a
stream resampled chunk by chunk equals the whole signal resampled at once.
"""

from __future__ import annotations

import struct
from enum import StrEnum

import numpy as np
import soundfile

from omnivox.codecs.resampling import StreamingResampler


class AudioEncoding(StrEnum):
    LINEAR16 = "LINEAR16"
    WAV = "WAV"
    FLAC = "FLAC"
    OGG_OPUS = "OGG_OPUS"
    MULAW = "MULAW"
    MP3 = "MP3"


SUPPORTED_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)  # what the Opus encoder accepts
OGG_PAGE_LATENCY_MS = 20.0
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # libsndfile sf_command (sndfile.h)
MP3_COMPRESSION_LEVEL = 0.5  # libsndfile's 0 (best) .. 1: at a constant bitrate ~83 kb/s at 24 kHz, 165 at 48 kHz


class AudioFormatError(ValueError):
    """An output format the encoders cannot produce; `field` names the offending setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


def check_output_format(encoding: AudioEncoding | str, sample_rate: int) -> tuple[AudioEncoding, int]:
    """Validate an (encoding, sample rate) pair; returns them normalised. Raises AudioFormatError."""
    try:
        encoding = AudioEncoding(encoding)
    except ValueError:
        names = ", ".join(e.value for e in AudioEncoding)
        raise AudioFormatError("encoding", f"unsupported encoding {encoding!r}; supported: {names}") from None
    if not isinstance(sample_rate, int) or sample_rate not in SUPPORTED_SAMPLE_RATES:
        raise AudioFormatError(
            "sample_rate_hertz", f"unsupported sample rate {sample_rate!r}; supported: {list(SUPPORTED_SAMPLE_RATES)}"
        )
    if encoding is AudioEncoding.OGG_OPUS and sample_rate not in OPUS_SAMPLE_RATES:
        raise AudioFormatError(
            "sample_rate_hertz", f"OGG_OPUS supports {list(OPUS_SAMPLE_RATES)} Hz, not {sample_rate}"
        )
    return encoding, sample_rate


# --- sample conversions ----------------------------------------------------------------------------------------------
def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


_MULAW_SEGMENT_ENDS = (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF)


def int16_to_mulaw(samples: np.ndarray) -> np.ndarray:
    """G.711 mu-law (the Sun reference algorithm, as in audioop/sox): 16-bit linear -> 8-bit codes."""
    v = samples.astype(np.int32) >> 2  # 14-bit
    negative = v < 0
    v = np.minimum(np.where(negative, -v, v), 8159) + 0x21
    mask = np.where(negative, 0x7F, 0xFF)
    segment = sum((v > end).astype(np.int32) for end in _MULAW_SEGMENT_ENDS)  # 0..8
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((v >> (np.minimum(segment, 7) + 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8)


def wav_stream_header(sample_rate: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV header for a stream of unknown length (RIFF and data sizes set to the maximum)."""
    data_size = 0xFFFFFFFF - 36
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + data_size,
        b"WAVE",
        b"fmt ",
        16,
        1,  # PCM
        channels,
        sample_rate,
        sample_rate * channels * 2,
        channels * 2,
        16,
        b"data",
        data_size,
    )


# --- container encoders ----------------------------------------------------------------------------------------------
class _ForwardOnlySink:
    """A write-only file object for libsndfile that hands out appended bytes and drops rewrites of bytes handed out."""

    def __init__(self) -> None:
        self._pending = bytearray()  # bytes [self._taken, self._taken + len(self._pending))
        self._taken = 0
        self._pos = 0

    def write(self, data: bytes) -> int:
        data = bytes(data)
        start, end = self._pos, self._pos + len(data)
        self._pos = end
        lo = max(start, self._taken)  # bytes before _taken were sent already: their rewrite is dropped
        if end > lo:
            rel_lo, rel_hi = lo - self._taken, end - self._taken
            if rel_hi > len(self._pending):
                self._pending.extend(b"\0" * (rel_hi - len(self._pending)))
            self._pending[rel_lo:rel_hi] = data[lo - start :]
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self._taken + len(self._pending)
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""

    def take(self) -> bytes:
        out = bytes(self._pending)
        self._taken += len(out)
        self._pending.clear()
        return out


class _SoundFileEncoder:
    def __init__(self, fmt: str, subtype: str, sample_rate: int, hold_until_close: bool = False) -> None:
        self._hold = hold_until_close
        self._sink = _ForwardOnlySink()
        # MP3: constant bitrate, so that a stream without its length tag reads back whole (module docstring)
        mp3 = {"bitrate_mode": "CONSTANT", "compression_level": MP3_COMPRESSION_LEVEL} if fmt == "MP3" else {}
        self._file = soundfile.SoundFile(
            self._sink, mode="w", samplerate=sample_rate, channels=1, format=fmt, subtype=subtype, **mp3
        )
        if fmt == "OGG":
            latency = soundfile._ffi.new("double*", OGG_PAGE_LATENCY_MS)
            soundfile._snd.sf_command(
                self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, soundfile._ffi.sizeof("double")
            )

    def encode(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            self._file.write(np.clip(pcm, -1.0, 1.0).astype(np.float32))
            if not self._hold:
                self._file.flush()
        return b"" if self._hold else self._sink.take()

    def finish(self) -> bytes:
        self._file.close()
        return self._sink.take()


class AudioStreamEncoder:
    """Float PCM at `source_rate` in, encoded bytes at `sample_rate` out, chunk by chunk."""

    def __init__(self, encoding: AudioEncoding | str, sample_rate: int, source_rate: int = 24000) -> None:
        self.encoding, self.sample_rate = check_output_format(encoding, sample_rate)
        self.source_rate = source_rate
        self._resampler = StreamingResampler(source_rate, self.sample_rate)
        self._finished = False
        self.samples_out = 0  # at sample_rate
        self._started = False
        self._container: _SoundFileEncoder | None = None
        if self.encoding is AudioEncoding.FLAC:
            self._container = _SoundFileEncoder("FLAC", "PCM_16", self.sample_rate, hold_until_close=True)
        elif self.encoding is AudioEncoding.OGG_OPUS:
            self._container = _SoundFileEncoder("OGG", "OPUS", self.sample_rate)
        elif self.encoding is AudioEncoding.MP3:
            self._container = _SoundFileEncoder("MP3", "MPEG_LAYER_III", self.sample_rate)

    @property
    def channels(self) -> int:
        return 1

    @property
    def streams_incrementally(self) -> bool:
        """False for FLAC, whose bytes all come from finish()."""
        return self.encoding is not AudioEncoding.FLAC

    def _encode_resampled(self, pcm: np.ndarray) -> bytes:
        self.samples_out += len(pcm)
        head = b""
        if not self._started:
            self._started = True
            if self.encoding is AudioEncoding.WAV:
                head = wav_stream_header(self.sample_rate)
        if self._container is not None:
            return head + self._container.encode(pcm)
        if self.encoding is AudioEncoding.MULAW:
            return head + int16_to_mulaw(float_to_int16(pcm)).tobytes()
        return head + float_to_int16(pcm).tobytes()  # LINEAR16, WAV

    def encode(self, pcm: np.ndarray) -> bytes:
        """Encode a chunk of float PCM in [-1, 1] at `source_rate`; may return b"" while the encoder buffers."""
        if self._finished:
            raise RuntimeError("encode after finish")
        return self._encode_resampled(self._resampler.feed(np.asarray(pcm, dtype=np.float32)))

    def finish(self) -> bytes:
        """The rest of the stream (resampler tail, container trailer). The encoder is closed afterwards."""
        if self._finished:
            return b""
        out = self._encode_resampled(self._resampler.flush())
        self._finished = True
        if self._container is not None:
            out += self._container.finish()
        return out

    def close(self) -> None:
        """Release the encoder without finishing the stream (e.g. the request was cancelled)."""
        if not self._finished:
            self._finished = True
            if self._container is not None:
                self._container._file.close()
