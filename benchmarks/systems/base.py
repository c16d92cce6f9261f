"""What every benchmarked system provides, and the closed-loop client that most of them share."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.workload import BenchRequest

Progress = Callable[[int], None]  # called with the number of requests just completed


class SystemUnavailable(Exception):
    """A peer that cannot run here (not installed, no GGUF, ...): reported as skipped with this reason."""


class System(Protocol):
    name: str  # as shown in tables and plots
    levels: Sequence[int] | None  # the concurrency levels it can serve; None = any

    def start(self) -> None:
        """Load, warm up. Raises SystemUnavailable when the system cannot run here."""

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        """Serve `requests` with at most `concurrency` in flight (closed loop: a client sends its next request when
        its previous one is done) and return one trace per request sent, in request order. After `deadline`
        (a time.perf_counter() value) no new request starts, except the first wave of `concurrency`."""

    def close(self) -> None: ...


def may_start(index: int, total: int, concurrency: int, deadline: float) -> bool:
    """Whether request `index` (0-based, in sending order) may still be sent: the first wave always goes."""
    return index < total and (index < concurrency or time.perf_counter() < deadline)


def run_closed_loop(
    requests: list[BenchRequest],
    concurrency: int,
    one_request: Callable[[BenchRequest], RequestTrace],
    progress: Progress,
    deadline: float = math.inf,
) -> list[RequestTrace]:
    """`concurrency` client threads, each taking the next unsent request when its previous one has finished."""
    traces: list[RequestTrace | None] = [None] * len(requests)
    lock = threading.Lock()
    next_index = 0

    def client() -> None:
        nonlocal next_index
        while True:
            with lock:
                if not may_start(next_index, len(requests), concurrency, deadline):
                    return
                i = next_index
                next_index += 1
            try:
                trace = one_request(requests[i])
            except Exception as e:  # a failed request is a data point, not the end of the run
                trace = RequestTrace(index=i, send_time=time.perf_counter(), error=f"{type(e).__name__}: {e}")
            traces[i] = trace
            progress(1)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return [t for t in traces if t is not None]


async def run_closed_loop_async(
    requests: list[BenchRequest],
    concurrency: int,
    one_request: Callable[[BenchRequest], Awaitable[RequestTrace]],
    progress: Progress,
    deadline: float = math.inf,
) -> list[RequestTrace]:
    """The same closed loop as `run_closed_loop`, as `concurrency` asyncio clients on one event loop."""
    traces: list[RequestTrace | None] = [None] * len(requests)
    sent = 0

    async def client() -> None:
        nonlocal sent
        while may_start(sent, len(requests), concurrency, deadline):
            i, sent = sent, sent + 1
            traces[i] = await one_request(requests[i])
            progress(1)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [t for t in traces if t is not None]
