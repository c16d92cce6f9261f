"""Tracing: a SERVER span per omnivox RPC that continues the client's `traceparent`, with queue, prefill and decode
children in order; off unless an exporter is configured."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint
from service_harness import ServerThread, user_request

from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

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
