"""Replicas behind client-side balancing, as deploy/'s headless Service is meant to be used: a client with gRPC
`round_robin` over two loopback servers sends calls to both, and with health checking (`healthCheckConfig`) a server
that is draining (SIGTERM: health NOT_SERVING) gets no new calls while its in-flight stream still runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

KV_GIB = 0.01
SHORT = dict(max_output_tokens=2)
LONG = dict(max_output_tokens=4000, ignore_eos=True)  # many seconds: still running when the drain starts
# What a client of the headless Service sets (docs/scaling.md): a subchannel per address, calls spread over the
# ready ones, and a subchannel whose health says NOT_SERVING is not ready.
SERVICE_CONFIG = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=4096)


def calls_served(srv: ServerThread) -> float:
    """Finished Generate RPCs on this server (any status), from its own Prometheus counter."""
    total = 0.0
    for family in srv.server.metrics.registry.collect():
        if family.name == "omnivox_grpc_requests":
            total += sum(
                s.value for s in family.samples if s.name.endswith("_total") and "Generate" in s.labels["method"]
            )
    return total


def generate(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    responses = list(stub.Generate(user_request("Hi", **SHORT), timeout=30))
    assert responses[-1].HasField("summary")


def test_round_robin_over_two_servers_and_a_draining_one_gets_no_new_calls(checkpoint: Path) -> None:
    spec = [ModelSpec(path=checkpoint, name="tiny")]
    engine = EngineOptions(kv_cache_gib=KV_GIB)
    with ServerThread(spec, engine, grace_period_s=30.0) as a, ServerThread(spec, engine) as b:
        target = f"ipv4:127.0.0.1:{a.server.port},127.0.0.1:{b.server.port}"
        channel = grpc.insecure_channel(target, options=[("grpc.service_config", json.dumps(SERVICE_CONFIG))])
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            for _ in range(8):
                generate(stub)
            served_a, served_b = calls_served(a), calls_served(b)
            assert served_a >= 2 and served_b >= 2, (served_a, served_b)  # round_robin: 4 and 4 when both ready
            assert served_a + served_b == 8

            # A drains (what SIGTERM does) while one stream keeps it from closing.
            long_stream = generation_pb2_grpc.GenerationServiceStub(a.channel()).Generate(user_request("Go", **LONG))
            assert next(long_stream).HasField("delta")
            stopping = a.run_async(a.server.stop())
            health = health_pb2_grpc.HealthStub(a.channel())
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # The client learns of NOT_SERVING from its health Watch on A (pushed, not polled), a moment later: wait
            # for that event, seen as 4 calls in a row served (round robin over two ready subchannels would send every
            # other one to A, which answers UNAVAILABLE while draining), not for a fixed time.
            in_a_row = 0
            while in_a_row < 4:
                assert time.monotonic() < deadline, "the client kept routing calls to the draining server"
                try:
                    generate(stub)
                    in_a_row += 1
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    in_a_row = 0
            served_a, served_b = calls_served(a), calls_served(b)
            for _ in range(8):
                generate(stub)  # every call succeeds: none went to A (it would answer UNAVAILABLE)
            assert calls_served(a) == served_a
            assert calls_served(b) == served_b + 8
            assert not stopping.done()  # A was still draining its stream all along
            long_stream.cancel()
            stopping.result(timeout=30)
        finally:
            channel.close()
