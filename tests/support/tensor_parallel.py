"""Two tensor-parallel ranks (gloo on CPU) against one process: the same greedy tokens, and each rank's peak KV use."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from omnivox.engine import Engine, SamplingParams

PROMPTS = [[1, *range(40, 90)], [1, 5, 6, 8, 13, 21, 34]]


KV_GIB = 0.0006


def tokens_and_peak(engine: Engine, n: int) -> tuple[list[list[int]], int]:
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p in PROMPTS]
    out: dict[str, list[int]] = {}
    total, peak = engine.kv_usage().total_blocks, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        if not engine.last_step.plan.prefills:
            peak = max(peak, total - engine.kv_usage().free_blocks)
    engine.check_integrity()
    return [out[i] for i in ids], peak


def two_ranks_equal_one(path: Path, n: int, tp_kv_gib: float = KV_GIB / 2) -> tuple[int, int]:
    """Greedy tokens of 2 ranks == 1 process, and every rank's cache holds its heads of what the one process holds
    (joined along the head axis); returns the decode peaks of blocks held (one process, 2 ranks)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned rank
    kwargs = dict(device="cpu", dtype="float32", max_num_batched_tokens=24)
    single = Engine.from_pretrained(path, kv_cache_gib=KV_GIB, **kwargs)
    want, peak_single = tokens_and_peak(single, n)
    tp = Engine.from_pretrained(path, kv_cache_gib=tp_kv_gib, tensor_parallel=2, **kwargs)
    try:
        assert tp.pool.usage().total_blocks == single.pool.usage().total_blocks
        got, peak_tp = tokens_and_peak(tp, n)
        assert tp.pool.num_free == tp.pool.usage().total_blocks
        joined = tp.model.gather_kv_caches(tp.runner.kv_caches)
    finally:
        tp.shutdown()
    assert got == want
    for (k, v), (k1, v1) in zip(joined, single.runner.kv_caches, strict=True):
        torch.testing.assert_close(k, k1, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v1, atol=1e-5, rtol=0)
    return peak_single, peak_tp
