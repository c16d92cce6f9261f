"""omnivox itself: its gRPC server (a real process this module starts, or an address given), driven through
`omnivox.v1.GenerationService.Generate` by closed-loop asyncio clients."""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.systems.base import Progress, SystemUnavailable, run_closed_loop_async
from omnivox.benchmarks.workload import BenchRequest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def omnivox_command() -> list[str]:
    """The `omnivox` console script of this interpreter's environment."""
    exe = Path(sys.executable).parent / "omnivox"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("omnivox")
    if found:
        return [found]
    return [sys.executable, "-m", "omnivox.services.cli"]


class ServerProcess:
    """`omnivox serve --model PATH --port 0 [extra args]` as a child process, ready when its health check says
    SERVING. The server's output goes to `log_path`.

    The server binds a free port itself and the address is read from its `listening on` log line: a port picked
    here, closed, and handed over could be taken by another process in between (or be another server's).
    """

    def __init__(
        self, model: str | Path | None, extra_args: list[str], log_path: Path, startup_timeout_s: float = 300.0
    ) -> None:
        # model None: the embedded defaults (or the --model flags in extra_args)
        cmd = [*omnivox_command(), "serve", *(["--model", str(model)] if model else []), "--port", "0", *extra_args]
        self.command = cmd
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            started = time.monotonic()
            self.address = _listening_address(log_path, startup_timeout_s, self.proc)
            self.port = int(self.address.rsplit(":", 1)[1])
            wait_serving(self.address, startup_timeout_s - (time.monotonic() - started), self.proc)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _listening_address(log_path: Path, timeout_s: float, proc: subprocess.Popen) -> str:
    """The host:port from the server's `listening on HOST:PORT` log line (a later --port in extra args wins)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(r"listening on (\S+)", log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise SystemUnavailable(f"omnivox server exited with code {proc.returncode} while starting")
        time.sleep(0.05)
    raise SystemUnavailable(f"omnivox server did not report its address within {timeout_s:.0f}s (see {log_path})")


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemUnavailable(f"omnivox server exited with code {proc.returncode} while starting")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                last = e.code().name
            time.sleep(0.5)
    raise SystemUnavailable(f"omnivox server at {address} not SERVING after {timeout_s:.0f}s (last: {last})")


class OmnivoxGrpc:
    """The benchmarked omnivox: starts its own server unless `address` is given."""

    levels = None

    def __init__(
        self,
        model: str | None = None,
        address: str | None = None,
        server_args: list[str] | None = None,
        log_path: Path = Path("bench-results/omnivox-server.log"),
        name: str = "omnivox",
    ) -> None:
        if model is None and address is None:
            raise ValueError("model: give a model path (to start a server) or an address")
        self.name = name
        self.model = model
        self.address = address
        self.server_args = server_args or []
        self.log_path = log_path
        self.server: ServerProcess | None = None

    def start(self) -> None:
        if self.address is None:
            self.server = ServerProcess(self.model, self.server_args, self.log_path)
            self.address = self.server.address
        else:
            wait_serving(self.address, 60.0)
        # Warm up: one short request end to end.
        warm = BenchRequest(index=-1, prompt_text="warm up", prompt_token_ids=[], max_tokens=4)
        trace = asyncio.run(self._run([warm], 1, lambda n: None))[0]
        if trace.error:
            raise SystemUnavailable(f"warm-up request failed: {trace.error}")

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        return asyncio.run(self._run(requests, concurrency, progress, deadline))

    async def _run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

        options = [("grpc.max_concurrent_streams", max(100, concurrency * 2))]
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            async def one(req: BenchRequest) -> RequestTrace:
                message = generation_pb2.GenerateRequest(
                    contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text=req.prompt_text)])],
                    sampling=sampling_pb2.SamplingConfig(temperature=0.0),
                    max_output_tokens=req.max_tokens,
                    ignore_eos=True,
                    request_id=f"bench-{req.index}",
                )
                trace = RequestTrace(index=req.index, send_time=time.perf_counter())
                try:
                    async for response in stub.Generate(message):
                        now = time.perf_counter()
                        kind = response.WhichOneof("response")
                        if kind == "delta" and response.delta.token_ids:
                            trace.add_tokens(len(response.delta.token_ids), now)
                        elif kind == "summary":
                            usage = response.summary.usage
                            trace.prompt_tokens = usage.prompt_tokens
                            trace.cached_tokens = usage.cached_prompt_tokens
                    if trace.num_tokens != req.max_tokens:
                        trace.error = f"asked for {req.max_tokens} tokens (ignore_eos), got {trace.num_tokens}"
                except grpc.aio.AioRpcError as e:
                    trace.error = f"{e.code().name}: {e.details()}"
                return trace

            return await run_closed_loop_async(requests, concurrency, one, progress, deadline)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
