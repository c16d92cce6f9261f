"""SpeechService end to end over real gRPC: a random Orpheus-layout decoder + a random SNAC of the 24 kHz framing."""

from __future__ import annotations

import io
import json
import wave
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
from support.audio_checks import aligned_correlation
from support.service_harness import ServerThread
from support.waiting import wait_until

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing.speech_text import split_text
from omnivox.v1 import content_pb2, model_pb2, model_pb2_grpc, sampling_pb2, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)  # same framing, less compute
ENC = content_pb2.AudioEncoding


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_random_speech_model(tmp_path_factory.mktemp("speech") / "orpheus-random", snac_config=SMALL_SNAC)
    with ServerThread([ModelSpec(path=path, name="speech")], EngineOptions(kv_cache_gib=0.02)) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        # Short audio budgets: the random decoder never says end-of-speech, so it speaks for the whole budget.
        servicer.limits.audio_seconds_base = 0.5
        servicer.limits.audio_seconds_per_char = 0.02
        srv.speech = servicer
        yield srv


def synthesize(server, text="Hello there.", encoding=ENC.AUDIO_ENCODING_WAV, rate=0, timeout=120, **fields):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    request = speech_pb2.SynthesizeSpeechRequest(
        text=text, audio_config=speech_pb2.AudioConfig(encoding=encoding, sample_rate_hertz=rate), **fields
    )
    return list(stub.SynthesizeSpeech(request, timeout=timeout))


def split_responses(responses):
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "format" and kinds[-1] == "summary" and set(kinds[1:-1]) <= {"audio"}
    return responses[0].format, b"".join(r.audio.data for r in responses[1:-1]), responses[-1].summary


def decode(data: bytes, encoding: int, rate: int) -> tuple[np.ndarray, int]:
    if encoding == ENC.AUDIO_ENCODING_LINEAR16:
        return sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=rate, channels=1, endian="LITTLE")
    if encoding == ENC.AUDIO_ENCODING_MULAW:
        return sf.read(io.BytesIO(data), format="RAW", subtype="ULAW", samplerate=rate, channels=1)
    return sf.read(io.BytesIO(data))


# Against the LINEAR16 stream of the same seed. The random model speaks noise with a DC offset, the hardest input for
# Opus (which also drops DC): OGG_OPUS measured 0.43 at 24 kHz and 0.37 at 16 kHz, its time-reversed sign-flipped copy
# 0.05 and -0.25 (tests/codecs/test_codec_audio_format.py checks Opus content on a chirp: 0.997); MULAW 0.9999.
MIN_CORRELATION = {
    ENC.AUDIO_ENCODING_LINEAR16: 0.999,
    ENC.AUDIO_ENCODING_WAV: 0.999,
    ENC.AUDIO_ENCODING_FLAC: 0.999,
    ENC.AUDIO_ENCODING_MULAW: 0.99,
    ENC.AUDIO_ENCODING_OGG_OPUS: 0.25,
}
ENCODINGS = [
    ENC.AUDIO_ENCODING_LINEAR16,
    ENC.AUDIO_ENCODING_WAV,
    ENC.AUDIO_ENCODING_FLAC,
    ENC.AUDIO_ENCODING_OGG_OPUS,
    ENC.AUDIO_ENCODING_MULAW,
]


def test_every_encoding_at_24_and_16_khz(server):
    """One seeded request per encoding and rate: each decodes to the LINEAR16 stream's waveform (correlation after
    alignment), so content is checked, not only that the stream is not silence."""
    cases = [(e, r) for e in ENCODINGS for r in (24000, 16000)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: synthesize(server, encoding=c[0], rate=c[1], sampling={"seed": 5}), cases))
    pcm = {r: decode(split_responses(res)[1], e, r)[0] for (e, r), res in zip(cases, results, strict=True)
           if e == ENC.AUDIO_ENCODING_LINEAR16}  # fmt: skip
    for (encoding, rate), responses in zip(cases, results, strict=True):
        fmt, data, summary = split_responses(responses)
        assert (fmt.encoding, fmt.sample_rate_hertz, fmt.channels) == (encoding, rate, 1)
        audio, got_rate = decode(data, encoding, rate)
        assert got_rate == rate
        frames = summary.audio_tokens // 7
        assert summary.audio_tokens == 7 * frames and frames > 0
        assert summary.audio_seconds == pytest.approx(frames * 2048 / 24000, abs=1 / rate)
        assert len(audio) / rate == pytest.approx(summary.audio_seconds, abs=1 / rate)
        assert np.abs(audio).max() > 0  # noise, but not silence
        corr = aligned_correlation(audio, pcm[rate], max_lag=rate // 50)
        assert corr > MIN_CORRELATION[encoding], (encoding, rate, corr)
        assert summary.time_to_first_audio.ToNanoseconds() > 0 and summary.real_time_factor > 0
        assert summary.model == "speech" and summary.request_id
    worker = server.registry.lookup("speech").bundle.speech.worker
    assert wait_until(lambda: worker.open_streams == 0)


def test_eight_concurrent_streams_complete_and_share_codec_passes(server):
    worker = server.registry.lookup("speech").bundle.speech.worker
    worker.stats.max_batch = 0
    worker.one_window_per_pass = False  # as on a GPU (a CPU codec decodes one window a pass, earliest deadline first)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: synthesize(server, text=f"Stream number {i}.",
                                                     encoding=ENC.AUDIO_ENCODING_LINEAR16), range(8)))  # fmt: skip
    for responses in results:
        _, data, summary = split_responses(responses)
        assert len(data) == 2 * round(summary.audio_seconds * 24000) > 0
    worker.one_window_per_pass = True
    assert worker.stats.max_batch > 1  # windows of several streams went through one codec pass
    assert worker.open_streams == 0
    free, total = server.wait_kv_free("speech")
    assert free == total


@pytest.mark.parametrize("seed", [11, 2**32 - 2])  # the last: segment seeds wrap past the range's end to 0
def test_long_text_is_split_and_streamed_in_order(server, seed):
    """Each segment is its own seeded engine request, so the long request's audio == its sentences said alone."""
    sentences = ["First sentence here.", "And a second one!", "Third?"]
    long_text = " ".join(sentences)
    assert split_text(long_text, max_chars=20) == sentences
    server.speech.limits.max_segment_chars = 20
    try:
        pcm = ENC.AUDIO_ENCODING_LINEAR16
        _, whole, summary = split_responses(synthesize(server, long_text, pcm, sampling={"seed": seed}))
        parts = [split_responses(synthesize(server, s, pcm, sampling={"seed": (seed + i) % 2**32}))
                 for i, s in enumerate(sentences)]  # fmt: skip
    finally:
        server.speech.limits.max_segment_chars = 300
    assert summary.audio_tokens == sum(p[2].audio_tokens for p in parts)
    got = np.frombuffer(whole, dtype="<i2").astype(np.int32)
    expected = np.frombuffer(b"".join(p[1] for p in parts), dtype="<i2").astype(np.int32)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 2  # int16 rounding of float noise between batched and single decodes


def expect_error(server, code, field=None, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        synthesize(server, **kwargs)
    assert info.value.code() == code, info.value.details()
    if field is not None:
        violations = [v.field for d in status_details(info.value) if d.DESCRIPTOR.name == "BadRequest"
                      for v in d.field_violations]  # fmt: skip
        assert field in violations
    return info.value


def test_bad_requests_leave_the_server_serving(server):
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    expect_error(server, INVALID, "text", text="   ")
    expect_error(server, INVALID, "text", text="a" * (server.speech.limits.max_text_chars + 1))
    expect_error(server, INVALID, "audio_config.encoding", encoding=99)
    expect_error(server, INVALID, "audio_config.sample_rate_hertz", rate=12345)
    paced = speech_pb2.SynthesizeSpeechRequest(text="Hi.", audio_config=speech_pb2.AudioConfig(speaking_rate=1.5))
    with pytest.raises(grpc.RpcError) as info:  # Orpheus speaks at the pace it samples: refused, not ignored
        list(speech_pb2_grpc.SpeechServiceStub(server.channel()).SynthesizeSpeech(paced, timeout=30))
    assert info.value.code() == INVALID and "audio_config.speaking_rate" in info.value.details()
    expect_error(server, INVALID, "audio_config.sample_rate_hertz", encoding=ENC.AUDIO_ENCODING_OGG_OPUS, rate=44100)
    expect_error(server, INVALID, "sampling.temperature", sampling={"temperature": -1})
    server.speech.limits.max_segment_chars = 5000  # one segment whose prompt cannot fit the 4096-token context
    try:
        err = expect_error(server, INVALID, "text", text="ab " * 1500)
        assert "context" in err.details()
    finally:
        server.speech.limits.max_segment_chars = 300
    err = expect_error(server, grpc.StatusCode.NOT_FOUND, voice={"name": "nobody"})
    assert "nobody" in err.details()
    expect_error(server, grpc.StatusCode.NOT_FOUND, voice={"name": "tara", "language_code": "fr-FR"})
    expect_error(server, grpc.StatusCode.NOT_FOUND, model="no-such-model")
    _, data, summary = split_responses(synthesize(server, voice={"name": "leo", "language_code": "en-US"}))
    assert data and summary.audio_seconds > 0


def never_ending(server) -> sampling_pb2.SamplingConfig:
    """Sampling that bans end-of-speech: the random model says it now and then (at ~1 frame in 4097; 1 of 40 calls
    ended within 1.5 s), and a test that needs the call still running when it cancels or times out flaked."""
    eos = server.registry.lookup("speech").bundle.speech.layout.end_of_speech
    return sampling_pb2.SamplingConfig(logit_bias={eos: -100.0})


def test_cancelled_stream_frees_kv_blocks_and_codec_state(server):
    server.speech.limits.audio_seconds_base = 30.0  # long enough to still be running when cancelled
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
        request = speech_pb2.SynthesizeSpeechRequest(text="Keep talking.", sampling=never_ending(server))
        call = stub.SynthesizeSpeech(request, timeout=120)
        seen = [next(call).WhichOneof("response"), next(call).WhichOneof("response")]
        assert seen == ["format", "audio"]
        engine = server.engine("speech")
        assert engine.num_unfinished() == 1
        call.cancel()
    finally:
        server.speech.limits.audio_seconds_base = 0.5
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total and server.engine("speech").num_unfinished() == 0
    worker = server.registry.lookup("speech").bundle.speech.worker
    assert wait_until(lambda: worker.open_streams == 0)
    _, data, _ = split_responses(synthesize(server))  # still serving
    assert data


def test_deadline_exceeded_frees_kv_blocks_and_codec_state(server):
    server.speech.limits.audio_seconds_base = 30.0
    try:
        with pytest.raises(grpc.RpcError) as info:
            synthesize(server, text="Keep talking.", timeout=1.5, sampling=never_ending(server))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        server.speech.limits.audio_seconds_base = 0.5
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total and server.engine("speech").num_unfinished() == 0
    worker = server.registry.lookup("speech").bundle.speech.worker
    assert wait_until(lambda: worker.open_streams == 0)


def test_list_voices_and_models(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    voices = stub.ListVoices(speech_pb2.ListVoicesRequest()).voices
    assert [v.name for v in voices] == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    assert all(v.model == "speech" and list(v.language_codes) == ["en"] for v in voices)
    assert stub.ListVoices(speech_pb2.ListVoicesRequest(language_code="en-GB")).voices
    assert not stub.ListVoices(speech_pb2.ListVoicesRequest(language_code="de")).voices
    with pytest.raises(grpc.RpcError) as info:
        stub.ListVoices(speech_pb2.ListVoicesRequest(model="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    models = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest()).models
    speech = next(m for m in models if m.name == "speech")
    assert list(speech.output_modalities) == [model_pb2.MODALITY_AUDIO]
    assert speech.has_untrained_components and "SNAC codec" in speech.untrained_components
    # The layout's sampling values are the model's defaults (Orpheus: 0.6 / 0.8 / 1.3), shown as such.
    shown = speech.default_sampling
    assert (shown.temperature, shown.top_p, shown.repetition_penalty) == pytest.approx((0.6, 0.8, 1.3))


def test_cli_speak_writes_a_wav_file(server, tmp_path, capsys):
    from omnivox.services.cli import main

    out = tmp_path / "hello.wav"
    assert main(["speak", "Hello there", "--voice", "tara", "-o", str(out), "--server", server.address]) == 0
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) > 0
    with wave.open(str(out)) as w:  # the streamed header's "unknown length" sizes were replaced by the real ones
        assert w.getnframes() == len(audio)
    assert "real-time factor" in capsys.readouterr().err
    ogg = tmp_path / "hello.ogg"
    assert main(["speak", "Hi", "-o", str(ogg), "--sample-rate", "16000", "-q", "--server", server.address]) == 0
    assert sf.info(str(ogg)).samplerate == 16000 and sf.info(str(ogg)).format == "OGG"
    assert main(["speak", "Hi", "--voice", "nobody", "-o", str(tmp_path / "x.wav"), "--server", server.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["speak", "--list-voices", "--server", server.address]) == 0
    assert "tara\ten\tspeech" in capsys.readouterr().out


def test_speech_benchmark_reports_first_audio_rtf_and_realtime_streams(server, tmp_path, capsys):
    from omnivox.benchmarks import speech as bench

    result = bench.run_levels(server.address, [1, 3], text="Hi there.")
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert len(level["streams"]) == level["concurrency"]
        for s in level["streams"]:
            assert 0 < s["ttfa_s"] <= s["wall_s"] and s["audio_s"] > 0
            assert s["rtf"] == pytest.approx(s["wall_s"] / s["audio_s"])
            assert s["realtime"] == (s["lateness_s"] <= 0)
        assert level["all_realtime"] == all(s["realtime"] for s in level["streams"])
    realtime = [level["concurrency"] for level in result["levels"] if level["all_realtime"]]
    assert result["max_realtime_streams"] == max(realtime, default=0)
    out = tmp_path / "speech.json"
    assert bench.main(["--address", server.address, "--concurrency", "2", "--text", "Hi.", "--out", str(out)]) == 0
    assert "faster than real time" in capsys.readouterr().out
    assert json.loads(out.read_text())["levels"][0]["concurrency"] == 2
