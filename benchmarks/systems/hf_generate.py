"""Peer: transformers `generate`, one request at a time (concurrency 1) and in static batches of `concurrency`.

A static batch starts together and ends when its longest request ends; the next batch waits for it. Token times come
from a stopping criterion called once per decode step, i.e. as if `generate` streamed (it does not: a real caller
sees nothing until the batch returns, so these TTFTs are generous). Only the tokens each request asked for count.
"""

from __future__ import annotations

import math
import time

import torch

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.systems.base import Progress
from omnivox.benchmarks.systems.hf_loading import load_model
from omnivox.benchmarks.workload import BenchRequest


class _StepClock:
    """A StoppingCriteria that never stops, recording the time of every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFGenerate:
    levels = None

    def __init__(self, model_path: str, dtype: torch.dtype, device: str = "cpu", pad_token_id: int = 0) -> None:
        self.name = f"transformers generate ({str(dtype).removeprefix('torch.')})"
        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        self.pad_token_id = pad_token_id
        self.model = None

    def start(self) -> None:
        self.model = load_model(self.model_path, self.dtype, self.device)
        warm = BenchRequest(index=-1, prompt_text="", prompt_token_ids=[1, 2, 3, 4], max_tokens=4)
        self._batch([warm, warm])

    def _batch(self, batch: list[BenchRequest]) -> list[RequestTrace]:
        from transformers import StoppingCriteriaList

        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends where generation starts
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        clock = _StepClock()
        steps = max(r.max_tokens for r in batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=steps,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,  # ignore_eos: every row runs to max_new_tokens
                pad_token_id=self.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        if self.device != "cpu":
            torch.cuda.synchronize()
        if len(clock.times) < steps:  # generate stopped early: EOS was not ignored
            raise RuntimeError(f"generate made {len(clock.times)} steps, asked for {steps}")
        return [
            RequestTrace(
                index=r.index,
                send_time=t0,
                token_times=clock.times[: r.max_tokens],
                prompt_tokens=len(r.prompt_token_ids),
            )
            for r in batch
        ]

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        traces = []
        for start in range(0, len(requests), concurrency):
            if start > 0 and time.perf_counter() >= deadline:
                break
            batch = requests[start : start + concurrency]
            traces.extend(self._batch(batch))
            progress(len(batch))
        return traces

    def close(self) -> None:
        self.model = None
