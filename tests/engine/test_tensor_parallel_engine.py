"""The engine over 2 tensor-parallel ranks (engine/tensor_parallel.py; gloo on CPU) against the same engine in one
process, on tiny random Llama, Qwen2 and Qwen3 checkpoints: four greedy requests of different lengths batched, with
chunked prefill (a 24-token step budget), one carrying an embedding segment, one cancelled mid-batch; Qwen3 decodes
through FlexAttention. Every step's logits agree within 1e-5 and every request's 32 tokens are identical; afterwards
the pool is whole on rank 0 (check_integrity, every block free) and every rank's cache holds, at each slot, its heads
of exactly what the single process holds there (the ranks' caches joined along the head axis equal the single cache
within 1e-5). The worker process is gone after shutdown; a worker killed while serving stops the engine (its
requests end "error", the failure observers hear).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.checkpoints import make_checkpoint

from omnivox.engine import EmbeddingSegment, Engine, SamplingParams
from omnivox.engine.tensor_parallel import TensorParallelModel
from omnivox.models.tensor_parallel import check_world
from omnivox.models.tensor_parallel_worker import portable, rebuild_masks, without_decode_mask

PROMPTS = [
    [1, 17, 42, 99, 7],
    [1, *range(300, 340)],  # 41 tokens: two prefill chunks, three blocks
    [1, 5, 6, 8, 13, 21, 34, 55, 89, 144, 233],
    [1, *range(50, 70)],
]
NEW_TOKENS = 32
CANCEL = 2  # PROMPTS[CANCEL] is aborted ...
CANCEL_AT_STEP = 8  # ... after this many steps
KV_GIB = 0.0006  # the single process's cache; each rank holds half the heads, so half the bytes for the same blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-engine")
    return {f: make_checkpoint(root / f, family=f, with_tokenizer=False) for f in ("llama", "qwen2", "qwen3")}


def run(engine: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Step the engine by hand: every request's tokens, and every step's logits [rows, vocab]. The last request
    carries an embedding segment (as an image's would: rank 0's embeddings replace rows on every rank)."""
    step_logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(plan, *args):
        logits, sampling = execute(plan, *args)
        if logits is not None:
            step_logits.append(logits.clone())
        return logits, sampling

    engine.runner.execute = recording
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    embeds = torch.randn(10, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    segments = [None] * (len(PROMPTS) - 1) + [[EmbeddingSegment.from_embeds(4, embeds * 0.02)]]
    ids = [engine.add_request(p, params, segments=s) for p, s in zip(PROMPTS, segments, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
        steps += 1
        if steps == CANCEL_AT_STEP:
            engine.abort(ids[CANCEL])
    return [tokens[i] for i in ids], step_logits


# Qwen3 decodes through FlexAttention (eager on the CPU): its block mask travels as what rebuilds it on the worker.
@pytest.mark.parametrize(("family", "decode_attention"), [("llama", "native"), ("qwen2", "native"), ("qwen3", "flex")])
def test_two_ranks_serve_as_one(checkpoints: dict[str, Path], family: str, decode_attention: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned rank
    kwargs = dict(device="cpu", dtype="float32", max_num_batched_tokens=24, max_num_seqs=len(PROMPTS))
    single = Engine.from_pretrained(checkpoints[family], kv_cache_gib=KV_GIB, **kwargs)
    single.runner.set_decode_attention(decode_attention)
    metas = []  # what the runner passes the model: a worker rebuilds the dense decode mask left out of the message
    single.model.register_forward_pre_hook(lambda _m, args: metas.append(args[3]))
    want_tokens, want_logits = run(single)
    for meta in metas:
        if meta.num_decode:
            sent = portable(without_decode_mask(meta), None)
            assert sent.decode_mask is None and meta.decode_mask is not None
            rebuild_masks(sent)
            assert torch.equal(sent.decode_mask, meta.decode_mask)
    tp = Engine.from_pretrained(checkpoints[family], kv_cache_gib=KV_GIB / 2, tensor_parallel=2, **kwargs)
    tp.runner.set_decode_attention(decode_attention)
    try:
        ids = [1, 200, 383]
        torch.testing.assert_close(tp.embed_tokens(ids), single.embed_tokens(ids), atol=0, rtol=0)
        model = tp.model
        assert isinstance(model, TensorParallelModel)
        assert tp.pool.usage().total_blocks == single.pool.usage().total_blocks
        assert tp.runner.kv_caches[0][0].shape[1] == single.runner.kv_caches[0][0].shape[1] // 2  # its KV heads
        got_tokens, got_logits = run(tp)
        assert got_tokens == want_tokens
        assert [len(t) for t in got_tokens] == [
            NEW_TOKENS if i != CANCEL else len(got_tokens[CANCEL]) for i in range(4)
        ]
        assert 0 < len(got_tokens[CANCEL]) < NEW_TOKENS  # cancelled mid-batch
        assert len(got_logits) == len(want_logits)
        for got, want in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        tp.check_integrity()
        assert tp.pool.num_free == tp.pool.usage().total_blocks  # every block back
        joined = model.gather_kv_caches(tp.runner.kv_caches)
        for (k, v), (k1, v1) in zip(joined, single.runner.kv_caches, strict=True):
            assert k.abs().sum() > 0
            torch.testing.assert_close(k, k1, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, v1, atol=1e-5, rtol=0)
        pids = model.worker_pids
        if family == "llama":  # a rank lost while serving: the engine stops (crash-only), nothing hangs
            failures: list[Exception] = []
            tp.failure_observers.append(failures.append)
            os.kill(pids[0], signal.SIGKILL)
            tp.start()  # the stepping thread: where a failed step stops the engine
            [out] = tp.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
            assert out.finish_reason == "error"
            deadline = time.monotonic() + 30
            while not failures and time.monotonic() < deadline:
                time.sleep(0.01)
            assert failures and tp.failure is not None and "tensor-parallel" in str(tp.failure)
    finally:
        tp.shutdown()
    for pid in pids:  # reaped by close(): no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_heads_and_devices_checked(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="--tensor-parallel 3 does not divide the model's attention heads"):
        check_world(checkpoints["llama"], 3, torch.device("cpu"))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="--tensor-parallel 2 needs 2 GPUs"):
            check_world(checkpoints["llama"], 2, torch.device("cuda"))
