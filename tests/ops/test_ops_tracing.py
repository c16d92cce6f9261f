"""Tracing: a SERVER span per omnivox RPC that continues the client's `traceparent`, with queue, prefill and decode
children in order; off unless an exporter is configured."""

from __future__ import annotations

# A plain import, not importorskip: opentelemetry is in the dev extra, so a missing SDK fails here instead of
# skipping the only test of services/grpc_api/tracing.py unseen.
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_spans_continue_the_clients_trace(tmp_path) -> None:
    ckpt = make_checkpoint(tmp_path / "tiny", family="llama")
    exporter = InMemorySpanExporter()
    with ServerThread(
        [ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.01), trace_exporter=exporter
    ) as srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        list(stub.Generate(user_request("Hello", max_output_tokens=4, ignore_eos=True), metadata=metadata))
        list(stub.Generate(user_request("Hello", max_output_tokens=2)))  # no traceparent: a new trace
        srv.server.tracing.provider.force_flush()
        spans = exporter.get_finished_spans()
    rpc = [s for s in spans if s.name == "omnivox.v1.GenerationService/Generate"]
    assert len(rpc) == 2
    traced = next(s for s in rpc if format(s.context.trace_id, "032x") == TRACE_ID)
    assert format(traced.parent.span_id, "016x") == PARENT_ID
    assert traced.attributes["omnivox.output_tokens"] == 4 and traced.attributes["rpc.grpc.status_code"] == 0
    children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == traced.context.span_id),
                      key=lambda s: s.start_time)  # fmt: skip
    assert [c.name for c in children] == ["prompt", "queue", "prefill", "decode"]
    for a, b in zip(children, children[1:], strict=False):
        assert a.end_time <= b.start_time + 1000  # one after the other (1 µs of clock conversion)
    assert traced.start_time <= children[0].start_time and children[-1].end_time <= traced.end_time + 10**6
    other = next(s for s in rpc if s is not traced)
    assert format(other.context.trace_id, "032x") != TRACE_ID and other.parent is None


def test_tracing_is_off_by_default(tmp_path) -> None:
    ckpt = make_checkpoint(tmp_path / "tiny", family="llama")
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], load=False) as srv:
        assert srv.server.tracing is None


def test_encode_and_codec_spans(tmp_path) -> None:
    """An audio question gets an `encode` span (the encoder worker's pass for its clip); a synthesis a `codec` span."""
    from support.audio_checkpoints import encode, make_qwen2_audio, tone

    from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
    from omnivox.services.grpc_api.speech import SpeechServicer
    from omnivox.services.parts.defaults import save_random_speech_model
    from omnivox.v1 import content_pb2, generation_pb2, speech_pb2, speech_pb2_grpc

    audio_model = make_qwen2_audio(tmp_path / "qwen2_audio", seed=1)
    speech_model = save_random_speech_model(
        tmp_path / "speech", snac_config=dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    )
    exporter = InMemorySpanExporter()
    specs = [ModelSpec(path=audio_model, name="audio"), ModelSpec(path=speech_model, name="speech")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01), trace_exporter=exporter) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base, servicer.limits.audio_seconds_per_char = 0.3, 0.0
        part = content_pb2.AudioPart(data=encode(tone(1.0), 16000, "WAV"), encoding=content_pb2.AUDIO_ENCODING_WAV)
        request = generation_pb2.GenerateRequest(
            model="audio",
            contents=[content_pb2.Content(parts=[content_pb2.Part(audio=part), content_pb2.Part(text="What?")])],
            max_output_tokens=2,
        )
        list(generation_pb2_grpc.GenerationServiceStub(srv.channel()).Generate(request))
        speech = speech_pb2.SynthesizeSpeechRequest(model="speech", text="Hi.")
        list(speech_pb2_grpc.SpeechServiceStub(srv.channel()).SynthesizeSpeech(speech, timeout=120))
        srv.server.tracing.provider.force_flush()
        spans = exporter.get_finished_spans()

    def children(rpc_name: str) -> list[str]:
        rpc = next(s for s in spans if s.name == rpc_name)
        return [s.name for s in spans if s.parent is not None and s.parent.span_id == rpc.context.span_id]

    assert "encode" in children("omnivox.v1.GenerationService/Generate")
    assert "codec" in children("omnivox.v1.SpeechService/SynthesizeSpeech")
