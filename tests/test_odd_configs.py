"""Every decoder family served with odd engine settings, many clients at once: one sequence at a time, a KV cache so
small that requests wait and are preempted, prefill chunks of a few tokens, prefix caching off. Greedy answers must
equal the same requests sent one by one, and every KV block must come back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from checkpoints import make_checkpoint
from service_harness import ServerThread, user_request

from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

PROMPTS = [("word " * n + f"number {n}").strip() for n in (1, 2, 4, 6, 9, 12, 15, 18)]
CONFIGS = {
    "one-seq-tiny-chunks": dict(max_num_seqs=1, max_num_batched_tokens=8),
    # 12 KV blocks of 16 tokens (kv_cache_gib set per family below): 2-3 of these requests at once, the rest wait
    # or are preempted
    "tiny-kv-preempts": dict(max_num_seqs=8, max_num_batched_tokens=16),
    "no-prefix-cache": dict(max_num_seqs=4, max_num_batched_tokens=24),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "tiny", family=request.param, seed=3)
    head_dim = 32 if request.param == "qwen3" else 16  # tests/checkpoints.py: 2 layers, 2 KV heads, float32
    return path, 12 * 16 * (2 * 2 * 2 * head_dim * 4) / 2**30


def _answer(stub, prompt: str) -> list[int]:
    request = user_request(prompt, max_output_tokens=24, ignore_eos=True)
    request.sampling.temperature = 0.0
    ids = []
    for response in stub.Generate(request, timeout=120):
        if response.WhichOneof("response") == "delta":
            ids += response.delta.token_ids
        else:
            assert response.summary.usage.output_tokens == 24
    return ids


@pytest.mark.parametrize("config", list(CONFIGS))
def test_concurrent_answers_equal_one_by_one(checkpoint, config):
    path, twelve_blocks_gib = checkpoint
    options = EngineOptions(**CONFIGS[config], kv_cache_gib=twelve_blocks_gib if config == "tiny-kv-preempts" else None)
    with ServerThread([ModelSpec(path=path, name="m")], options) as server:
        engine = server.engine("m")
        if config == "no-prefix-cache":
            engine.core.pool.enable_prefix_caching = False
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        alone = [_answer(stub, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            together = list(pool.map(lambda p: _answer(stub, p), PROMPTS * 2))
        assert together == alone * 2
        if config == "tiny-kv-preempts":
            assert engine.core.scheduler.num_preemptions > 0  # the setting did what it is for
        free, total = server.wait_kv_free("m", timeout=5.0)
        assert free == total
        engine.core.check_integrity()
