"""The engine stepped by hand: each step's plan and statistics, multi-token verification with rollback, per-request
constraints made by factories, and lazily produced embedding segments."""

from __future__ import annotations

import pytest
import torch
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import EmbeddingSegment, InvalidRequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("steps"), "llama")


@pytest.fixture(scope="module")
def engine(ckpt):
    return tiny_engine(ckpt)


def plan_of(engine) -> tuple:
    engine.step()
    plan = engine.last_step.plan
    return (
        [(c.request.request_id, c.start, c.num_tokens) for c in plan.decodes],
        [(c.request.request_id, c.start, c.num_tokens) for c in plan.prefills],
        [r.request_id for r in plan.preempted],
    )


def test_each_step_plan_budget_order_and_stats(ckpt):
    engine = tiny_engine(ckpt, max_num_batched_tokens=10, max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, n in (("a", 14), ("b", 4), ("c", 2)):
        engine.add_request(list(range(20, 20 + n)), params, request_id=rid)
    assert plan_of(engine) == ([], [("a", 0, 10)], [])  # the budget cuts a's prompt
    assert engine.last_step.stats.num_prefill_tokens == 10 and engine.last_step.stats.num_admitted == 1
    assert plan_of(engine) == ([], [("a", 10, 4), ("b", 0, 4)], [])  # arrival order; then max_num_seqs=2 stops c
    assert engine.last_step.stats.num_waiting == 1
    assert plan_of(engine) == ([("a", 14, 1), ("b", 4, 1)], [], [])
    assert engine.last_step.stats.num_decode_tokens == 2
    assert plan_of(engine) == ([("a", 15, 1), ("b", 5, 1)], [], [])  # both finish at 3 tokens this step
    assert plan_of(engine) == ([], [("c", 0, 2)], [])
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_preemption_picks_the_newest_and_recomputes_it_identically(ckpt):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [list(range(30, 46)), list(range(60, 76))]
    roomy = tiny_engine(ckpt)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    # 16 tokens per block; 4 blocks hold both prompts (1 block each) but not both full answers (3 blocks each).
    small = tiny_engine(ckpt, kv_cache_gib=4 * 16 * small_kv_bytes(roomy) / 2**30, enable_prefix_caching=False)
    assert small.pool.usage().total_blocks == 4
    for i, p in enumerate(prompts):
        small.add_request(p, params, request_id=f"r{i}")
    victims = []
    while small.has_unfinished():
        small.step()
        plan = small.last_step.plan
        victims += [r.request_id for r in plan.preempted]
        if plan.preempted:
            assert plan.admitted == []  # never admits in a step that preempted
    assert victims and set(victims) == {"r1"}  # always the newest
    small.check_integrity()
    assert [o.token_ids for o in small.generate(prompts, params)] == expected


def small_kv_bytes(engine) -> int:
    return engine.model_config.kv_bytes_per_token(4)


def test_a_request_longer_than_the_kv_pool_is_rejected(ckpt):
    engine = tiny_engine(ckpt, kv_cache_gib=3 * 16 * small_kv_bytes(tiny_engine(ckpt)) / 2**30)
    assert engine.model_config.max_model_len == 48  # the context is capped to what the pool holds
    with pytest.raises(InvalidRequest) as err:
        engine.add_request(list(range(10, 60)), GREEDY)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=40))
    assert err.value.field == "max_tokens"
    out = engine.generate([list(range(10, 40))], SamplingParams(temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 18  # runs to the end of the context, once
    assert engine.num_steps < 40  # no preempt/recompute loop


class ScriptedDrafts:
    """Proposes the next k tokens of a known continuation, optionally corrupted (then only the first is accepted)."""

    def __init__(self, continuation: dict[str, list[int]], k: int, wrong: bool) -> None:
        self.continuation, self.k, self.wrong = continuation, k, wrong
        self.proposed = 0

    def __call__(self, req) -> list[int]:
        future = self.continuation.get(req.request_id, [])[req.num_output_tokens : req.num_output_tokens + self.k]
        self.proposed += len(future)
        return [(t + 1) % 384 for t in future] if self.wrong else future


@pytest.mark.parametrize("wrong", [True, False], ids=["verify3-accept1", "verify3-accept3"])
def test_multi_token_cycle_gives_the_plain_tokens_and_a_whole_pool(ckpt, engine, wrong):
    prompts = {"p0": list(range(11, 30)), "p1": list(range(40, 45))}
    plain = {rid: engine.generate([p], GREEDY)[0].token_ids for rid, p in prompts.items()}
    drafts = ScriptedDrafts(plain, k=2, wrong=wrong)
    spec = tiny_engine(ckpt, proposer=drafts)
    for rid, p in prompts.items():
        spec.add_request(p, GREEDY, request_id=rid)
    got: dict[str, list[int]] = {}
    drafted = accepted = steps = 0
    while spec.has_unfinished():
        for out in spec.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        stats = spec.last_step.stats
        drafted, accepted, steps = drafted + stats.num_drafted, accepted + stats.num_accepted, steps + 1
        for req in spec.scheduler.running:  # blocks held = what the committed tokens need, after every step
            assert len(req.block_table) <= -(-req.num_tokens // spec.block_size)
            assert req.num_registered_blocks * spec.block_size <= req.num_computed_tokens < req.num_tokens
    assert got == plain
    assert 0 < drafted <= drafts.proposed  # drafts that would pass max_tokens are cut before the step
    assert accepted == (0 if wrong else drafted)
    if not wrong:
        assert steps < 20  # three tokens per step
    spec.check_integrity()
    assert spec.pool.num_free == spec.pool.usage().total_blocks
    # Nothing a draft touched entered the prefix cache: a fresh run of the same prompts hits only committed blocks.
    again = spec.generate([prompts["p0"]], GREEDY)[0]
    assert again.token_ids == plain["p0"] and again.num_cached_tokens == 16


class CountingConstraint:
    """A stateful constraint: allows only tokens below `limit`, and remembers what it was told (advance)."""

    made: list[CountingConstraint] = []

    def __init__(self, limit: int = 100) -> None:
        self.limit, self.seen = limit, []
        self.mask = torch.arange(384) < limit
        CountingConstraint.made.append(self)

    def allowed(self, output_token_ids):
        assert output_token_ids == self.seen, "the constraint's state must follow its own request only"
        return self.mask

    def advance(self, token_ids):
        self.seen.extend(token_ids)

    def rollback(self, n):
        del self.seen[len(self.seen) - n :]


def test_one_params_for_many_prompts_never_shares_a_constraint(engine):
    CountingConstraint.made = []
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, constraint_factory=CountingConstraint
    )
    outs = engine.generate([[5, 6, 7], [8, 9, 10, 11], [12]], params)
    assert len(CountingConstraint.made) == 3
    assert len({id(c) for c in CountingConstraint.made}) == 3
    for out, c in zip(outs, CountingConstraint.made, strict=True):
        assert c.seen == out.token_ids and all(t < 100 for t in out.token_ids)


def test_segments_are_produced_lazily_and_skipped_on_a_prefix_hit(ckpt):
    engine = tiny_engine(ckpt)
    prompt = list(range(10, 60))  # 50 tokens
    real = engine.embed_tokens(list(range(200, 220)))
    calls = []

    def encoder():
        calls.append(1)
        return real

    def segment():
        return EmbeddingSegment(start=8, num_tokens=20, key="image:abc", produce=encoder)

    seg = segment()
    engine.add_request(prompt, GREEDY, segments=[seg])
    assert calls == []  # admission needs only the key
    first = engine.generate([prompt], GREEDY, segments=[[segment()]])[0]
    while engine.has_unfinished():
        engine.step()
    assert len(calls) == 2  # each request produced its own embeddings once, when its prefill reached them
    # Same input again: its blocks (0..47, covering the whole segment at 8..28) come from the prefix cache.
    again = engine.generate([prompt], GREEDY, segments=[[segment()]])[0]
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    assert len(calls) == 2  # the encoder was never asked
    # The same tokens with the embeddings spliced as ready tensors give the same tokens (the lazy path is the path).
    ready = EmbeddingSegment.from_embeds(8, real, key="image:other")
    assert engine.generate([prompt], GREEDY, segments=[[ready]])[0].token_ids == first.token_ids
    engine.check_integrity()


def test_a_segment_key_decides_the_cache_hit(ckpt):
    engine = tiny_engine(ckpt)
    prompt = list(range(10, 60))
    a = engine.embed_tokens(list(range(200, 220)))
    b = torch.randn_like(a)
    first = engine.generate([prompt], GREEDY, segments=[[EmbeddingSegment.from_embeds(8, a, key="k1")]])[0]
    other = engine.generate([prompt], GREEDY, segments=[[EmbeddingSegment.from_embeds(8, b, key="k2")]])[0]
    assert other.num_cached_tokens == 0  # block 0 covers the segment: another key, another block
    assert other.token_ids != first.token_ids
