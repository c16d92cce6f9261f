"""A real omnivox gRPC server on a free localhost port, for tests: its own event loop in a background thread.

    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.01)) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        ...
        server.engine("tiny").kv_usage()

Clients are ordinary synchronous grpc channels, exactly what a user would run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from omnivox.services.grpc_api.server import OmnivoxServer, ServerOptions, build_registry
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2
from support.engines import device_under_test


class ServerThread:
    def __init__(
        self,
        specs: Sequence[ModelSpec],
        engine_options: EngineOptions = EngineOptions(),
        load: bool = True,
        **server_options: Any,
    ) -> None:
        server_options.setdefault("port", 0)
        server_options.setdefault("grace_period_s", 5.0)
        self.options = ServerOptions(**server_options)
        self.registry = build_registry(specs, self.options.max_queue)
        if engine_options.device is None:  # OMNIVOX_TEST_DEVICE (else the CPU), float32 unless the test says
            engine_options = dataclasses.replace(
                engine_options, device=str(device_under_test()), dtype=engine_options.dtype or "float32"
            )
        self.engine_options = engine_options
        self.load = load
        self.server = OmnivoxServer(self.registry, self.options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-server", daemon=True)
        self._channels: list[grpc.Channel] = []

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return self.run_async(coro).result(timeout)

    def run_async(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Start a coroutine on the server's loop; its future, for the test to wait on later."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.run(self.server.start())
        if self.load:
            self.run(self.server.load_models(self.engine_options), timeout=600)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 0.0) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._thread.is_alive():
            self.run(self.server.stop(grace_s))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    @property
    def address(self) -> str:
        return self.server.address

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return channel

    def engine(self, name: str = ""):
        model = self.registry.lookup(name)
        assert model.engine is not None
        return model.engine

    def wait_kv_free(self, name: str = "", timeout: float = 60.0) -> tuple[int, int]:
        """Wait until the model's KV pool has every block free again; return (free, total) as last seen.

        Waits on the engine, not on the clock: it returns as soon as every block is free, or as soon as the engine
        holds no request (then nothing is left that could free the rest: a leak, returned at once). The timeout only
        bounds a wedged engine; the old fixed 1 s failed on a loaded 2-core machine where one step took longer.
        """
        engine = self.engine(name)
        deadline = time.monotonic() + timeout
        while True:
            usage = engine.kv_usage()
            if usage.free_blocks == usage.total_blocks or time.monotonic() > deadline:
                return usage.free_blocks, usage.total_blocks
            if not engine.has_unfinished():  # blocks are freed before the request leaves (engine.py _finish)
                usage = engine.kv_usage()
                return usage.free_blocks, usage.total_blocks
            time.sleep(0.01)


def nothing_left(server: ServerThread, model: str, timeout: float = 5.0) -> None:
    """No engine request, KV block, encoder-cache reference or admission slot left behind by the calls so far.

    A handler's `finally` runs just after its client saw the status, so each count gets `timeout` seconds to settle.
    """
    free, total = server.wait_kv_free(model, timeout=timeout)
    assert free == total, f"{total - free} of {total} KV blocks still held"
    engine, served = server.engine(model), server.registry.lookup(model)
    bundle = served.bundle
    caches = [part.cache for part in (bundle.vision, bundle.audio, bundle.whisper) if part is not None]

    def settled() -> bool:
        return engine.num_unfinished() == 0 and served.in_flight == 0 and all(c.total_refs() == 0 for c in caches)

    deadline = time.monotonic() + timeout
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_unfinished() == 0, f"{engine.num_unfinished()} engine requests unfinished"
    assert served.in_flight == 0, f"{served.in_flight} admission slots held"
    assert [c.total_refs() for c in caches] == [0] * len(caches), "encoder-cache references held"
    engine.check_integrity()


def user_request(text: str, **fields: Any) -> generation_pb2.GenerateRequest:
    """A GenerateRequest with one user turn; keyword arguments set further request fields."""
    return generation_pb2.GenerateRequest(
        contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text=text)])], **fields
    )


def served_greedy_equals_generate(paths: dict[str, Any], max_tokens: int = 6, min_prompt: int = 0) -> None:
    """Serve every checkpoint of `paths` (name -> folder with a chat template) in one real server and check that one
    greedy Generate each streams the tokens transformers' generate gives for the ChatML prompt written out here.
    `min_prompt`: the prompt must be longer than this (to pass a model's windows)."""
    import transformers

    from omnivox.v1 import generation_pb2_grpc
    from support.checkpoints import load_reference, reference_greedy

    text = "The capital of France is Paris. The capital of Italy is"
    specs = [ModelSpec(path=p, name=name) for name, p in paths.items()]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=8)) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        for name, path in paths.items():
            request = user_request(text, model=name, max_output_tokens=max_tokens, ignore_eos=True)
            request.sampling.temperature = 0.0
            ours = [t for r in stub.Generate(request, timeout=60) if r.WhichOneof("response") == "delta"
                    for t in r.delta.token_ids]  # fmt: skip
            # The ChatML template of tests/support/checkpoints.py written out by hand, not rendered by the same
            # apply_chat_template call the service makes (a bug shared by both would pass).
            rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
            prompt = transformers.AutoTokenizer.from_pretrained(path).encode(rendered, add_special_tokens=False)
            assert len(prompt) > min_prompt, (name, len(prompt))
            ref = load_reference(path)
            ref.generation_config.eos_token_id = None
            assert ours == reference_greedy(ref, prompt, max_tokens)[0], name
