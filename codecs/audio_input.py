"""Audio parts on the way in: bytes -> mono float32 samples at the encoder's rate, or a typed error.

Containers are detected from the bytes (magic numbers), whatever `encoding` says: WAV (RIFF/WAVE), FLAC (`fLaC`),
Ogg (`OggS`, Vorbis or Opus) and MP3 (an ID3 tag or an MPEG audio frame sync), all read by libsndfile through
soundfile. Headerless LINEAR16 (signed 16-bit little-endian) and MULAW (G.711) need `sample_rate_hertz`.
Channels are mixed to mono as ffmpeg mixes them (codecs/downmix.py: stereo averaged, a 5.1 file's LFE left out);
the rate is changed with torchaudio's windowed-sinc resampler. A WAV whose data chunk declares more bytes than
arrived is decoded from what arrived, with a warning in the log (as ffmpeg and sox do); one whose data size is 0 (a
writer that could not seek back) is read to its end, as ffmpeg reads it (libsndfile alone reads no samples).

Every problem raises `AudioInputError(field, reason)` (`field` is the AudioPart field: `data`, `encoding` or
`sample_rate_hertz`), which the service answers with INVALID_ARGUMENT. Nothing is cut short: audio over the limit is
refused, never truncated.

`content_key` hashes the DECODED samples (after mono + resample) with the feature settings and the model name, so
the same speech sent as WAV, FLAC or LINEAR16 maps to one encoder-cache entry.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
from dataclasses import dataclass

import numpy as np
import soundfile

from omnivox.codecs.audio_format import AudioEncoding
from omnivox.codecs.downmix import to_mono, wav_facts, with_data_to_the_end
from omnivox.codecs.resampling import (  # re-exported: the audio-in API
    MAX_RESAMPLE_TABLE_BYTES,
    resample,
    resample_table_bytes,
    resampling_rate,
)
from omnivox.codecs.text_payload import decoded_head

log = logging.getLogger(__name__)

HEADERLESS = (AudioEncoding.LINEAR16, AudioEncoding.MULAW)
# Float WAV/FLAC samples past this cannot be integer PCM mis-scaled (int32 read as float reaches 2**31, which the
# log-mel features absorb); by 1e20 the spectrum's power overflows float32 and the model sees infinities: Whisper
# answered "!!!!" (token 0) and audio-LLMs token 0 for any such file.
MAX_SAMPLE_MAGNITUDE = float(2**31)
CONTAINERS = {"WAV", "FLAC", "OGG", "MP3"}
# Which detected container a declared (header-bearing) encoding accepts. OGG_OPUS admits Ogg Vorbis too: the
# proto has one Ogg encoding, and libsndfile reads both.
_DECLARED_CONTAINER = {
    AudioEncoding.WAV: "WAV",
    AudioEncoding.FLAC: "FLAC",
    AudioEncoding.OGG_OPUS: "OGG",
    AudioEncoding.MP3: "MP3",
}


class AudioInputError(ValueError):
    """An audio part we cannot accept. `field` names the AudioPart field (`data`, `encoding`, `sample_rate_hertz`)."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


@dataclass(frozen=True)
class AudioLimits:
    """What an audio part may be. `max_seconds` is the model's limit (Qwen2-Audio: its 30 s window)."""

    max_seconds: float = 30.0
    min_samples: int = 1  # at the target rate; the encoder says how many it needs for one embedding
    max_bytes: int = 64 << 20
    min_sample_rate: int = 4000
    max_sample_rate: int = 192000

    def max_samples(self, rate: int) -> int:
        return math.floor(self.max_seconds * rate + 1e-6)


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 `samples` [N] at `sample_rate`, and where they came from."""

    samples: np.ndarray
    sample_rate: int
    source_format: str  # WAV, FLAC, OGG, MP3, LINEAR16 or MULAW
    source_rate: int
    source_channels: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def detect_container(data: bytes) -> str | None:
    """WAV, FLAC, OGG or MP3 from the first bytes; None when none matches."""
    if len(data) >= 12 and data[:4] in (b"RIFF", b"RIFX", b"RF64") and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    if data[:3] == b"ID3":
        return "MP3"
    # MPEG audio frame header: 11 sync bits, layer != 0, bitrate index != 15 (https://www.mp3-tech.org/).
    if len(data) >= 4 and data[0] == 0xFF and (data[1] & 0xE0) == 0xE0 and (data[1] & 0x06) and (data[2] >> 4) != 15:
        return "MP3"
    return None


def _magic_container(data: bytes) -> str | None:
    """A container named by a magic number that raw samples cannot start with (an MPEG frame sync can: not here).
    Compressed bytes declared LINEAR16 or MULAW were decoded as samples: noise, and a confident wrong transcript."""
    return None if data[:1] == b"\xff" else detect_container(data[:12])


def mulaw_to_int16(codes: np.ndarray) -> np.ndarray:
    """G.711 mu-law -> 16-bit linear (the Sun reference decoder; inverse of audio_format.int16_to_mulaw)."""
    u = (~codes.astype(np.int32)) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _encoding(encoding: AudioEncoding | str | None) -> AudioEncoding | None:
    if encoding in (None, "", "UNSPECIFIED", "AUDIO_ENCODING_UNSPECIFIED"):
        return None
    name = str(encoding).removeprefix("AUDIO_ENCODING_")
    try:
        return AudioEncoding(name)
    except ValueError:
        names = ", ".join(e.value for e in AudioEncoding)
        raise AudioInputError("encoding", f"unknown encoding {encoding!r}; accepted: {names}") from None


def _decode_raw(data: bytes, encoding: AudioEncoding, rate: int, limits: AudioLimits) -> np.ndarray:
    if encoding is AudioEncoding.LINEAR16:
        if len(data) % 2:
            raise AudioInputError("data", f"LINEAR16 audio has an odd number of bytes ({len(data)})")
        pcm = np.frombuffer(data, dtype="<i2")
    else:
        pcm = mulaw_to_int16(np.frombuffer(data, dtype=np.uint8))
    if len(pcm) > limits.max_samples(rate):
        raise _too_long(len(pcm) / rate, limits)
    return (pcm.astype(np.float32) / 32768.0)[:, None]  # as libsndfile scales 16-bit PCM


def _too_long(seconds: float, limits: AudioLimits) -> AudioInputError:
    shown = f"{seconds:.2f}"
    if float(shown) <= limits.max_seconds:  # a few samples over: "30.00 s ... at most 30 s" read as a bug
        shown = f"{seconds:.6f}"
    return AudioInputError("data", f"audio is {shown} s long; this model accepts at most {limits.max_seconds:g} s")


def _decode_container(data: bytes, container: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames = int(f.samplerate), int(f.frames)
            # Refuse long audio before decoding it (a header may understate; checked again after reading).
            if 0 < frames < 2**62 and rate > 0 and frames > limits.max_samples(rate):
                raise _too_long(frames / rate, limits)
            pcm = f.read(dtype="float32", always_2d=True) if f.seekable() else _read_forward(f, rate, limits)
    except AudioInputError:
        raise
    except soundfile.LibsndfileError as e:  # its str() names the BytesIO object's address
        raise AudioInputError("data", f"cannot decode the {container} audio: {e.error_string}") from None
    except (RuntimeError, ValueError, TypeError) as e:
        raise AudioInputError("data", f"cannot decode the {container} audio: {e}") from None
    return pcm, rate


def _read_forward(f: soundfile.SoundFile, rate: int, limits: AudioLimits) -> np.ndarray:
    """[frames, channels] of a file libsndfile reads only forwards (GSM 6.10 in WAV: soundfile's read() of "all"
    refuses it), block by block, refusing it once past the limit."""
    blocks, total = [], 0
    while len(block := f.read(1 << 16, dtype="float32", always_2d=True)):
        blocks.append(block)
        total += len(block)
        if rate > 0 and total > limits.max_samples(rate):
            raise _too_long(total / rate, limits)
    return np.concatenate(blocks) if blocks else np.zeros((0, f.channels), np.float32)


def decode_audio(
    data: bytes,
    encoding: AudioEncoding | str | None = None,
    sample_rate_hertz: int = 0,
    target_rate: int = 16000,
    limits: AudioLimits = AudioLimits(),
) -> DecodedAudio:
    """Decode an audio part to mono float32 at `target_rate`. Raises AudioInputError naming the bad field.

    `encoding` None/UNSPECIFIED means "detect from the bytes"; LINEAR16 / MULAW are headerless and need
    `sample_rate_hertz`; WAV / FLAC / OGG_OPUS must match what the bytes hold. For a container,
    `sample_rate_hertz` is optional but, when set, must equal the header's rate.
    """
    if not data:
        raise AudioInputError("data", "the audio part is empty")
    if len(data) > limits.max_bytes:
        raise AudioInputError("data", f"the audio part is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    enc = _encoding(encoding)
    if sample_rate_hertz and not limits.min_sample_rate <= sample_rate_hertz <= limits.max_sample_rate:
        raise AudioInputError(
            "sample_rate_hertz",
            f"{sample_rate_hertz} Hz is outside [{limits.min_sample_rate}, {limits.max_sample_rate}]",
        )
    if enc in HEADERLESS and _magic_container(data) == "WAV":
        enc = None  # a WAV file declared LINEAR16 (as Google's API takes it): its header says what it holds
    elif enc in HEADERLESS and _magic_container(data):
        raise AudioInputError(
            "encoding",
            f"encoding is {enc.value} (headerless samples) but the bytes hold {_magic_container(data)} audio: "
            "leave encoding unset",
        )
    facts = None  # a WAV header's channel mask and sizes
    if enc in HEADERLESS:
        if not sample_rate_hertz:
            raise AudioInputError("sample_rate_hertz", f"{enc.value} audio has no header: the sample rate is required")
        pcm, rate, source = _decode_raw(data, enc, sample_rate_hertz, limits), sample_rate_hertz, enc.value
    else:
        source = detect_container(data)
        if source is None:
            as_text = decoded_head(data)
            if as_text is not None and detect_container(as_text[1]):
                raise AudioInputError(
                    "data",
                    f"the bytes are {as_text[0]} of {detect_container(as_text[1])} audio, not the audio: send the "
                    "file's raw bytes (JSON clients base64-encode them once themselves)",
                )
            raise AudioInputError(
                "data", "unrecognised audio: not WAV, FLAC, Ogg or MP3 (set encoding for raw LINEAR16 or MULAW)"
            )
        if enc is not None and _DECLARED_CONTAINER[enc] != source:
            raise AudioInputError("encoding", f"encoding is {enc.value} but the bytes hold {source} audio")
        facts = wav_facts(data) if source == "WAV" else None
        pcm, rate = _decode_container(with_data_to_the_end(data, facts) if facts else data, source, limits)
        if sample_rate_hertz and sample_rate_hertz != rate:
            raise AudioInputError(
                "sample_rate_hertz", f"sample_rate_hertz={sample_rate_hertz} but the {source} header says {rate} Hz"
            )
        if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
            raise AudioInputError("data", f"the {source} audio's rate {rate} Hz is not supported")
    if pcm.shape[0] == 0:
        raise AudioInputError("data", "the audio holds no samples")
    if pcm.shape[0] > limits.max_samples(rate):
        raise _too_long(pcm.shape[0] / rate, limits)
    if not np.isfinite(pcm).all():
        raise AudioInputError("data", "the audio holds non-finite samples (NaN or infinity)")
    peak = float(np.abs(pcm).max())
    if peak > MAX_SAMPLE_MAGNITUDE:
        raise AudioInputError(
            "data", f"the audio's samples reach {peak:.3g}; float audio is expected within [-1, 1] (its scale is wrong)"
        )
    channels = pcm.shape[1]
    if facts is not None and facts.missing_bytes:
        # As ffmpeg, sox and libsndfile do, the samples that arrived are used; the cut is logged (a client's upload
        # that stopped early), not refused: recorders that died mid-file leave such headers too.
        log.warning(
            "a WAV audio part is truncated: its header declares %d bytes of samples, %d arrived; using "
            "the %.2f s that did", facts.declared, facts.available, pcm.shape[0] / rate,
        )  # fmt: skip
    check_resample(rate, target_rate, "sample_rate_hertz" if enc in HEADERLESS else "data")
    mono = to_mono(pcm, source, facts.channel_mask if facts is not None else None)
    samples = resample(mono, rate, target_rate)
    if len(samples) > limits.max_samples(target_rate):
        raise _too_long(len(samples) / target_rate, limits)
    if len(samples) < limits.min_samples:
        raise AudioInputError(
            "data", f"the audio is {len(samples)} samples at {target_rate} Hz; this model needs {limits.min_samples}"
        )
    return DecodedAudio(np.ascontiguousarray(samples, np.float32), target_rate, source, rate, channels)


def check_resample(orig_rate: int, new_rate: int, field: str) -> None:
    """AudioInputError naming `field` when orig_rate -> new_rate would need too large a resampling table, even at
    the nearest rate within MAX_RATE_APPROXIMATION."""
    if resample_table_bytes(resampling_rate(orig_rate, new_rate), new_rate) > MAX_RESAMPLE_TABLE_BYTES:
        raise AudioInputError(
            field,
            f"{orig_rate} Hz cannot be resampled to {new_rate} Hz here (the rates share no large factor); send "
            "audio at a common rate (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 96000 Hz)",
        )


def content_key(samples: np.ndarray, sample_rate: int, feature_settings: str, model: str) -> str:
    """sha256 hex of the decoded float32 samples, their rate, the feature settings and the model name."""
    h = hashlib.sha256()
    for part in ("omnivox-audio-v1", model, feature_settings, str(sample_rate), str(len(samples))):
        h.update(part.encode())
        h.update(b"\0")
    h.update(np.ascontiguousarray(samples, dtype="<f4").tobytes())
    return h.hexdigest()
