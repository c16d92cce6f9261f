"""Audio parts on the way in (codecs/audio_input.py): formats, mono + resampling, content keys, typed errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF
from support.audio_checkpoints import chirp, encode, espeak_wav, noise, tone

from omnivox.codecs.audio_format import AudioStreamEncoder, float_to_int16, int16_to_mulaw
from omnivox.codecs.audio_input import (
    AudioInputError,
    AudioLimits,
    content_key,
    decode_audio,
    detect_container,
    mulaw_to_int16,
)

SETTINGS = "mel:test"


def _key(decoded) -> str:
    return content_key(decoded.samples, decoded.sample_rate, SETTINGS, "tiny")


def _speech_16k() -> np.ndarray:
    return (chirp(1.2) + noise(1.2, amp=0.05)).astype(np.float32)


def test_wav_flac_linear16_same_samples_same_key():
    x = _speech_16k()
    pcm16 = float_to_int16(x)
    wav = decode_audio(encode(pcm16, 16000, "WAV"))
    flac = decode_audio(encode(pcm16, 16000, "FLAC"))
    raw = decode_audio(pcm16.tobytes(), "LINEAR16", 16000)
    assert (wav.source_format, flac.source_format, raw.source_format) == ("WAV", "FLAC", "LINEAR16")
    np.testing.assert_array_equal(wav.samples, flac.samples)
    np.testing.assert_array_equal(wav.samples, raw.samples)
    np.testing.assert_array_equal(wav.samples, pcm16.astype(np.float32) / 32768.0)
    assert _key(wav) == _key(flac) == _key(raw)
    assert _key(wav) != content_key(wav.samples, 16000, SETTINGS, "other-model")
    assert _key(wav) != content_key(wav.samples, 16000, "mel:other", "tiny")
    assert _key(wav) != _key(decode_audio(encode(x * 0.5, 16000, "WAV")))


def test_stereo_44k_is_mixed_and_resampled():
    left, right = tone(0.75, rate=44100, freq=440.0), chirp(0.75, rate=44100, f1=5000.0)
    stereo = np.stack([left, right], axis=1)
    wav = encode(stereo, 44100, "WAV", "FLOAT")
    decoded = decode_audio(wav, target_rate=16000)
    assert (decoded.source_rate, decoded.source_channels, decoded.sample_rate) == (44100, 2, 16000)
    expected = AF.resample(torch.from_numpy((left + right) / 2), 44100, 16000).numpy()
    assert len(decoded.samples) == len(expected) == 12000
    np.testing.assert_allclose(decoded.samples, expected, atol=1e-6)
    # The same audio as a 44.1 kHz stereo FLAC decodes to the same samples, and so to the same key.
    flac = decode_audio(encode(stereo, 44100, "FLAC", "PCM_24"))
    np.testing.assert_allclose(flac.samples, decoded.samples, atol=1e-5)


@pytest.mark.parametrize(
    ("fmt", "subtype", "rate"),
    [("OGG", "VORBIS", 44100), ("OGG", "OPUS", 48000), ("MP3", "MPEG_LAYER_III", 44100), ("WAV", "PCM_U8", 8000)],
)
def test_compressed_formats_detected_and_decoded(fmt, subtype, rate):
    x = np.stack([tone(1.0, rate=rate), tone(1.0, rate=rate, freq=660.0)], axis=1)
    data = encode(x, rate, fmt, subtype)
    assert detect_container(data) == ("OGG" if fmt == "OGG" else fmt)
    decoded = decode_audio(data)
    assert decoded.source_channels == 2 and decoded.sample_rate == 16000
    # Lossy codecs pad and delay a little; the length stays within 0.1 s of 1 s and the level is right.
    assert abs(decoded.seconds - 1.0) < 0.1
    assert 0.1 < np.sqrt(np.mean(decoded.samples**2)) < 0.3
    if fmt == "OGG" and subtype == "OPUS":
        assert decode_audio(data, "OGG_OPUS").source_format == "OGG"


def test_mulaw_round_trip_with_the_output_encoder():
    x = _speech_16k()
    codes = AudioStreamEncoder("MULAW", 8000, source_rate=8000)
    data = codes.encode(x) + codes.finish()
    decoded = decode_audio(data, "MULAW", 8000, target_rate=8000)
    np.testing.assert_array_equal(decoded.samples, mulaw_to_int16(np.frombuffer(data, np.uint8)) / 32768.0)
    # Every code decodes to a value that encodes back to itself (0x7F is the negative zero, read as +0).
    all_codes = np.arange(256, dtype=np.uint8)
    back = int16_to_mulaw(mulaw_to_int16(all_codes))
    assert ((back == all_codes) | (all_codes == 0x7F)).all()
    assert np.abs(decoded.samples - x).max() < 0.02  # mu-law's quantisation step near 0.4 full scale


def _assert_error(field: str, match: str, *args, **kwargs) -> None:
    with pytest.raises(AudioInputError, match=match) as info:
        decode_audio(*args, **kwargs)
    assert info.value.field == field
    assert " at 0x" not in str(info.value), "an object's address is not a message for a client"


def test_bad_inputs_raise_typed_errors_naming_the_field():
    wav = encode(tone(1.0), 16000, "WAV")
    _assert_error("data", "empty", b"")
    _assert_error("data", "unrecognised", b"hello, this is not audio at all")
    _assert_error("data", "cannot decode", b"RIFF\x00\x00\x00\x00WAVEjunk" + b"\x13" * 64)
    _assert_error("data", "holds no samples", wav[:44])  # a WAV header and no data
    _assert_error("data", "cannot decode", b"fLaC" + b"\x00" * 64)
    _assert_error("sample_rate_hertz", "required", b"\x00\x01" * 100, "LINEAR16")
    _assert_error("sample_rate_hertz", "required", b"\x7f" * 100, "MULAW", 0)
    _assert_error("data", "odd number", b"\x00" * 101, "LINEAR16", 16000)
    _assert_error("sample_rate_hertz", "outside", b"\x00" * 100, "LINEAR16", 1000)
    _assert_error("encoding", "unknown", wav, "MP4")
    _assert_error("encoding", "bytes hold WAV", wav, "FLAC")
    _assert_error("sample_rate_hertz", "header says 16000", wav, None, 44100)
    nan = tone(0.5)
    nan[100] = np.nan
    _assert_error("data", "non-finite", encode(nan, 16000, "WAV", "FLOAT"))
    inf = tone(0.5)
    inf[7] = np.inf
    _assert_error("data", "non-finite", encode(inf, 16000, "WAV", "FLOAT"))
    _assert_error("data", "holds no samples", encode(np.zeros(0, np.float32), 16000, "WAV"))
    _assert_error("data", "bytes; at most", wav, limits=AudioLimits(max_bytes=1000))


def test_over_the_limit_is_refused_never_cut():
    limits = AudioLimits(max_seconds=2.0)
    ok = decode_audio(encode(tone(2.0), 16000, "WAV"), limits=limits)
    assert len(ok.samples) == 32000
    for data, args in [
        (encode(tone(2.01), 16000, "WAV"), ()),
        (encode(tone(2.01, rate=44100), 44100, "FLAC"), ()),
        (float_to_int16(tone(2.01)).tobytes(), ("LINEAR16", 16000)),
        (encode(tone(3.0, rate=48000), 48000, "OGG", "OPUS"), ()),
    ]:
        _assert_error("data", "at most 2 s", data, *args, limits=limits)
    _assert_error("data", "needs 321", encode(tone(0.01), 16000, "WAV"), limits=AudioLimits(min_samples=321))


def test_resampled_length_is_checked_at_the_target_rate():
    """22.05 kHz audio just under the limit stays under it at 16 kHz (the exact check is after resampling)."""
    limits = AudioLimits(max_seconds=1.0)
    decoded = decode_audio(encode(tone(1.0, rate=22050), 22050, "WAV"), limits=limits)
    assert len(decoded.samples) == 16000


def test_espeak_speech_wav_and_flac_share_a_key():
    wav = espeak_wav("The quick brown fox jumps over the lazy dog.")
    if wav is None:
        pytest.skip("espeak-ng is not installed")
    a = decode_audio(wav)
    assert a.source_format == "WAV" and 1.0 < a.seconds < 10.0
    import io

    import soundfile

    pcm, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    flac = decode_audio(encode(pcm, rate, "FLAC"))
    assert _key(a) == _key(flac)


def test_proto_enum_names_are_accepted():
    """The service may pass `AudioEncoding.Name(part.encoding)` as it is: AUDIO_ENCODING_* names map to ours."""
    from omnivox.v1 import content_pb2

    pcm = float_to_int16(tone(0.5))
    for value, data, rate in [
        (content_pb2.AUDIO_ENCODING_UNSPECIFIED, encode(pcm, 16000, "WAV"), 0),
        (content_pb2.AUDIO_ENCODING_WAV, encode(pcm, 16000, "WAV"), 0),
        (content_pb2.AUDIO_ENCODING_FLAC, encode(pcm, 16000, "FLAC"), 0),
        (content_pb2.AUDIO_ENCODING_LINEAR16, pcm.tobytes(), 16000),
    ]:
        decoded = decode_audio(data, content_pb2.AudioEncoding.Name(value), rate)
        np.testing.assert_array_equal(decoded.samples, pcm / np.float32(32768.0))


def test_float_audio_far_outside_its_range_is_refused():
    """A float WAV whose samples reach 1e20 (a broken writer) decoded "fine", then the log-mel power overflowed
    float32: Whisper answered "!!!!..." (token 0) and audio-LLMs token 0, for any such file. Integer PCM written as
    float unscaled (up to 2**31) still decodes: the features are level-invariant enough."""
    t = np.arange(1600) / 16000
    tone = np.sin(2 * np.pi * 440 * t)
    for scale, ok in ((32768.0, True), (2.0**31, True), (1e20, False), (3e38, False)):
        buf = io.BytesIO()
        sf.write(buf, (scale * tone).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
        if ok:
            assert decode_audio(buf.getvalue()).samples.shape == (1600,)
            continue
        with pytest.raises(AudioInputError, match=r"samples reach .*; float audio is expected within \[-1, 1\]") as e:
            decode_audio(buf.getvalue())
        assert e.value.field == "data"


def test_a_file_declared_headerless_is_read_by_its_header_or_refused():
    """encoding LINEAR16 (or MULAW) on a file's bytes decoded the container as samples: FLAC, Ogg and MP3 became
    noise and a confident wrong transcript; a WAV's header became a click and its own rate was ignored. A WAV is now
    read by its header (as Google's API takes LINEAR16 WAVs; a different sample_rate_hertz is refused), the
    compressed containers are refused naming `encoding`. Raw samples that open like an MPEG frame sync still
    decode as samples."""
    t = np.arange(4410) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t)] * 2, axis=1).astype(np.float32) * 0.5
    buf = io.BytesIO()
    sf.write(buf, stereo, 44100, format="WAV")
    wav = decode_audio(buf.getvalue(), "LINEAR16", 0)
    assert (wav.source_format, wav.source_rate, wav.source_channels, len(wav.samples)) == ("WAV", 44100, 2, 1600)
    with pytest.raises(AudioInputError, match="sample_rate_hertz=16000 but the WAV header says 44100 Hz"):
        decode_audio(buf.getvalue(), "LINEAR16", 16000)
    for fmt, name in (("FLAC", "FLAC"), ("OGG", "OGG")):
        buf = io.BytesIO()
        sf.write(buf, stereo, 44100, format=fmt)
        with pytest.raises(AudioInputError, match=f"encoding is MULAW .* but the bytes hold {name} audio") as err:
            decode_audio(buf.getvalue(), "MULAW", 8000)
        assert err.value.field == "encoding"
    raw = np.full(800, -1, "<i2").tobytes()  # b"\xff\xff...": an MPEG sync pattern, but declared raw: samples
    assert decode_audio(raw, "LINEAR16", 16000).source_format == "LINEAR16"
