"""Load-and-fault suite: abusive gRPC clients, run in their own process, and the server-side checks.

Client workloads (each prints one JSON object):
    python -m omnivox.benchmarks.load_fault --server 127.0.0.1:50051 overload --requests 300
    python -m omnivox.benchmarks.load_fault --server ... cancels --cancels 500 --deadlines 500
    python -m omnivox.benchmarks.load_fault --server ... slow-readers --fast 8 --slow 8
    python -m omnivox.benchmarks.load_fault --server ... soak --seconds 1800     # the long soak (CI runs ~20 s)

Server-side checks (the test process holds the server): `ResourceSampler` (RSS and open file descriptors over time,
least-squares slope over the second half, so start-up growth does not count) and `wait_idle` (nothing running or
waiting, every KV block free, no request state left). tests/ops/test_ops_load_fault.py is the bounded CI version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc

PROMPT = "Tell me a long story about a lighthouse keeper."


def request(max_tokens: int, text: str = PROMPT, **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text=text)])],
        max_output_tokens=max_tokens,
        ignore_eos=True,
        **fields,
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def has_retry_info(err: grpc.aio.AioRpcError) -> bool:
    from google.rpc import error_details_pb2, status_pb2

    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            return any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    return False


# ---- workloads (client side) ----------------------------------------------------------------------------------
async def overload(stub, requests: int, max_tokens: int, ramp_s: float) -> dict:
    """`requests` overlapping Generate calls, started evenly over `ramp_s` seconds (0: all in one burst): each must
    end OK or RESOURCE_EXHAUSTED with RetryInfo. Rejection latency: from sending a call to its status.

    Why a ramp: in a burst of N calls sent in the same millisecond, the last is answered after N times the
    per-call cost of the server's event loop (~3 ms in Python under the engine's GIL use on our 2 cores: 300 at
    once gave a 1.7 s p99), which measures the burst, not the admission check."""

    async def one(delay: float) -> tuple[str, float, bool]:
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        try:
            async for _ in stub.Generate(request(max_tokens)):
                pass
            return "OK", time.perf_counter() - t0, False
        except grpc.aio.AioRpcError as err:
            return err.code().name, time.perf_counter() - t0, has_retry_info(err)

    results = await asyncio.gather(*(one(i * ramp_s / requests) for i in range(requests)))
    rejected = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    codes: dict[str, int] = {}
    for code, _, _ in results:
        codes[code] = codes.get(code, 0) + 1
    return {
        "codes": codes,
        "rejected_with_retry_info": sum(r[2] for r in rejected),
        "rejection_p50_ms": 1e3 * percentile([r[1] for r in rejected], 0.5),
        "rejection_p99_ms": 1e3 * percentile([r[1] for r in rejected], 0.99),
        "served_p50_ms": 1e3 * percentile([r[1] for r in results if r[0] == "OK"], 0.5),
    }


async def cancels(stub, n_cancel: int, n_deadline: int, concurrency: int) -> dict:
    """Calls cancelled right after their first message, and calls with 0-20 ms deadlines."""
    gate = asyncio.Semaphore(concurrency)
    codes: dict[str, int] = {}

    async def cancel_one() -> None:
        async with gate:
            call = stub.Generate(request(200))
            try:
                await call.read()
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] = codes.get(err.code().name, 0) + 1
                return
            call.cancel()
            codes["CANCELLED"] = codes.get("CANCELLED", 0) + 1

    async def deadline_one(timeout: float) -> None:
        async with gate:
            try:
                async for _ in stub.Generate(request(200), timeout=timeout):
                    pass
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            codes[code] = codes.get(code, 0) + 1

    rng = random.Random(0)
    jobs = [cancel_one() for _ in range(n_cancel)] + [deadline_one(rng.uniform(0, 0.02)) for _ in range(n_deadline)]
    rng.shuffle(jobs)
    await asyncio.gather(*jobs)
    return {"codes": codes}


async def slow_readers(stub, n_fast: int, n_slow: int, max_tokens: int, slow_pause_s: float) -> dict:
    """Inter-message gaps of fast readers while `n_slow` readers pause `slow_pause_s` between messages."""
    gaps: list[float] = []

    async def fast() -> None:
        last = None
        async for _ in stub.Generate(request(max_tokens)):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def slow() -> None:
        call = stub.Generate(request(max_tokens))
        async for _ in call:
            await asyncio.sleep(slow_pause_s)

    slow_tasks = [asyncio.create_task(slow()) for _ in range(n_slow)]
    await asyncio.sleep(0.2 if n_slow else 0)
    await asyncio.gather(*(fast() for _ in range(n_fast)))
    for t in slow_tasks:
        t.cancel()
    await asyncio.gather(*slow_tasks, return_exceptions=True)
    return {"gap_p50_ms": 1e3 * percentile(gaps, 0.5), "gap_p99_ms": 1e3 * percentile(gaps, 0.99), "gaps": len(gaps)}


async def soak(stub, seconds: float, concurrency: int, seed: int = 0) -> dict:
    """Closed loop of `concurrency` clients: 20 % cancelled after a message, 5 % with a 0-20 ms deadline, 5 %
    invalid (temperature -1), the rest run to the end."""
    rng = random.Random(seed)
    codes: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < end:
            r = rng.random()
            try:
                if r < 0.20:
                    call = stub.Generate(request(64))
                    await call.read()
                    call.cancel()
                    code = "CANCELLED"
                elif r < 0.25:
                    async for _ in stub.Generate(request(64), timeout=rng.uniform(0, 0.02)):
                        pass
                    code = "OK"
                elif r < 0.30:
                    bad = request(8)
                    bad.sampling.temperature = -1.0
                    async for _ in stub.Generate(bad):
                        pass
                    code = "OK"
                else:
                    async for _ in stub.Generate(request(rng.randint(1, 16))):
                        pass
                    code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            codes[code] = codes.get(code, 0) + 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"codes": codes, "requests": sum(codes.values())}


# ---- server side ------------------------------------------------------------------------------------------------
@dataclass
class ResourceSampler:
    """RSS (MiB) and open file descriptors of process `pid`, sampled every `interval_s` on a thread."""

    pid: int = field(default_factory=os.getpid)
    interval_s: float = 0.25
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, rss MiB, fds)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, float, int]:
        with open(f"/proc/{self.pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return time.monotonic(), rss_kib / 1024, len(os.listdir(f"/proc/{self.pid}/fd"))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample())

    def __enter__(self) -> ResourceSampler:
        self.samples.append(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def slopes_per_min(self) -> tuple[float, float]:
        """Least-squares slopes of RSS (MiB/min) and of fds (per min) over the second half of the samples."""
        tail = self.samples[len(self.samples) // 2 :]
        if len(tail) < 3:
            return 0.0, 0.0
        ts = [t for t, _, _ in tail]
        return (
            60 * statistics.linear_regression(ts, [r for _, r, _ in tail]).slope,
            60 * statistics.linear_regression(ts, [float(f) for _, _, f in tail]).slope,
        )


def idle_state(engine, registry) -> dict:
    """What is left in the engine and the registry (all zero when idle)."""
    usage = engine.kv_usage()
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv_blocks_used": usage.total_blocks - usage.free_blocks,
        "engine_requests": engine.num_unfinished(),
        "output_states": len(engine.outputs._states),
        "admitted": registry.in_flight(),
    }


def wait_idle(engine, registry, timeout_s: float = 2.0) -> tuple[bool, dict, float]:
    """(idle?, what is left, seconds waited)."""
    t0 = time.monotonic()
    while True:
        left = idle_state(engine, registry)
        if not any(left.values()) or time.monotonic() - t0 > timeout_s:
            return not any(left.values()), left, time.monotonic() - t0
        time.sleep(0.01)


class _Keyed:
    """A GenerationService stub that sends `authorization: Bearer KEY` on every call."""

    def __init__(self, stub, key: str) -> None:
        self.stub, self.metadata = stub, (("authorization", f"Bearer {key}"),)

    def Generate(self, request, **kwargs):  # noqa: N802 - the RPC's name
        return self.stub.Generate(request, metadata=self.metadata, **kwargs)


# ---- CLI ----------------------------------------------------------------------------------------------------------
async def _main(args: argparse.Namespace) -> dict:
    async with grpc.aio.insecure_channel(args.server) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        if args.api_key:
            stub = _Keyed(stub, args.api_key)
        if args.cmd == "overload":
            return await overload(stub, args.requests, args.max_tokens, args.ramp)
        if args.cmd == "cancels":
            return await cancels(stub, args.cancels, args.deadlines, args.concurrency)
        if args.cmd == "slow-readers":
            base = await slow_readers(stub, args.fast, 0, args.max_tokens, args.pause)
            loaded = await slow_readers(stub, args.fast, args.slow, args.max_tokens, args.pause)
            return {"baseline": base, "with_slow_readers": loaded}
        if args.server_pid is None:
            return await soak(stub, args.seconds, args.concurrency)
        with ResourceSampler(args.server_pid, interval_s=1.0) as sampler:  # the long soak: `omnivox serve`'s pid
            out = await soak(stub, args.seconds, args.concurrency)
        rss_slope, fd_slope = sampler.slopes_per_min()
        return {**out, "rss_mib_per_min": rss_slope, "fds_per_min": fd_slope, "rss_mib_end": sampler.samples[-1][1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.load_fault")
    p.add_argument("--server", required=True)
    p.add_argument("--api-key", default=os.environ.get("OMNIVOX_API_KEY"))
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overload")
    o.add_argument("--requests", type=int, default=300)
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--ramp", type=float, default=1.0, help="seconds over which the calls start (0: one burst)")
    c = sub.add_parser("cancels")
    c.add_argument("--cancels", type=int, default=500)
    c.add_argument("--deadlines", type=int, default=500)
    c.add_argument("--concurrency", type=int, default=64)
    s = sub.add_parser("slow-readers")
    s.add_argument("--fast", type=int, default=8)
    s.add_argument("--slow", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=48)
    s.add_argument("--pause", type=float, default=0.25)
    k = sub.add_parser("soak")
    k.add_argument("--seconds", type=float, default=1800)
    k.add_argument("--concurrency", type=int, default=16)
    k.add_argument("--server-pid", type=int, help="sample this process's memory and file descriptors")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_main(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
