"""SpeechService behaviour the main speech tests leave unasserted: which voice the prompt carries, a codec failure
reaching the client, the queue bound, and the benchmark's real-time factor against an independent measurement."""

from __future__ import annotations

import time

import grpc
import pytest
from google.rpc import error_details_pb2
from support.service_harness import ServerThread
from support.waiting import wait_until

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, sampling_pb2, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
ENC = content_pb2.AudioEncoding


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_random_speech_model(tmp_path_factory.mktemp("speech") / "orpheus-random", snac_config=SMALL_SNAC)
    with ServerThread([ModelSpec(path=path, name="speech")], EngineOptions(kv_cache_gib=0.02)) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.5  # the random decoder speaks for its whole budget: keep it short
        servicer.limits.audio_seconds_per_char = 0.02
        srv.speech = servicer
        yield srv


def request(text: str = "Hello there.", **fields) -> speech_pb2.SynthesizeSpeechRequest:
    config = speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=24000)
    return speech_pb2.SynthesizeSpeechRequest(text=text, audio_config=config, **fields)


def synthesize(server: ServerThread, req: speech_pb2.SynthesizeSpeechRequest, timeout: float = 120) -> list:
    return list(speech_pb2_grpc.SpeechServiceStub(server.channel()).SynthesizeSpeech(req, timeout=timeout))


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_the_requested_voice_is_in_the_prompt(server, monkeypatch):
    """Orpheus prompts are "<voice>: <text>" (written out here, not built by the layout); no voice = tara."""
    engine = server.engine("speech")
    prompts: list[list[int]] = []
    real_stream = engine.stream

    def spy(prompt, *args, **kwargs):
        prompts.append(list(prompt))
        return real_stream(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "stream", spy)

    def ids(text: str) -> list[int]:
        return engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    for voice, expected in [("leo", "leo"), ("zoe", "zoe"), ("", "tara")]:
        prompts.clear()
        synthesize(server, request(voice=speech_pb2.VoiceSelection(name=voice)))
        [prompt] = prompts
        assert contains(prompt, ids(f"{expected}: Hello there.")), (voice, engine.tokenizer.decode(prompt))
        for other in {"leo", "zoe", "tara"} - {expected}:
            assert not contains(prompt, ids(f"{other}:")), (voice, other)


def test_a_codec_failure_reaches_the_client_and_the_server_keeps_serving(server, monkeypatch):
    worker = server.registry.lookup("speech").bundle.speech.worker
    engine = server.engine("speech")
    real_decode = worker.decoder.decode_windows
    calls = []

    def broken(windows):
        calls.append(len(windows))
        raise RuntimeError("codec exploded")

    monkeypatch.setattr(worker.decoder, "decode_windows", broken)
    with pytest.raises(grpc.RpcError) as info:
        synthesize(server, request(), timeout=60)
    assert calls  # the codec really ran (and failed)
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
    assert "codec exploded" in info.value.details()
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total and engine.num_unfinished() == 0
    wait_until(lambda: worker.open_streams == 0)

    monkeypatch.setattr(worker.decoder, "decode_windows", real_decode)
    responses = synthesize(server, request())  # still serving
    assert responses[-1].HasField("summary") and responses[-1].summary.audio_seconds > 0


def test_queue_bound_refuses_a_second_synthesis(server):
    """With a queue of one, a second request while one synthesises gets RESOURCE_EXHAUSTED with a RetryInfo."""
    model = server.registry.lookup("speech")
    saved = model.max_queue, server.speech.limits.audio_seconds_base
    model.max_queue, server.speech.limits.audio_seconds_base = 1, 30.0  # the first one runs for many seconds
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
        eos = server.registry.lookup("speech").bundle.speech.layout.end_of_speech  # banned: the random model may
        never_ending = sampling_pb2.SamplingConfig(logit_bias={eos: -100.0})  # say it early, ending the first call
        running = stub.SynthesizeSpeech(request("Keep talking.", sampling=never_ending), timeout=120)
        assert next(running).HasField("format")  # admitted
        with pytest.raises(grpc.RpcError) as info:
            synthesize(server, request("Me too."))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        [retry] = [d for d in status_details(info.value) if isinstance(d, error_details_pb2.RetryInfo)]
        assert retry.retry_delay.ToNanoseconds() > 0
        running.cancel()
        wait_until(lambda: model.in_flight == 0)
    finally:
        model.max_queue, server.speech.limits.audio_seconds_base = saved
    assert synthesize(server, request("Now me."))[-1].HasField("summary")  # the slot is free again


def test_benchmark_rtf_matches_an_independent_measurement(server):
    """The speech benchmark's RTF (wall / audio seconds) against this test's own clock and its own count of the
    LINEAR16 bytes of the same synthesis. Both seeded: unseeded, the two once differed by one codec frame (0.683 s
    against 0.768 s, a suite run at load 3-4), most likely a sampled frame the layout drops (not confirmed)."""
    from omnivox.benchmarks import speech as bench

    text = "Hello there."
    seeded = request(text, sampling=sampling_pb2.SamplingConfig(seed=7))
    audio_bytes = sum(len(r.audio.data) for r in synthesize(server, seeded) if r.HasField("audio"))
    audio_s = audio_bytes / (24000 * 2)  # 16-bit mono at 24 kHz
    assert audio_s > 0.3

    started = time.monotonic()
    result = bench.synthesize_one(server.address, text, voice="", model="", timeout_s=120, seed=7)
    outer_wall = time.monotonic() - started
    assert result.audio_s == pytest.approx(audio_s, abs=1e-3)
    assert result.ttfa_s < result.wall_s <= outer_wall
    # The stream's own wall time is the outer one less connecting (a few ms against hundreds).
    assert result.rtf == pytest.approx(outer_wall / audio_s, rel=0.1)
    assert result.rtf * audio_s <= outer_wall
