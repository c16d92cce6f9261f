"""omnivox's engine in-process (no gRPC, no second process): the same closed-loop workload through `Engine.stream`.

Next to the server's figures this shows what the service layer and the process boundary cost.
"""

from __future__ import annotations

import asyncio
import math
import time

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.systems.base import Progress, run_closed_loop_async
from omnivox.benchmarks.workload import BenchRequest


class OmnivoxEngineInProcess:
    levels = None

    def __init__(
        self, model: str, dtype: str, device: str = "cpu", quantization: str | None = None, activation_bits: int = 16
    ) -> None:
        self.name = "omnivox engine (in-process)"
        self.model = model
        self.quantization = quantization
        self.activation_bits = activation_bits
        self.dtype = dtype
        self.device = device
        self.engine = None

    def start(self) -> None:
        from omnivox.engine import Engine

        self.engine = Engine.from_pretrained(
            self.model,
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            activation_bits=self.activation_bits,
        )
        warm = BenchRequest(index=-1, prompt_text="", prompt_token_ids=[1, 2, 3, 4], max_tokens=4)
        self.run([warm], 1, lambda n: None)

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        return asyncio.run(self._run(requests, concurrency, progress, deadline))

    async def _run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float
    ) -> list[RequestTrace]:
        from omnivox.engine import SamplingParams

        async def one(req: BenchRequest) -> RequestTrace:
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            trace = RequestTrace(
                index=req.index, send_time=time.perf_counter(), prompt_tokens=len(req.prompt_token_ids)
            )
            async for out in self.engine.stream(req.prompt_token_ids, params):
                if out.new_token_ids:
                    trace.add_tokens(len(out.new_token_ids), time.perf_counter())
                trace.cached_tokens = out.num_cached_tokens
            if trace.num_tokens != req.max_tokens:
                trace.error = f"asked for {req.max_tokens} tokens (ignore_eos), got {trace.num_tokens}"
            return trace

        return await run_closed_loop_async(requests, concurrency, one, progress, deadline)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
