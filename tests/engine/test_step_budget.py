"""The mixed-step token budget (engine/step_budget.py) on a real engine: measured from the machine's own steps at
start-up, it bounds every step that has decodes in it, prompts still progress, and greedy tokens are unchanged."""

from __future__ import annotations

import pytest
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine.core import StepResult
from omnivox.engine.params import SamplingParams
from omnivox.engine.step_budget import StepBudget, StepCosts, StepTimeHold, hold_step_ms, hold_step_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("step_budget"), "llama")


def test_step_costs_fit_a_line_through_the_median_of_each_size():
    line = [(1, 10.0), (8, 24.0), (16, 40.0)]  # 8 ms + 2 ms per token
    noisy = line + [(8, 24.0), (8, 90.0), (1, 10.0), (1, 55.0)]  # one outlier per size: the median ignores it
    costs = StepCosts.fit(noisy)
    assert costs == pytest.approx(StepCosts(8.0, 2.0))
    assert costs.tokens_within(40.0) == 16 and costs.tokens_within(9.0) == 1  # never under one token


def test_the_default_budget_is_off():
    assert StepBudget(128).prefill_tokens(40) == 128  # no mixed budget: the step's token budget alone bounds it
    assert StepBudget(128, 32, 8).prefill_tokens(0) == 128  # no decode waiting: a prompt takes the whole step
    assert StepBudget(128, 32, 8).prefill_tokens(30) == 8  # decodes fill it: prompts keep 8 tokens a step


def test_measured_budget_is_installed_and_leaks_nothing(ckpt):
    engine = tiny_engine(ckpt, max_num_batched_tokens=32)
    hold = hold_step_ms(engine, step_ms=1e4)  # ten seconds: every step fits, so the budget is the whole step
    assert engine.scheduler.budget is hold.budget
    assert hold.budget == StepBudget(32, 32, 16)
    assert hold.observe_step in engine.step_observers  # it follows the engine's steps from now on
    engine.check_integrity()
    assert engine.pool.num_free == len(engine.pool.blocks)  # the calibration prompts' blocks came back
    engine.step_observers.clear()
    assert hold_step_ms(engine, step_ms=0.0).budget == StepBudget(32, 32, 16)  # no time: still two prompt floors


def test_budget_bounds_mixed_steps_and_keeps_greedy_tokens(ckpt):
    """Four short requests decode while a 60-token prompt arrives: with a mixed budget of 8 every step with decodes
    carries at most 8 tokens and the long prompt advances 4 a step; the tokens are those of the unbounded run."""

    def run(engine) -> tuple[dict[str, list[int]], list[StepResult]]:
        steps: list[StepResult] = []
        engine.step_observers.append(steps.append)
        for i in range(4):
            engine.add_request([5 + i, 9, 11], GREEDY, request_id=f"short{i}")
        engine.step()
        engine.add_request(list(range(3, 63)), GREEDY, request_id="long")
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
        return outs, steps

    plain, _ = run(tiny_engine(ckpt, max_num_batched_tokens=32))
    bounded = tiny_engine(ckpt, max_num_batched_tokens=32)
    hold_step_tokens(bounded, 8)
    assert bounded.scheduler.budget == StepBudget(32, 8, 4)
    got, steps = run(bounded)
    assert got == plain
    mixed = [s.stats for s in steps[1:] if s.stats.num_decode_tokens]
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 8 for s in mixed)
    long_chunks = [c.num_tokens for s in steps for c in s.plan.prefills if c.request.request_id == "long"]
    assert long_chunks[:3] == [4, 4, 4]  # 4 decodes + 4 prompt tokens per step, the prompt progressing each step
    bounded.check_integrity()


def test_the_time_budget_follows_the_measured_mixed_steps(ckpt):
    """A start-up line of 10 ms + 1 ms/token and a 30 ms target: 20 tokens a mixed step. One mixed step measured at
    twice its predicted time halves the time the line may spend (8 tokens, two prompt floors of 4); steps without
    both decodes and prompt tokens move nothing; 32 mixed steps at half the prediction push the first out of the
    window and give the whole step back. The scheduler's plans follow: 4 decodes + 4 prompt tokens, then 4 + 28."""
    engine = tiny_engine(ckpt, max_num_batched_tokens=32)
    hold = StepTimeHold(engine, StepCosts(10.0, 1.0), step_ms=30.0, min_prefill_tokens=4)
    assert engine.scheduler.budget == hold.budget == StepBudget(32, 20, 4)
    hold.observe(4, 16, 60.0)  # predicted 30 ms: ratio 2
    assert hold.scale == 2.0 and engine.scheduler.budget == StepBudget(32, 8, 4)
    hold.observe(4, 0, 500.0)  # a decode-only step and a prefill-only one: not bounded by the budget, ignored
    hold.observe(0, 32, 500.0)
    assert hold.ratios == [2.0] and engine.scheduler.budget == StepBudget(32, 8, 4)
    for i in range(4):
        engine.add_request([5 + i, 9, 11], GREEDY, request_id=f"short{i}")
    engine.step()
    engine.add_request(list(range(3, 63)), GREEDY, request_id="long")
    engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in engine.last_step.plan.prefills] == [("long", 4)]
    assert len(engine.last_step.plan.decodes) == 4
    for _ in range(31):
        hold.observe(4, 4, 9.0)  # predicted 18 ms: ratio 0.5; with the 2.0 in the window its 90th percentile is 0.5
    assert hold.scale == 0.5 and engine.scheduler.budget == StepBudget(32, 32, 4)
    engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in engine.last_step.plan.prefills] == [("long", 28)]
    hold.observe(4, 28, 16.0)  # the window holds 32: the 2.0 is out
    assert len(hold.ratios) == 32 and max(hold.ratios) == 0.5
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_served_engine_holds_the_flagged_budget(ckpt):
    """`serve --max-step-tokens 8` (EngineOptions.max_step_tokens) reaches the served engine's scheduler, and a real
    Generate over gRPC completes under it."""
    from support.service_harness import ServerThread, user_request

    from omnivox.services.parts.loading import EngineOptions, ModelSpec
    from omnivox.v1 import generation_pb2_grpc

    specs = [ModelSpec(path=ckpt, name="tiny")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=32, max_step_tokens=8)) as s:
        assert s.engine("tiny").scheduler.budget == StepBudget(32, 8, 4)
        stub = generation_pb2_grpc.GenerationServiceStub(s.channel())
        replies = list(stub.Generate(user_request("Hello there", model="tiny", max_output_tokens=4), timeout=60))
        assert replies and s.wait_kv_free("tiny")[0] == s.wait_kv_free("tiny")[1]


def test_max_step_ms_measures_text_engines_and_leaves_whisper_alone(ckpt, tmp_path):
    """`serve --max-step-ms` beside a Whisper: the text engine gets a measured budget; Whisper (whose requests need
    audio the calibration has none of) loads without one and serves."""
    from support.service_harness import ServerThread
    from support.whisper_checkpoints import make_whisper

    from omnivox.services.parts.loading import EngineOptions, ModelSpec

    specs = [ModelSpec(path=ckpt, name="tiny"), ModelSpec(path=make_whisper(tmp_path / "whisper"), name="whisper")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=32, max_step_ms=1e4)) as s:
        assert s.engine("tiny").scheduler.budget == StepBudget(32, 32, 16)
        assert s.engine("whisper").scheduler.budget.mixed_step_tokens is None
        s.engine("tiny").check_integrity()
