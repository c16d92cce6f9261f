"""Every decoder family served with odd engine settings, many clients at once: one sequence at a time, a KV cache so
small that requests wait and are preempted, prefill chunks of a few tokens, prefix caching off. Greedy answers must
equal the same requests sent one by one, and every KV block must come back."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.audio_checkpoints import encode, make_qwen2_audio, tone
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request
from support.vision_checkpoints import make_qwen2_5_vl, png_bytes, sample_image

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc

PROMPTS = [("word " * n + f"number {n}").strip() for n in (1, 2, 4, 6, 9, 12, 15, 18)]
CONFIGS = {
    "one-seq-tiny-chunks": dict(max_num_seqs=1, max_num_batched_tokens=8),
    # 12 KV blocks of 16 tokens (kv_cache_gib per family, below): 2-3 of these requests at once, the rest wait
    # or are preempted
    "tiny-kv-preempts": dict(max_num_seqs=8, max_num_batched_tokens=16),
    "no-prefix-cache": dict(max_num_seqs=4, max_num_batched_tokens=24),
    # n-gram drafts verified while requests are preempted and recomputed; int8 weights on the block kernels
    "ngram-spec-tiny-kv": dict(max_num_seqs=8, max_num_batched_tokens=16, speculative="ngram"),
    "int8-one-seq": dict(max_num_seqs=1, max_num_batched_tokens=8, quantization="int8"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's tiny checkpoint and the kv_cache_gib of 12 blocks for it."""
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        path = make_checkpoint(tmp_path_factory.mktemp(family) / "tiny", family=family, seed=3)
        head_dim = 32 if family == "qwen3" else 16  # tests/support/checkpoints.py: 2 layers, 2 KV heads, float32
        out[family] = (path, 12 * 16 * (2 * 2 * 2 * head_dim * 4) / 2**30)
    return out


# Every family under preemption; the other settings one family each (each server run costs ~3 s on 2 cores).
CASES = [("llama", "tiny-kv-preempts"), ("qwen2", "tiny-kv-preempts"), ("qwen3", "tiny-kv-preempts"),
         ("qwen2", "one-seq-tiny-chunks"), ("qwen3", "no-prefix-cache"), ("llama", "ngram-spec-tiny-kv"),
         ("qwen3", "int8-one-seq")]  # fmt: skip


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


@pytest.mark.parametrize(("family", "config"), CASES)
def test_concurrent_answers_equal_one_by_one(checkpoints, family, config):
    path, twelve_blocks_gib = checkpoints[family]
    options = EngineOptions(**CONFIGS[config], kv_cache_gib=twelve_blocks_gib if "tiny-kv" in config else None)
    with ServerThread([ModelSpec(path=path, name="m")], options) as server:
        engine = server.engine("m")
        if config == "no-prefix-cache":
            engine.core.pool.enable_prefix_caching = False
        drafted = []
        engine.step_observers.append(lambda result: drafted.append(result.stats.num_drafted))
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        alone = [_answer(stub, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            together = list(pool.map(lambda p: _answer(stub, p), PROMPTS * 2))
        assert together == alone * 2
        if "spec" in config:
            assert sum(drafted) > 0  # drafts were verified
        if "tiny-kv" in config:
            assert engine.core.scheduler.num_preemptions > 0  # the setting did what it is for
        free, total = server.wait_kv_free("m", timeout=5.0)
        assert free == total
        engine.core.check_integrity()


# Checked by hand also for LLaVA and SmolVLM (same result); here the image family with M-RoPE positions and audio.
MULTIMODAL = {"qwen2.5-vl": make_qwen2_5_vl, "qwen2-audio": make_qwen2_audio}


@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_multimodal_under_preemption_and_tiny_chunks(tmp_path, family):
    """Image and audio prompts, 8-token prefill chunks (they stop short of a segment being encoded) and a KV cache of
    one request and 3 blocks (4-8 preemptions measured): 12 concurrent greedy answers equal the one-by-one ones, every
    KV block and encoder-cache reference returns."""
    path = MULTIMODAL[family](tmp_path / family)
    audio = family == "qwen2-audio"
    media = [encode(tone(0.3 + 0.1 * i, freq=300 + 50 * i), 16000, "WAV") if audio
             else png_bytes(sample_image(30 + 7 * i, 40 + 3 * i, seed=i)) for i in range(6)]  # fmt: skip

    def request(i: int) -> generation_pb2.GenerateRequest:
        part = (content_pb2.Part(audio=content_pb2.AudioPart(data=media[i])) if audio
                else content_pb2.Part(image=content_pb2.ImagePart(data=media[i])))  # fmt: skip
        r = generation_pb2.GenerateRequest(
            contents=[content_pb2.Content(parts=[part, content_pb2.Part(text=f"what {i}?")])],
            max_output_tokens=12,
            ignore_eos=True,
        )
        r.sampling.temperature = 0.0
        return r

    with ServerThread([ModelSpec(path=path, name="m")], EngineOptions()) as server:  # the longest prompt, sized
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        longest = max(list(stub.Generate(request(i)))[-1].summary.usage.prompt_tokens for i in range(6)) + 12
        per_token = server.engine("m").model_config.kv_bytes_per_token(4)
    blocks = math.ceil(longest / 16) + 3
    options = EngineOptions(kv_cache_gib=blocks * 16 * per_token / 2**30, max_num_batched_tokens=8, max_num_seqs=8)
    with ServerThread([ModelSpec(path=path, name="m")], options) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())

        def answer(i: int) -> list[int]:
            out = list(stub.Generate(request(i), timeout=120))
            return [t for r in out if r.WhichOneof("response") == "delta" for t in r.delta.token_ids]

        alone = [answer(i) for i in range(6)]
        engine = server.engine("m")
        # How many requests overlap depends on when each reaches the engine (its media decoded and encoded first):
        # 2-8 preemptions a round measured on 2 cores, and 0 once in a CI run. Rounds until one preempts (at most 4);
        # every round's answers must equal the one-by-one ones.
        for _ in range(4):
            with ThreadPoolExecutor(12) as pool:
                together = list(pool.map(answer, list(range(6)) * 2))
            assert together == alone * 2
            if engine.core.scheduler.num_preemptions > 0:
                break
        assert engine.core.scheduler.num_preemptions > 0
        free, total = server.wait_kv_free("m", timeout=5.0)
        assert free == total
        engine.core.check_integrity()
        bundle = server.registry.lookup("m").bundle
        cache = (bundle.audio if audio else bundle.vision).cache
        deadline = time.monotonic() + 2.0
        while cache.total_refs() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.total_refs() == 0
