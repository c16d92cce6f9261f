"""KV blocks behind a sliding window are released (every layer slides): a long generation holds about the window's
blocks, computes exactly what it computed holding them all (and what transformers computes), and the prefix cache,
preemption and the pool's bookkeeping stay right."""

from __future__ import annotations

import pytest
from support.checkpoints import load_reference, reference_greedy
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams
from omnivox.engine.request import Status

WINDOW = 32
BLOCK = 16
# Blocks one request holds after a step: those a decode query's window touches (ceil(W / bs) + 1 at any alignment).
WINDOW_BLOCKS = -(-WINDOW // BLOCK) + 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("swa"), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def engine(ckpt):
    return tiny_engine(ckpt)


@pytest.fixture(scope="module")
def keeping(ckpt):
    """The same model holding every block (what the engine did before blocks behind the window were released)."""
    eng = tiny_engine(ckpt)
    eng.core.kv.sliding_window = None
    return eng


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """Generate greedily; returns the tokens and the most blocks the pool had in use after a decode-only step (a
    prefill chunk holds every block it writes, window or not)."""
    ids = [engine.add_request(p, greedy(n)) for p in prompts]
    out: dict[str, list[int]] = {}
    peak = 0
    total = engine.kv_usage().total_blocks
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        if not engine.last_step.plan.prefills:
            peak = max(peak, total - engine.kv_usage().free_blocks)
        engine.check_integrity()
    assert engine.kv_usage().free_blocks == total
    return [out[i] for i in ids], peak


def test_a_long_decode_holds_the_window_and_equals_holding_everything(engine, keeping):
    prompts = [list(range(3, 43)), list(range(100, 170))]
    ours, peak = run(engine, prompts, 200)
    theirs, peak_keeping = run(keeping, prompts, 200)
    assert ours == theirs
    assert peak <= 2 * WINDOW_BLOCKS  # both requests: their windows' blocks, whatever the length
    assert peak_keeping >= (40 + 200) // BLOCK + (70 + 200) // BLOCK


def test_parity_with_transformers_past_the_window(ckpt, engine):
    prompt = list(range(5, 25))
    (ours,), peak = run(engine, [prompt], 60)  # 80 positions: blocks 0-2 are released on the way
    assert peak <= WINDOW_BLOCKS
    tokens, _ = reference_greedy(load_reference(ckpt), prompt, 60)
    assert ours == tokens


def test_released_blocks_become_null_entries_and_the_pool_gets_them_back(engine):
    rid = engine.add_request(list(range(7, 27)), greedy(80))
    req = engine._requests[rid]
    total = engine.kv_usage().total_blocks
    seen_skipped = 0
    while engine.has_unfinished():
        engine.step()
        if req.status != Status.RUNNING:
            break
        engine.check_integrity()  # null entries exactly the skipped ones; references match the live entries
        live = len(req.block_table) - req.num_skipped_blocks
        assert live <= WINDOW_BLOCKS
        assert total - engine.kv_usage().free_blocks == live
        # every key the next query reads (from num_computed - window + 1 on) is in a live block
        assert req.num_skipped_blocks * BLOCK <= max(0, req.num_computed_tokens - WINDOW + 1)
        seen_skipped = req.num_skipped_blocks
    assert seen_skipped >= (20 + 80 - WINDOW) // BLOCK - 1
    assert engine.kv_usage().free_blocks == total


def test_prefix_cache_after_release_and_after_eviction(ckpt, engine, keeping):
    """A later request with the same prompt is served from cached blocks that a long generation released (their
    content is still what their hash says) and computes the same tokens; in a pool so small that the released blocks
    were reused, the evicted hashes are never hits and the tokens are still the same."""
    prompt = list(range(200, 300))  # 6 full blocks a repeat can hit
    (expected,), _ = run(keeping, [prompt], 120)
    (first,), _ = run(engine, [prompt], 120)
    rid = engine.add_request(prompt, greedy(120))
    while engine.has_unfinished():
        outs = engine.step()
    (final,) = [o for o in outs if o.request_id == rid]
    assert first == expected and final.token_ids == expected
    assert final.num_cached_tokens == 96  # blocks released behind the window while `first` ran are still cached
    small = tiny_engine(ckpt, kv_cache_gib=8 * BLOCK * ckpt_kv_bytes(engine) / 2**30)
    assert small.kv_usage().total_blocks == 8
    prompt = list(range(200, 260))
    (short,), _ = run(keeping, [prompt], 60)
    (a,), _ = run(small, [prompt], 60)  # 120 positions on 8 blocks: the first blocks are reused on the way
    rid = small.add_request(prompt, greedy(60))
    while small.has_unfinished():
        outs = small.step()
    (b,) = [o for o in outs if o.request_id == rid]
    assert a == short and b.token_ids == short
    small.check_integrity()


def test_preemption_and_recompute_with_released_blocks(ckpt, engine, keeping):
    """Three long requests on a pool of 7 blocks: they preempt each other; each is recomputed from whatever the
    prefix cache still holds and ends with the tokens it computes alone."""
    prompts = [list(range(10 + 40 * i, 50 + 40 * i)) for i in range(3)]
    expected, _ = run(keeping, prompts, 60)
    small = tiny_engine(ckpt, kv_cache_gib=7 * BLOCK * ckpt_kv_bytes(engine) / 2**30, max_num_batched_tokens=32)
    assert small.kv_usage().total_blocks == 7
    ours, _ = run(small, prompts, 60)
    assert ours == expected
    assert small.core.scheduler.num_preemptions > 0


def ckpt_kv_bytes(engine) -> int:
    return engine.model_config.kv_bytes_per_token(4)


def test_mixed_full_and_sliding_layers_keep_every_block(tmp_path_factory):
    """Qwen2 with only its top layer sliding: the full-attention layer reads every block, so none is released."""
    path = tiny_checkpoint(
        tmp_path_factory.mktemp("mixed"), "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    eng = tiny_engine(path)
    assert eng.model_config.sliding_layers == (1,) and eng.core.kv.sliding_window is None
    (tokens,), peak = run(eng, [list(range(3, 23))], 60)
    assert peak == -(-(20 + 60 - 1) // BLOCK)
    assert tokens == reference_greedy(load_reference(path), list(range(3, 23)), 60)[0]


def test_grpc_a_pool_smaller_than_the_context_serves_the_whole_length(ckpt, keeping):
    """Through the gRPC API: a pool of 10 blocks (160 tokens) serves a 300-token answer of a window-32 model, since
    a request holds at most one step's window plus its chunk; the context is not capped to the pool (it was: 160)."""
    from support.service_harness import ServerThread, user_request

    from omnivox.services.parts.loading import EngineOptions, ModelSpec
    from omnivox.v1 import generation_pb2_grpc

    gib = 10 * BLOCK * ckpt_kv_bytes(keeping) / 2**30
    text = "The capital of France is Paris."
    with ServerThread(
        [ModelSpec(path=ckpt, name="swa")], EngineOptions(kv_cache_gib=gib, max_num_batched_tokens=32)
    ) as srv:
        engine = srv.engine("swa")
        assert engine.kv_usage().total_blocks == 10 and engine.model_config.max_model_len == 512
        request = user_request(text, max_output_tokens=300, ignore_eos=True)
        request.sampling.temperature = 0.0
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        responses = list(stub.Generate(request, timeout=120))
        tokens = [t for r in responses if r.WhichOneof("response") == "delta" for t in r.delta.token_ids]
        summary = responses[-1].summary
        assert srv.wait_kv_free("swa") == (10, 10)
        engine.check_integrity()
    prompt = keeping.tokenizer.encode(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    (expected,), _ = run(keeping, [prompt], 300)
    assert summary.usage.output_tokens == 300 and tokens == expected


def test_a_follow_up_hits_the_window_blocks_after_its_first_blocks_were_evicted(ckpt, keeping):
    """Multi-turn on a pool of 8 blocks: the first turn's early blocks are reused while it generates, its last ones
    stay cached. The next turn (its prompt = the first turn's tokens + more) is served from the cached blocks its
    window reads, with no block 0 in the cache, and computes what a roomy engine computes."""
    small = tiny_engine(ckpt, kv_cache_gib=8 * BLOCK * ckpt_kv_bytes(keeping) / 2**30, max_num_batched_tokens=32)
    assert small.kv_usage().total_blocks == 8 and small.model_config.max_model_len == 512
    first = list(range(200, 250))
    rid = small.add_request(first, greedy(150))  # 200 positions: 13 blocks on a pool of 8
    turn = small._requests[rid]
    outs = []
    while small.has_unfinished():
        outs += small.step()
    answer = outs[-1].token_ids
    assert small.pool.lookup(turn.block_hashes[0]) is None  # block 0 was reused: evicted from the cache
    follow_up = first + answer + list(range(300, 310))
    rid = small.add_request(follow_up, greedy(20))
    req = small._requests[rid]
    small.step()
    assert req.num_cached_tokens >= WINDOW and req.num_skipped_blocks > 0  # served from its window's blocks
    while small.has_unfinished():
        outs = small.step()
    (final,) = [o for o in outs if o.request_id == rid]
    (expected,), _ = run(keeping, [follow_up], 20)
    assert final.token_ids == expected and final.num_cached_tokens == req.num_cached_tokens
    small.check_integrity()
