"""The drain's edges: the grace period running out, and a model that finishes loading while the server drains."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request
from support.waiting import wait_until

from omnivox.services.parts import loading
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.parts.registry import ModelState
from omnivox.v1 import generation_pb2_grpc

KV_GIB = 0.01
# 4000 tokens on a 4096-token context: many seconds even for the tiny model, so it is surely still running.
LONG = dict(max_output_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=4096)


def health(srv: ServerThread) -> int:
    return health_pb2_grpc.HealthStub(srv.channel()).Check(health_pb2.HealthCheckRequest()).status


def test_grace_period_expiry_cuts_the_stream(checkpoint: Path) -> None:
    """A stream still running when the grace period ends is cut (the client sees an error, not a summary), its
    handler unwinds, and stop() returns soon after the grace period instead of waiting for the stream."""
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], EngineOptions(kv_cache_gib=KV_GIB)) as srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        stream = stub.Generate(user_request("Talk for a long time.", **LONG))
        assert next(stream).HasField("delta")  # admitted and running
        grace = 1.0
        started = time.monotonic()
        srv.run(srv.server.stop(grace))
        took = time.monotonic() - started
        # The drain waited out the grace period (the stream was in flight), then closed within the 1 s close grace.
        assert grace <= took < grace + 5.0, took
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for response in stream:
                received.append(response)
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), info.value
        assert not any(r.HasField("summary") for r in received)
        assert sum(len(r.delta.token_ids) for r in received) < LONG["max_output_tokens"] - 1
        # The cancelled handler unwinds (closing its engine stream) just after stop() returns. The engine itself is
        # shut down by then, so its KV pool is no longer a server's concern; the admission slot is.
        wait_until(lambda: srv.registry.in_flight() == 0, timeout=5.0)


def test_model_finishing_its_load_during_a_drain_is_not_served(checkpoint: Path, monkeypatch) -> None:
    """Model `a` serves a long stream that holds the drain open; model `b` finishes loading during the drain: health
    stays NOT_SERVING and `b` refuses calls with UNAVAILABLE; the drain ends when the stream on `a` does."""
    real_load = loading.load
    b_loading, release_b = threading.Event(), threading.Event()

    def load(model, options):
        if model.name == "b":
            b_loading.set()
            assert release_b.wait(60), "the test never released the load"
        real_load(model, options)

    monkeypatch.setattr(loading, "load", load)
    specs = [ModelSpec(path=checkpoint, name="a"), ModelSpec(path=checkpoint, name="b")]
    srv = ServerThread(specs, EngineOptions(kv_cache_gib=KV_GIB), load=False)
    with srv:
        loaded = srv.run_async(srv.server.load_models(srv.engine_options))
        assert b_loading.wait(120)  # `a` is ready, `b` is inside its load
        assert srv.registry.lookup("a").state is ModelState.READY
        assert health(srv) == health_pb2.HealthCheckResponse.NOT_SERVING

        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        stream = stub.Generate(user_request("Talk for a long time.", model="a", **LONG))
        assert next(stream).HasField("delta")
        stopped = srv.run_async(srv.server.stop(60.0))
        wait_until(lambda: srv.registry.draining, timeout=30.0)

        release_b.set()
        loaded.result(timeout=120)
        assert srv.registry.lookup("b").state is ModelState.READY
        assert not stopped.done()  # still draining: the stream on `a` is in flight
        assert health(srv) == health_pb2.HealthCheckResponse.NOT_SERVING  # never SERVING while draining
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(user_request("Hi", model="b", max_output_tokens=2)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()

        stream.cancel()  # the last in-flight call gone: the drain ends
        stopped.result(timeout=60)
        assert srv.registry.in_flight() == 0
