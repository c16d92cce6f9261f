"""Peer: transformers' own continuous batching (`generate_batch`'s manager), where the installed version has it.

`generate_batch` takes one max_new_tokens for all requests and submits everything at once, so we drive the manager it
wraps (`init_continuous_batching`) the same closed-loop way as every other system: at most `concurrency` requests in
flight, each with its own max_new_tokens, EOS disabled, token timestamps recorded by the manager (perf_counter).
"""

from __future__ import annotations

import math
import time

import torch

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.systems.base import Progress, SystemUnavailable, may_start
from omnivox.benchmarks.systems.hf_loading import load_model
from omnivox.benchmarks.workload import BenchRequest


class HFContinuousBatching:
    levels = None

    PAGE_SIZE = 16  # tokens per KV block, as omnivox's default

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype,
        device: str = "cpu",
        kv_tokens: int = 16384,
        max_batch_tokens: int = 512,
    ) -> None:
        """`kv_tokens`: KV cache capacity. Left unset, transformers sizes the cache from the device's free memory,
        which on CPU means 90 % of the machine's RAM."""
        self.name = f"transformers generate_batch ({str(dtype).removeprefix('torch.')})"
        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        self.kv_tokens = kv_tokens
        self.max_batch_tokens = max_batch_tokens
        self.model = None
        self.manager = None

    def start(self) -> None:
        import transformers

        if not hasattr(transformers.GenerationMixin, "generate_batch"):
            raise SystemUnavailable(f"transformers {transformers.__version__} has no generate_batch")
        self.model = load_model(self.model_path, self.dtype, self.device)
        gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1, pad_token_id=0)
        cb = transformers.ContinuousBatchingConfig(
            page_size=self.PAGE_SIZE,
            num_blocks=-(-self.kv_tokens // self.PAGE_SIZE),
            max_batch_tokens=self.max_batch_tokens,
        )
        self.manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        warm = BenchRequest(index=-1, prompt_text="", prompt_token_ids=[1, 2, 3, 4], max_tokens=4)
        trace = self.run([warm], 1, lambda n: None)[0]
        if trace.error:
            raise SystemUnavailable(f"warm-up failed: {trace.error}")

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        traces: dict[str, RequestTrace] = {}
        pending = list(requests)[::-1]
        in_flight: dict[str, BenchRequest] = {}
        serial = 0

        def submit() -> None:
            nonlocal serial
            req = pending.pop()
            rid = f"bench-{req.index}-{serial}"
            serial += 1
            traces[rid] = RequestTrace(
                index=req.index, send_time=time.perf_counter(), prompt_tokens=len(req.prompt_token_ids)
            )
            in_flight[rid] = req
            self.manager.add_request(
                req.prompt_token_ids,
                request_id=rid,
                max_new_tokens=req.max_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )

        while may_start(serial, len(requests), concurrency, deadline) and len(in_flight) < concurrency:
            submit()
        while in_flight:
            result = self.manager.get_result(timeout=1.0)
            if result is None:
                if not self.manager.is_running():
                    for rid in in_flight:
                        traces[rid].error = "generation thread stopped"
                    break
                continue
            if not result.is_finished() or result.request_id not in in_flight:
                continue
            req = in_flight.pop(result.request_id)
            trace = traces[result.request_id]
            if result.error is not None:
                trace.error = str(result.error)
            else:
                trace.token_times = list(result.timestamps or [])
                if trace.num_tokens != req.max_tokens:
                    trace.error = f"asked for {req.max_tokens} tokens, got {trace.num_tokens}"
            progress(1)
            if may_start(serial, len(requests), concurrency, deadline):
                submit()
        return sorted(traces.values(), key=lambda t: t.index)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=10)
            self.manager = None
        self.model = None
