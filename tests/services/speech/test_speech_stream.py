"""StreamingSynthesizeSpeech over real gRPC: text chunks in 300 ms apart, audio out before the text is complete."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.calls.speech_stream import ClauseCutter
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.metrics import UnderrunMeter
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
CHUNKS = ["Hello there, this ", "is the first clause. And ", "here is a second one, ", "streamed in slowly; ", "done"]


def test_clause_cutter():
    cut = ClauseCutter(max_chars=20)
    assert cut.feed("Hello there, th") == ["Hello there,"]
    assert cut.feed("is is a long clause without any stop") == ["this is a long", "clause without any"]
    assert cut.feed(".") == []  # "stop." waits for the space after the period (it may be "3.5")
    assert cut.feed(" Next one") == ["stop."]
    assert cut.flush() == ["Next one"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_random_speech_model(tmp_path_factory.mktemp("stream") / "orpheus-random", snac_config=SMALL_SNAC)
    spec = ModelSpec(path=path, name="speech")
    data_dir = tmp_path_factory.mktemp("data")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.02), data_dir=data_dir, metrics_port=0) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.3  # the random decoder speaks its whole budget
        servicer.limits.audio_seconds_per_char = 0.01
        yield srv


def test_first_audio_before_the_last_chunk_and_one_continuous_stream(server):
    last_sent = threading.Event()
    sent_at: list[float] = []

    def requests():
        config = speech_pb2.StreamingSpeechConfig(
            audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
        for i, chunk in enumerate(CHUNKS):
            if i:
                time.sleep(0.3)
            sent_at.append(time.monotonic())
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=chunk)
        last_sent.set()
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    first_audio = None
    data = b""
    summary = None
    for response in stub.StreamingSynthesizeSpeech(requests(), timeout=120):
        kind = response.WhichOneof("response")
        if kind == "audio" and response.audio.data:
            first_audio = first_audio or time.monotonic()
            data += response.audio.data
        elif kind == "summary":
            summary = response.summary
    assert summary is not None and first_audio is not None
    assert first_audio < sent_at[-1], "first audio must come before the last text chunk is sent"
    # All clauses' frames went through one codec stream: exactly 2048 samples per frame, none lost or doubled at joins.
    assert summary.audio_tokens % 7 == 0
    assert len(data) // 2 == summary.audio_tokens // 7 * 2048
    assert summary.prompt_tokens > 0


def test_config_must_come_first(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingSynthesizeSpeech(iter([speech_pb2.StreamingSynthesizeSpeechRequest(text="hi")]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_clause_joins_have_no_seam(server):
    """The seam test of tests/codecs/test_codec_streaming.py applied where clauses meet in StreamingSynthesizeSpeech's audio:
    the served audio equals the one-shot decode of every clause's frames together (to LINEAR16 rounding), and the step
    across each clause join is no larger than the signal's own steps just before it."""
    import numpy as np
    import torch

    servicer = next(b.servicer for b in server.server.services if isinstance(b.servicer, SpeechServicer))
    model = servicer.registry.get_ready("speech")
    bundle, engine = model.bundle.speech, model.engine
    frames: list[list[int]] = []
    clause_starts: list[int] = []  # frame index where each clause's audio begins
    real_push, real_stream = bundle.worker.push, engine.stream

    def recording_push(stream, new):
        frames.extend(new)
        real_push(stream, new)

    def marking_stream(*args, **kwargs):
        clause_starts.append(len(frames))
        return real_stream(*args, **kwargs)

    def requests():
        config = speech_pb2.StreamingSpeechConfig(
            audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
        for chunk in CHUNKS:
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=chunk)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    bundle.worker.push, engine.stream = recording_push, marking_stream
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
        data = b"".join(r.audio.data for r in stub.StreamingSynthesizeSpeech(requests(), timeout=120))
    finally:
        del bundle.worker.push, engine.stream
    assert len(clause_starts) == 5  # five clauses ("done" is the last), four joins
    served = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    one_shot = bundle.codec.decode_frames(torch.tensor(frames)[None], bundle.layout.frame_levels)[0].numpy()
    assert len(served) == len(one_shot) == len(frames) * 2048
    # Exact up to LINEAR16 rounding (half a step, 1.5e-5) plus the streamed-vs-one-shot difference (< 1e-5).
    np.testing.assert_allclose(served, np.clip(one_shot, -1, 1), atol=3e-5, rtol=0)
    joins = np.array([s * 2048 for s in clause_starts[1:] if 0 < s < len(frames)])
    assert len(joins) >= 3
    jumps = np.abs(served[joins] - served[joins - 1])
    local = np.array([np.abs(np.diff(served[j - 64 : j])).max() for j in joins])
    assert np.all(jumps <= local), (jumps, local)


def scrape(srv: ServerThread) -> dict[str, float]:
    """Every sample of the speech model on the server's /metrics endpoint, by sample name."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.labels.get("model") == "speech" and "le" not in s.labels}  # fmt: skip


def test_streaming_metrics_after_a_stream(server):
    before = scrape(server)

    def requests():
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=speech_pb2.StreamingSpeechConfig())
        for chunk in CHUNKS:
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=chunk)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    summary = list(stub.StreamingSynthesizeSpeech(requests(), timeout=120))[-1].summary
    after = scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("omnivox_speech_stream_clauses_count") == 1 and grew("omnivox_speech_stream_clauses_sum") == 5
    assert grew("omnivox_speech_clause_first_audio_seconds_count") == 5  # one per clause
    assert 0 < grew("omnivox_speech_clause_first_audio_seconds_sum") < 5 * summary.total.seconds + 5
    assert grew("omnivox_speech_text_end_to_last_audio_seconds_count") == 1
    assert grew("omnivox_time_to_first_audio_seconds_count") == 1
    assert grew("omnivox_speech_real_time_factor_count") == 1
    assert grew("omnivox_audio_seconds_total") == pytest.approx(summary.audio_seconds, abs=1e-6)
    assert grew("omnivox_e2e_request_latency_seconds_count") == 1
    assert after["omnivox_speech_streams_active"] == 0
    # Waits for text and underruns are counted apart (a labelled counter shows a sample once it has counted).
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read().decode()
    assert "# TYPE omnivox_speech_text_wait_seconds_total counter" in body
    assert "# TYPE omnivox_audio_underruns_total counter" in body


def test_underrun_meter_tells_waiting_for_text_from_underruns():
    """Text streamed in: a chunk whose own text arrived after the client's buffer ran dry is a wait for text, not an
    underrun of the server; a chunk whose text was there in time and still came late is an underrun."""
    meter = UnderrunMeter(buffer_s=0.2)
    assert meter.chunk(0.0, 0.2, ready=0.0) == 0.0  # playback starts, dry at 0.2
    assert meter.chunk(1.0, 0.2, ready=0.8) == 0.0  # its text came at 0.8, after the buffer ran dry: waiting for text
    assert (meter.count, meter.text_wait_s) == (0, pytest.approx(0.8))
    assert meter.chunk(1.5, 0.2, ready=0.9) == pytest.approx(0.3)  # text there since 0.9, dry at 1.2: an underrun
    assert (meter.count, meter.seconds) == (1, pytest.approx(0.3))


def test_config_errors_name_the_config_fields(server):
    """The config's sampling / model checks are SynthesizeSpeech's, named as this request has them (`config.`...;
    they were `sampling.temperature`, `model`); a message that sets nothing is not called a second config."""
    from google.rpc import error_details_pb2

    from omnivox.services.grpc_api.rpc_errors import status_details

    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    R = speech_pb2.StreamingSynthesizeSpeechRequest

    def fields(*messages) -> set[str]:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamingSynthesizeSpeech(iter(messages), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return {v.field for d in status_details(info.value) if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations}  # fmt: skip

    bad_sampling = speech_pb2.StreamingSpeechConfig(sampling={"temperature": -1, "top_p": 2})
    assert fields(R(config=bad_sampling), R(text="Hi."), R(end=True)) == {
        "config.sampling.temperature",
        "config.sampling.top_p",
    }
    bad_rate = speech_pb2.StreamingSpeechConfig(audio_config={"sample_rate_hertz": 7})
    assert fields(R(config=bad_rate), R(text="Hi."), R(end=True)) == {"config.audio_config.sample_rate_hertz"}
    assert fields(R(config=speech_pb2.StreamingSpeechConfig()), R(text="Hi."), R()) == {"request"}
