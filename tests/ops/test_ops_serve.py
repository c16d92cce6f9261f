"""`omnivox serve` in a child process with the operations flags (API keys, metrics port, limits), a load client in
another, and SIGTERM under load: the server drains and exits 0, no call ever ends UNKNOWN or INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.checkpoints import make_checkpoint
from support.serve_process import ServeProcess, omnivox, wait_for_log

from omnivox.services.grpc_api.rpc_errors import rpc_method
from omnivox.v1 import generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc

KEY = "sk-serve-test-123456"


SOAK_MAX_TOKENS = 64  # the longest call benchmarks/load_fault.py's soak sends


def _mean(scrape: str, histogram: str) -> float:
    """The mean of a Prometheus histogram in a /metrics scrape (summed over its label sets; 0 when empty)."""
    total = {"sum": 0.0, "count": 0.0}
    for kind, value in re.findall(rf"^{histogram}_(sum|count)(?:{{[^}}]*}})? (\S+)$", scrape, re.MULTILINE):
        total[kind] += float(value)
    return total["sum"] / total["count"] if total["count"] else 0.0


@pytest.mark.slow
def test_sigterm_under_load_with_keys_and_metrics(tmp_path: Path) -> None:
    """Every time bound here is relative to what this run measured (a loaded 2-core machine slows everything):

    - the drain (SIGTERM to the server's `stopped` line: in-flight calls end, engines close) within 4x the longest
      call the soak sends at this run's served speed (mean end-to-end latency + 64 x mean inter-token latency, from
      /metrics just before the signal), at least 2 s: measured 0.48-0.51 s against calls of 0.2-2.5 s (15 runs,
      load 3.5-5.7 with a busy loop on the other core);
    - the exit after `stopped` (interpreter teardown) within the server's own start-up time in this run
      (interpreter start, the same imports, the model load): measured 0.5-1.3 s against 4.5-31 s. Before the server
      froze its heap there (services/grpc_api/server.py), the final GC took 1.9-6.9 s: the likely cause of the one uncaptured
      failure of the old fixed `< 12 s` from SIGTERM to exit (load ~7.5);
    - the other timeouts only stop a hung test (a server or client that never answers), several times what a
      loaded machine needs.
    """
    ckpt = make_checkpoint(tmp_path / "tiny", family="llama", max_position_embeddings=4096)
    keys = tmp_path / "keys"
    keys.write_text(f"load:{KEY}\n")
    grace_s = 10.0
    launched = time.monotonic()
    serve = ServeProcess(
        "--model", str(ckpt), "--max-queue", "32", "--kv-cache-gib", "0.02", "--threads", "1",
        "--api-keys", str(keys), "--metrics-port", "0", "--grace-period", str(grace_s),
    )  # fmt: skip
    try:
        address = serve.wait_ready()
        startup_s = time.monotonic() - launched
        [metrics_url] = [m.group(1) for line in serve.log if (m := re.search(r"metrics on (\S+)", line))]
        with grpc.insecure_channel(address) as channel:  # without the key: refused; with it: served
            stub = model_pb2_grpc.ModelServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(model_pb2.ListModelsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = omnivox("models", "--server", address, "--api-key", KEY)
        assert listed.returncode == 0 and "tiny" in listed.stdout, listed.stderr
        load = subprocess.Popen(
            [sys.executable, "-m", "omnivox.benchmarks.load_fault", "--server", address, "--api-key", KEY,
             "soak", "--seconds", "6", "--concurrency", "12"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        # Under load: signal once the soak's calls are being served (its 6 s run then has seconds left to meet the
        # drain). The loop ends when the soak ends without a served call; the deadline only stops a hung client.
        served = 'omnivox_grpc_requests_total{grpc_code="OK",method="Generate"}'
        deadline = time.monotonic() + 60
        while served not in (scrape := urllib.request.urlopen(metrics_url, timeout=10).read().decode()):
            assert load.poll() is None and time.monotonic() < deadline, "no Generate served under the soak"
            time.sleep(0.1)
        itl_s = _mean(scrape, "omnivox_inter_token_latency_seconds")
        call_s = _mean(scrape, "omnivox_e2e_request_latency_seconds") + SOAK_MAX_TOKENS * itl_s
        signaled = time.monotonic()
        os.kill(serve.proc.pid, signal.SIGTERM)
        wait_for_log(
            serve, "omnivox.services.grpc_api.server: stopped", timeout=3 * grace_s
        )  # by the grace period + closing
        drain_s = time.monotonic() - signaled
        assert serve.proc.wait(timeout=3 * startup_s) == 0, "".join(serve.log)
        exit_s = time.monotonic() - signaled - drain_s
        out, err = load.communicate(timeout=60)
        assert load.returncode == 0, err[-2000:]
        codes = json.loads(out.strip().splitlines()[-1])["codes"]
        assert not {"UNKNOWN", "INTERNAL", "UNAUTHENTICATED"} & set(codes), codes
        assert codes.get("OK") and codes.get("UNAVAILABLE"), codes  # served, then refused by the drain / gone
        measured = f"drain {drain_s:.2f} s, exit {exit_s:.2f} s, call {call_s:.2f} s, start-up {startup_s:.2f} s"
        print(measured)
        assert drain_s < max(2.0, 4 * call_s), measured
        assert exit_s < startup_s, measured
        log = "".join(serve.log)
        assert "Traceback" not in log, log
    finally:
        serve.stop()


class _LateWriter(generation_pb2_grpc.GenerationServiceServicer):
    """A Generate that is still running when core has already ended its call: the race that showed under load in
    the test above (the client cancels or its deadline passes; core finishes the call; the first `context.write`
    then fails with ExecuteBatchError a moment before grpc cancels the handler's task). Here the task swallows the
    cancellation, so that its write lands on the dead call every time."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    @rpc_method
    async def Generate(self, request, context) -> None:  # noqa: N802 - the RPC's name
        try:
            with contextlib.suppress(asyncio.CancelledError):  # the window of the race: the call is over, the task
                await asyncio.sleep(30)  # runs on
            await context.write(generation_pb2.GenerateResponse())
        finally:
            self.ended.set()


def test_a_write_on_a_call_the_client_already_ended_is_a_cancel_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        servicer = _LateWriter()
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(generation_pb2.GenerateRequest(), timeout=0.2):
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(servicer.ended.wait(), 10)
            await asyncio.sleep(0.1)  # grpc's own handling of the handler's end (it logs there if it disagrees)
        finally:
            await server.stop(0)

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]  # before: "Generate failed" + ExecuteBatchError tracebacks
