"""Health "" (the whole server: what the kubelet's probes and Docker's HEALTHCHECK ask) is NOT_SERVING while any
configured model is not loaded: a replica that came up without one of its models would otherwise take its share of
traffic and answer FAILED_PRECONDITION for that model forever. The per-model names say which one, the omnivox
services' names still say SERVING for the model that loaded, and that model serves. Asked on the main port and on
the plaintext --health-port (the same servicer), with grpc.health.v1 Check, List and Watch."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_model_that_fails_to_load_keeps_the_server_not_serving(tmp_path) -> None:
    broken = make_checkpoint(tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])  # truncated: the header promises tensors the file does not hold
    specs = [ModelSpec(path=make_checkpoint(tmp_path / "text"), name="text"), ModelSpec(path=broken, name="broken")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01), health_port=0) as server:
        assert server.server.serving_line().endswith("; not serving broken (failed to load)")
        plaintext = grpc.insecure_channel(f"127.0.0.1:{server.server.health_port}")
        for channel in (server.channel(), plaintext):
            stub = health_pb2_grpc.HealthStub(channel)
            check = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert check.status == NOT_SERVING  # was SERVING
            statuses = {n: s.status for n, s in stub.List(health_pb2.HealthListRequest(), timeout=10).statuses.items()}
            assert statuses[""] == NOT_SERVING
            assert statuses["model/broken"] == NOT_SERVING and statuses["model/text"] == SERVING
            assert statuses["omnivox.v1.GenerationService"] == SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == NOT_SERVING
            watch.cancel()
        plaintext.close()
        generate = generation_pb2_grpc.GenerationServiceStub(server.channel())
        request = user_request("Hi", model="text", max_output_tokens=2)
        assert list(generate.Generate(request, timeout=60))[-1].HasField("summary")  # the loaded model serves


def test_every_model_loaded_is_serving(tmp_path) -> None:
    """The other half: with all models loaded, "" is SERVING (so the check above is not always NOT_SERVING)."""
    specs = [ModelSpec(path=make_checkpoint(tmp_path / n), name=n) for n in ("a", "b")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as server:
        stub = health_pb2_grpc.HealthStub(server.channel())
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
        for name in ("model/a", "model/b"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == SERVING
