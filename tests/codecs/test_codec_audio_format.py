"""Audio encodings: chunked output concatenates to a stream that decodes to the right rate, duration and content."""

from __future__ import annotations

import io
import struct
import warnings

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF
from support.audio_checks import aligned_correlation, chirp

from omnivox.codecs.audio_format import (
    AudioEncoding,
    AudioFormatError,
    AudioStreamEncoder,
    check_output_format,
    float_to_int16,
    int16_to_mulaw,
)
from omnivox.codecs.resampling import StreamingResampler


def tone(seconds: float = 1.3, rate: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(0)
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def encode_in_chunks(encoder: AudioStreamEncoder, pcm: np.ndarray, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    chunks, i = [], 0
    while i < len(pcm):
        n = int(rng.integers(1, 5000))
        chunks.append(encoder.encode(pcm[i : i + n]))
        i += n
    chunks.append(encoder.finish())
    return chunks


def _resampled_in_chunks(pcm: np.ndarray, rate: int, seed: int | None) -> bytes:
    """The 24 kHz `pcm` at `rate` through a StreamingResampler fed in encode_in_chunks' chunks (seed None: whole)."""
    resampler, parts, i = StreamingResampler(24000, rate), [], 0
    rng = None if seed is None else np.random.default_rng(seed)
    while i < len(pcm):
        n = len(pcm) if rng is None else int(rng.integers(1, 5000))
        parts.append(resampler.feed(pcm[i : i + n]))
        i += n
    return np.concatenate([*parts, resampler.flush()]).tobytes()


def read_back(data: bytes, encoding: AudioEncoding, rate: int) -> tuple[np.ndarray, int]:
    if encoding is AudioEncoding.LINEAR16:
        return sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=rate, channels=1, endian="LITTLE")
    if encoding is AudioEncoding.MULAW:
        return sf.read(io.BytesIO(data), format="RAW", subtype="ULAW", samplerate=rate, channels=1)
    return sf.read(io.BytesIO(data))


@pytest.mark.parametrize("rate", [24000, 16000])
@pytest.mark.parametrize("encoding", list(AudioEncoding))
def test_every_encoding_decodes_to_rate_and_duration(encoding, rate):
    pcm = chirp()
    encoder = AudioStreamEncoder(encoding, rate, source_rate=24000)
    chunks = encode_in_chunks(encoder, pcm)
    audio, got_rate = read_back(b"".join(chunks), encoding, rate)
    assert got_rate == rate
    expected = AF.resample(torch.from_numpy(pcm), 24000, rate).numpy() if rate != 24000 else pcm
    if encoding is AudioEncoding.MP3:  # lossy, and led by the encoder's delay (no LAME tag in a stream to trim it)
        assert round(1.3 * rate) == encoder.samples_out <= len(audio) <= encoder.samples_out + 3 * 1152, len(audio)
        # the chirp sweeps to Nyquist and LAME low-passes it near the top (0.933 measured at 24 kHz)
        assert aligned_correlation(audio, expected, max_lag=2400) > 0.9
        assert sum(len(c) for c in chunks[: len(chunks) // 2]) > 0
        return
    assert len(audio) == round(1.3 * rate) == encoder.samples_out
    err = np.abs(audio - expected)
    if encoding is AudioEncoding.OGG_OPUS:  # lossy: the same waveform after alignment (0.997 measured), same loudness
        assert aligned_correlation(audio, expected, max_lag=rate // 50) > 0.95
        assert abs(np.sqrt(np.mean(audio**2)) - np.sqrt(np.mean(expected**2))) < 0.05
    elif encoding is AudioEncoding.MULAW:
        assert np.median(err) < 0.01
    else:
        assert err.max() < 2 / 32767
    if encoding is not AudioEncoding.FLAC:  # bytes leave before the end
        assert sum(len(c) for c in chunks[: len(chunks) // 2]) > 0
    else:  # FLAC's header carries the length: the stream is sent whole at the end (see audio_format)
        assert not any(chunks[:-1]) and not encoder.streams_incrementally


def test_wav_stream_header_is_first_and_sizes_are_open_ended():
    enc = AudioStreamEncoder("WAV", 16000)
    first = enc.encode(np.zeros(300, dtype=np.float32))
    assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", first[24:28])[0] == 16000
    assert struct.unpack("<I", first[40:44])[0] == 0xFFFFFFFF - 36


def test_mulaw_matches_the_g711_reference():
    x = np.arange(-32768, 32768, dtype="<i2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
        expected = np.frombuffer(audioop.lin2ulaw(x.tobytes(), 2), dtype=np.uint8)
    np.testing.assert_array_equal(int16_to_mulaw(x), expected)


def test_float_to_int16_clips_and_rounds():
    assert float_to_int16(np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0], dtype=np.float32)).tolist() == [
        -32767, -32767, 0, 16384, 32767, 32767,
    ]  # fmt: skip


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_streaming_resampler_equals_one_shot_resample(rate):
    pcm = tone(0.7)
    resampler = StreamingResampler(24000, rate)
    rng = np.random.default_rng(1)
    out, i = [], 0
    while i < len(pcm):
        n = int(rng.integers(1, 2500))
        out.append(resampler.feed(pcm[i : i + n]))
        i += n
    out.append(resampler.flush())
    y = np.concatenate(out)
    expected = AF.resample(torch.from_numpy(pcm), 24000, rate).numpy()
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=0)
    # only the filter's context is kept (a few blocks of the reduced rates), not the stream
    assert len(resampler._buffer) <= (resampler.context_blocks + 1) * resampler.orig + resampler.width < 1000


def test_bad_formats_name_the_field():
    with pytest.raises(AudioFormatError) as e:
        check_output_format("AAC", 24000)
    assert e.value.field == "encoding"
    with pytest.raises(AudioFormatError) as e:
        check_output_format("WAV", 12345)
    assert e.value.field == "sample_rate_hertz"
    with pytest.raises(AudioFormatError, match="OGG_OPUS") as e:
        check_output_format(AudioEncoding.OGG_OPUS, 44100)
    assert e.value.field == "sample_rate_hertz"
    assert check_output_format("FLAC", 44100) == (AudioEncoding.FLAC, 44100)


@pytest.mark.parametrize("rate", [8000, 22050, 24000, 48000])
def test_mp3_streams_as_the_one_shot_file_does(rate):
    """A stream's bytes are the one-shot file's but for the first frame (where libsndfile puts the LAME length tag
    at close, after that frame was sent), however the PCM is chunked; and it reads back whole (constant bitrate:
    a variable-bitrate stream without the tag read back as 14184 of 48000 samples)."""
    pcm = tone(2.0, 24000)
    whole = AudioStreamEncoder("MP3", rate, source_rate=24000)
    one_shot = whole.encode(pcm) + whole.finish()
    streamed = b"".join(encode_in_chunks(AudioStreamEncoder("MP3", rate, source_rate=24000), pcm, seed=rate))
    assert len(streamed) == len(one_shot)
    differing = [i for i, (a, b) in enumerate(zip(streamed, one_shot, strict=True)) if a != b]
    if _resampled_in_chunks(pcm, rate, seed=rate) == _resampled_in_chunks(pcm, rate, seed=None):
        # only the first frame (<= 1440 bytes at 48 kHz; at 8 kHz, MPEG-2.5, libsndfile writes no tag: none differ)
        assert max(differing, default=0) < 1500, differing[-5:]
    else:  # MKL's AVX2 sgemm rounds the resampler's conv by the call's length (an AVX2-only host, or
        # MKL_ENABLE_INSTRUCTIONS=AVX2: 24 -> 48 kHz), so the PCM LAME gets differs in its last bits, and so do the
        # bytes after it; the promise is then the audio's: the same length, the same samples within MP3's noise.
        a, _ = sf.read(io.BytesIO(streamed))
        b, _ = sf.read(io.BytesIO(one_shot))
        assert len(a) == len(b) and np.abs(a - b).max() < 0.02, np.abs(a - b).max()
    audio, got_rate = sf.read(io.BytesIO(streamed))
    assert got_rate == rate and len(audio) >= whole.samples_out


def test_close_without_finish_and_encode_after_finish():
    enc = AudioStreamEncoder("OGG_OPUS", 24000)
    enc.encode(tone(0.2))
    enc.close()
    enc.close()
    enc2 = AudioStreamEncoder("LINEAR16", 24000)
    enc2.finish()
    with pytest.raises(RuntimeError):
        enc2.encode(np.zeros(10, dtype=np.float32))
