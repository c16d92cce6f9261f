"""StreamingTranscribe: the chunk decoder (streamed equals one-shot), and the service over real gRPC."""

from __future__ import annotations

import numpy as np
import pytest

from omnivox.codecs.audio_format import AudioEncoding, float_to_int16, int16_to_mulaw
from omnivox.codecs.audio_input import AudioInputError, decode_audio, resample
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder, StreamingResampler


def _chunked(feed, flush, data, sizes) -> np.ndarray:
    out, at = [], 0
    for size in sizes:
        out.append(feed(data[at : at + size]))
        at += size
    out += [feed(data[at:]), flush()]
    return np.concatenate(out)


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 44100, 48000])
def test_streamed_resample_equals_one_shot(rate):
    rng = np.random.default_rng(rate)
    x = (0.1 * rng.standard_normal(rate + 137)).astype(np.float32)
    r = StreamingResampler(rate, 16000)
    got = _chunked(r.feed, r.flush, x, rng.integers(1, 3000, size=40).tolist())
    ref = resample(x, rate, 16000)
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-6


@pytest.mark.parametrize("encoding", [AudioEncoding.LINEAR16, AudioEncoding.MULAW])
def test_chunk_decoder_equals_decode_audio(encoding):
    rng = np.random.default_rng(1)
    pcm = float_to_int16((0.3 * rng.standard_normal(8000 * 2)).clip(-1, 1).astype(np.float32))
    data = pcm.astype("<i2").tobytes() if encoding is AudioEncoding.LINEAR16 else int16_to_mulaw(pcm).tobytes()
    decoder = StreamingAudioDecoder(encoding, 8000)
    got = _chunked(decoder.feed, decoder.flush, data, rng.integers(1, 999, size=50).tolist())  # odd splits too
    ref = decode_audio(data, encoding, 8000).samples
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-6
    assert decoder.seconds_in == 2.0


def test_chunk_decoder_refuses_containers_and_bad_rates():
    with pytest.raises(AudioInputError) as err:
        StreamingAudioDecoder(AudioEncoding.WAV, 16000)
    assert err.value.field == "encoding"
    with pytest.raises(AudioInputError) as err:
        StreamingAudioDecoder(AudioEncoding.LINEAR16, 1000)
    assert err.value.field == "sample_rate_hertz"
