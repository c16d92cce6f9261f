"""Scheduler and KV manager on tiny shapes, no model: each step's plan and each block, exactly (like vLLM's
tests/v1/core). `run_plan` plays the core's part: computed positions advance, sampling chunks append one token."""

from __future__ import annotations

from omnivox.engine.block_pool import BlockPool
from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.params import SamplingParams
from omnivox.engine.request import EmbeddingSegment, Request, Status
from omnivox.engine.scheduler import SchedulePlan, Scheduler
from omnivox.engine.step_budget import StepBudget

BS = 4


def make(num_blocks: int = 8, max_seqs: int = 4, budget: int = 8, prefix: bool = True, mixed: StepBudget | None = None):
    pool = BlockPool(num_blocks, BS, prefix)
    kv = KVCacheManager(pool)
    return pool, kv, Scheduler(kv, max_seqs, budget, mixed)


def req(rid: str, n: int, first: int = 10, max_tokens: int = 100, segments=()) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(), max_tokens, (2,), segments=list(segments))


def run_plan(kv: KVCacheManager, plan: SchedulePlan, token: int = 7) -> None:
    for c in plan.chunks:
        c.request.num_computed_tokens = min(c.end, c.request.num_tokens)
        kv.commit_computed(c.request)
    for c in plan.chunks:
        if c.samples:
            c.request.output_token_ids.append(token)


def shape(plan: SchedulePlan) -> tuple:
    return (
        [(c.request.request_id, c.start, c.num_tokens) for c in plan.decodes],
        [(c.request.request_id, c.start, c.num_tokens) for c in plan.prefills],
        [r.request_id for r in plan.preempted],
    )


def test_budget_chunks_prefills_and_running_requests_go_first():
    pool, kv, sched = make(num_blocks=16, budget=8)
    a, b = req("a", 10), req("b", 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert shape(plan) == ([], [("a", 0, 8)], [])  # the budget cuts a's prompt; b waits its turn in arrival order
    assert [r.request_id for r in plan.admitted] == ["a"]
    assert not plan.prefills[0].samples
    run_plan(kv, plan)
    plan = sched.schedule()
    assert shape(plan) == ([], [("a", 8, 2), ("b", 0, 3)], [])  # a finishes its prompt first, b gets the rest
    assert [c.samples for c in plan.prefills] == [True, True]
    run_plan(kv, plan)
    plan = sched.schedule()
    assert shape(plan) == ([("a", 10, 1), ("b", 3, 1)], [], [])
    assert a.block_table == [0, 1, 2] and b.block_table == [3]  # 11 tokens in 3 blocks, 4 tokens in 1
    pool.check_integrity()


def test_max_num_seqs_bounds_admission():
    _, kv, sched = make(num_blocks=16, max_seqs=2, budget=64)
    for i in range(3):
        sched.add(req(f"r{i}", 2, first=10 * (i + 1)))
    plan = sched.schedule()
    assert shape(plan) == ([], [("r0", 0, 2), ("r1", 0, 2)], [])
    run_plan(kv, plan)
    assert shape(sched.schedule()) == ([("r0", 2, 1), ("r1", 2, 1)], [], [])
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_takes_the_newest_and_admits_nothing_that_step():
    pool, kv, sched = make(num_blocks=4, budget=64)
    a, b = req("a", 8), req("b", 8, first=50)
    sched.add(a)
    sched.add(b)
    run_plan(kv, sched.schedule())  # both prompts: 2 blocks each, the pool is full
    assert pool.num_free == 0
    late = req("late", 1, first=90)
    sched.add(late)
    plan = sched.schedule()  # a's decode needs a third block: b (the newest) is preempted
    assert shape(plan) == ([("a", 8, 1)], [], ["b"])
    assert plan.admitted == []  # the freed blocks are for the running: no admission in a preempting step
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert [r.request_id for r in sched.waiting] == ["b", "late"]  # the victim goes back to the front
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    pool.check_integrity()


def test_prefix_hit_at_admission_and_the_last_token_is_always_computed():
    pool, kv, sched = make(num_blocks=16, budget=64)
    first = req("first", 9)
    sched.add(first)
    run_plan(kv, sched.schedule())
    sched.finish(first, "stop")
    again = req("again", 9)  # same 9 prompt tokens: two full blocks cached
    sched.add(again)
    plan = sched.schedule()
    assert shape(plan) == ([], [("again", 8, 1)], [])
    assert again.num_cached_tokens == 8
    exact = req("exact", 8)  # 8 tokens = 2 full blocks, but its last token must be computed for logits
    sched.add(exact)
    plan = sched.schedule()
    assert ("exact", 4, 4) in shape(plan)[1]
    pool.check_integrity()


def test_segment_keys_are_part_of_the_block_hash():
    _, kv, _ = make()
    seg_a = EmbeddingSegment(1, 2, key="image-a", produce=lambda: None)
    seg_b = EmbeddingSegment(1, 2, key="image-b", produce=lambda: None)
    ra, rb, rc = req("a", 9, segments=[seg_a]), req("b", 9, segments=[seg_b]), req("c", 9, segments=[seg_a])
    for r in (ra, rb, rc):
        kv._extend_hashes(r, 2)
    assert ra.block_hashes[0] != rb.block_hashes[0]  # same tokens, other image: other block
    assert ra.block_hashes == rc.block_hashes
    assert ra.block_hashes[1] != rb.block_hashes[1]  # the chain carries the difference on


def test_cache_salt_separates_prefix_hits():
    """Same tokens, other salt: no hit (vLLM's cache_salt); same salt hits; unsalted requests keep today's hashes."""
    pool, kv, sched = make(num_blocks=16, budget=64)

    def cached(rid: str, salt: str) -> int:
        r = req(rid, 9)
        r.cache_salt = salt
        sched.add(r)
        run_plan(kv, sched.schedule())
        sched.finish(r, "stop")
        return r.num_cached_tokens

    assert cached("alice", "tenant-a") == 0
    assert cached("bob", "tenant-b") == 0  # alice's blocks are cached, but bob's first block hash differs
    assert cached("unsalted", "") == 0
    assert cached("alice-again", "tenant-a") == 8
    assert cached("unsalted-again", "") == 8
    plain = req("plain", 9)
    kv._extend_hashes(plain, 2)
    again = req("again", 9)
    again.cache_salt = "tenant-a"
    kv._extend_hashes(again, 2)
    assert all(a != b for a, b in zip(plain.block_hashes, again.block_hashes, strict=True))  # the chain carries it
    pool.check_integrity()


def test_drafts_are_scheduled_uncommitted_and_rolled_back():
    pool, kv, sched = make(num_blocks=16, budget=64)
    r = req("r", 7)
    sched.add(r)
    run_plan(kv, sched.schedule())  # prompt of 7, first output token appended: 8 tokens, 7 computed
    r.draft_token_ids = [30, 31, 32]
    plan = sched.schedule()
    assert shape(plan) == ([("r", 7, 4)], [], [])  # the last token + 3 drafts, verified together
    assert plan.decodes[0].num_verify == 4
    assert len(r.block_table) == 3  # positions 7..10 reach the third block
    # The step computed all 4 positions; only the last committed one counts before verification.
    r.num_computed_tokens = r.num_tokens
    kv.commit_computed(r)
    assert r.num_registered_blocks == 2  # blocks 0-1 hold 8 committed tokens; the drafts' block is not hashed
    r.draft_token_ids = []
    r.output_token_ids.append(40)  # verification accepted no draft: one new token
    kv.rollback(r, r.num_tokens - 1)
    assert len(r.block_table) == 2 and r.num_computed_tokens == 8
    sched.finish(r, "stop")
    pool.check_integrity()
    assert pool.num_free == 16


def test_drafts_beyond_the_budget_are_dropped():
    _, kv, sched = make(num_blocks=16, budget=3)
    r = req("r", 2)
    sched.add(r)
    run_plan(kv, sched.schedule())
    r.draft_token_ids = [30, 31, 32, 33]
    plan = sched.schedule()
    assert shape(plan) == ([("r", 2, 3)], [], [])
    assert r.draft_token_ids == [30, 31]


def test_allocation_failure_changes_nothing():
    pool, kv, _ = make(num_blocks=2)
    r = req("r", 12)
    assert not kv.allocate(r, 12)  # needs 3 blocks of 4
    assert r.block_table == [] and pool.num_free == 2
    assert kv.allocate(r, 8) and r.block_table == [0, 1]
    kv.free(r)
    assert pool.num_free == 2 and list(pool.free) == [1, 0]  # tail first: the last block is evicted first


def test_mixed_step_budget_bounds_prefill_while_decodes_run():
    """Two decodes running: a step carries at most 6 tokens (2 decodes + 4 prompt tokens); the prompt still progresses
    every step; a step with no decode in it takes the whole 16."""
    _, kv, sched = make(num_blocks=32, max_seqs=8, budget=16, mixed=StepBudget(16, 6, min_prefill_tokens=1))
    sched.add(req("d1", 2))
    sched.add(req("d2", 2, first=40))
    plan = sched.schedule()
    assert shape(plan) == ([], [("d1", 0, 2), ("d2", 0, 2)], [])
    run_plan(kv, plan)
    sched.add(req("p", 12, first=60))
    plans = []
    for _ in range(3):
        plans.append(shape(plan := sched.schedule()))
        run_plan(kv, plan)
    assert plans == [
        ([("d1", 2, 1), ("d2", 2, 1)], [("p", 0, 4)], []),
        ([("d1", 3, 1), ("d2", 3, 1)], [("p", 4, 4)], []),
        ([("d1", 4, 1), ("d2", 4, 1)], [("p", 8, 4)], []),
    ]
    alone = make(num_blocks=32, max_seqs=8, budget=16, mixed=StepBudget(16, 6, min_prefill_tokens=1))[2]
    alone.add(req("p", 12, first=60))
    assert shape(alone.schedule()) == ([], [("p", 0, 12)], [])  # no decode waiting: the whole prompt in one step


def test_mixed_step_budget_keeps_a_minimum_of_prefill_and_admissions_share_it():
    """Four decodes fill a 4-token mixed budget: prompts still get min_prefill_tokens (3) a step, the running
    prefill first, then an admission takes what is left of those 3."""
    _, kv, sched = make(num_blocks=32, max_seqs=8, budget=16, mixed=StepBudget(16, 4, min_prefill_tokens=3))
    for i in range(4):
        sched.add(req(f"d{i}", 1, first=10 * (i + 1)))
    run_plan(kv, sched.schedule())
    sched.add(req("p", 2, first=70))
    sched.add(req("q", 5, first=80))
    plan = sched.schedule()
    decodes = [(f"d{i}", 1, 1) for i in range(4)]
    assert shape(plan) == (decodes, [("p", 0, 2), ("q", 0, 1)], [])
    assert [r.request_id for r in plan.admitted] == ["p", "q"]
    run_plan(kv, plan)
    plan = sched.schedule()  # p decodes now (5 decode tokens): q alone gets the 3
    assert shape(plan) == ([(f"d{i}", 2, 1) for i in range(4)] + [("p", 2, 1)], [("q", 1, 3)], [])


def test_without_a_mixed_budget_the_plan_is_todays():
    """StepBudget(max) alone (the default) changes nothing: decodes and a prompt share max_num_batched_tokens."""
    _, kv, sched = make(num_blocks=32, max_seqs=8, budget=16)
    sched.add(req("d", 2))
    run_plan(kv, sched.schedule())
    sched.add(req("p", 30, first=60))
    assert shape(sched.schedule()) == ([("d", 2, 1)], [("p", 0, 15)], [])


def test_while_audio_is_behind_every_step_carries_at_most_the_behind_prompt_budget():
    """engine/arbiter.py says another engine's audio is behind: prompt chunks and admissions share at most
    behind_prefill_tokens (3 here) in steps with and without decodes; decodes are never cut; when nothing is behind
    the step budget (16, mixed 8) is back."""
    pool, kv, sched = make(num_blocks=32, budget=16, mixed=StepBudget(16, 8, 2, behind_prefill_tokens=3))
    a, b = req("a", 2), req("b", 10, first=40)
    sched.add(a)
    plan = sched.schedule(audio_behind=True)
    assert shape(plan) == ([], [("a", 0, 2)], [])  # 2 <= 3: the whole prompt
    run_plan(kv, plan)
    sched.add(b)
    plan = sched.schedule(audio_behind=True)
    assert shape(plan) == ([("a", 2, 1)], [("b", 0, 3)], [])  # a decode rides; b's admission cut to 3
    run_plan(kv, plan)
    plan = sched.schedule(audio_behind=True)
    assert shape(plan) == ([("a", 3, 1)], [("b", 3, 3)], [])
    run_plan(kv, plan)
    plan = sched.schedule()  # nothing behind: the mixed budget (8 - 1 decode = 7 prompt tokens)
    assert shape(plan) == ([("a", 4, 1)], [("b", 6, 4)], [])  # b's last 4 prompt tokens (7 allowed)
    run_plan(kv, plan)
    plan = sched.schedule(audio_behind=True)
    assert shape(plan) == ([("a", 5, 1), ("b", 10, 1)], [], [])  # decodes only: never cut
    assert StepBudget(16, behind_prefill_tokens=None).prefill_tokens(0, audio_behind=True) == 16  # no cut
    assert StepBudget(16, 8, 2, behind_prefill_tokens=3).prefill_tokens(0, audio_behind=True) == 3
    assert StepBudget(16, 8, 2, behind_prefill_tokens=12).prefill_tokens(4, audio_behind=True) == 4  # the mixed rule
    pool.check_integrity()
