"""Crash-only: an exception in the engine's step loop fails the in-flight calls with INTERNAL, turns health
NOT_SERVING, marks the model not ready, and `run()` returns non-zero within seconds (never a live server that
answers nothing)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import user_request

from omnivox.services.grpc_api import server as server_module
from omnivox.services.grpc_api.server import ENGINE_FAILED_EXIT, OmnivoxServer, ServerOptions
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.parts.registry import ModelState
from omnivox.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=4096)


def test_engine_failure_fails_calls_and_exits_nonzero(checkpoint: Path) -> None:
    seen: dict[str, object] = {}

    async def main() -> int:
        ready: asyncio.Queue[OmnivoxServer] = asyncio.Queue()

        async def on_ready(srv: OmnivoxServer) -> None:
            ready.put_nowait(srv)

        run = asyncio.create_task(
            server_module.run(
                [ModelSpec(path=checkpoint, name="tiny")],
                ServerOptions(port=0, grace_period_s=5.0),
                EngineOptions(kv_cache_gib=0.01, device="cpu", dtype="float32"),
                on_ready=on_ready,
            )
        )
        srv = await asyncio.wait_for(ready.get(), 120)
        engine = srv.registry.lookup("tiny").engine
        assert engine is not None
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stream = generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                user_request("Talk for a long time.", max_output_tokens=4000, ignore_eos=True)
            )
            assert (await stream.read()).HasField("delta")  # running

            def broken_step():
                raise RuntimeError("injected: a CUDA error, a bug, a bad kernel")

            engine.core.step = broken_step  # the next step raises
            seen["failed_at"] = time.monotonic()
            try:
                while await stream.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as err:
                seen["code"] = err.code()
            seen["fail_s"] = time.monotonic() - seen["failed_at"]
        await asyncio.wait_for(srv.engine_failed.wait(), 5)
        health = await srv.health.Check(health_pb2.HealthCheckRequest(), None)
        seen["health"] = health.status
        seen["state"] = srv.registry.lookup("tiny").state
        return await run

    started = time.monotonic()
    rc = asyncio.run(main())
    ended = time.monotonic()
    assert seen["code"] == grpc.StatusCode.INTERNAL
    assert seen["fail_s"] < 2.0
    assert seen["health"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen["state"] is ModelState.FAILED  # ListModels reports it not ready; new calls FAILED_PRECONDITION
    assert rc == ENGINE_FAILED_EXIT
    assert ended - seen["failed_at"] < 5.0, f"exited {ended - seen['failed_at']:.1f} s after the failure"
    assert ended - started < 60


def test_a_model_that_fails_to_load_leaves_the_others_serving(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    from support.service_harness import ServerThread

    from omnivox.v1 import model_pb2, model_pb2_grpc

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    specs = [ModelSpec(path=checkpoint, name="tiny"), ModelSpec(path=broken, name="broken")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as srv:
        ch = srv.channel()
        models = model_pb2_grpc.ModelServiceStub(ch).ListModels(model_pb2.ListModelsRequest()).models
        assert {m.name: m.ready for m in models} == {"tiny": True, "broken": False}
        health = health_pb2_grpc.HealthStub(ch)
        check = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name)).status  # noqa: E731
        # The whole server ("", what probes ask) is NOT_SERVING while a configured model is not loaded (issue 34):
        # the replica takes no traffic; the loaded model still answers those who call it.
        assert check("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert check("model/tiny") == health_pb2.HealthCheckResponse.SERVING
        assert check("model/broken") == health_pb2.HealthCheckResponse.NOT_SERVING
        gen = generation_pb2_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(gen.Generate(user_request("Hi", model="broken", max_output_tokens=2)))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert list(gen.Generate(user_request("Hi", model="tiny", max_output_tokens=2)))[-1].HasField("summary")
