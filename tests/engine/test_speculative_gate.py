"""The speculative-decoding AcceptanceGate in a real engine: no proposals while the batch is above its size, none for a
request whose drafts keep being rejected (but a probe every `retry_every` steps), and proposals again when either
condition ends. The proposers know each request's greedy continuation (from a plain engine), so they propose the
right or a wrong next token on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams
from omnivox.engine.request import Request

PROMPTS = {"a": list(range(11, 30)), "b": [5, 6, 7, 5, 6, 7, 5, 6], "c": list(range(40, 45))}
VOCAB = 384


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("gate"), "llama")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class KnowingProposer:
    """Proposes, for each request, the next greedy token (`right`) or that token + 1 (always rejected by greedy
    verification) for the first `wrong_calls` calls and the right one after; records each call's engine step and
    the batch it was made in."""

    def __init__(self, engine, expected: dict[str, list[int]], wrong_calls: dict[str, int]) -> None:
        self.engine, self.expected, self.wrong_calls = engine, expected, wrong_calls
        self.calls: dict[str, list[tuple[int, int]]] = {rid: [] for rid in expected}  # (step, batch)

    def __call__(self, req: Request) -> list[int]:
        calls = self.calls[req.request_id]
        calls.append((self.engine.num_steps, len(self.engine.core.scheduler.running)))
        nxt = self.expected[req.request_id][req.num_output_tokens]
        return [(nxt + 1) % VOCAB] if len(calls) <= self.wrong_calls.get(req.request_id, 0) else [nxt]


def run(checkpoint: Path, max_tokens: dict[str, int], wrong_calls: dict[str, int], **gate) -> KnowingProposer:
    plain = tiny_engine(checkpoint)
    expected = {rid: o.token_ids for rid, o in zip(max_tokens, plain.generate(
        [PROMPTS[r] for r in max_tokens], [greedy(n) for n in max_tokens.values()]), strict=True)}  # fmt: skip
    proposer = KnowingProposer(None, expected, wrong_calls)
    engine = proposer.engine = tiny_engine(checkpoint, proposer=proposer)
    for name, value in gate.items():  # the engine's own gate, its thresholds set by the test
        setattr(engine.core.gate, name, value)
    for rid, n in max_tokens.items():
        engine.add_request(PROMPTS[rid], greedy(n), request_id=rid)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    assert got == expected  # greedy output never changes, whatever the gate decides
    engine.check_integrity()
    return proposer


def test_no_proposals_above_the_batch_size_and_again_below_it(checkpoint: Path) -> None:
    """Three requests, max_batch 2: nothing is proposed while all three run; once the short one ends, the other two
    get a proposal in every step (their drafts are right, so their acceptance stays high)."""
    proposer = run(checkpoint, {"a": 40, "b": 40, "c": 8}, {}, max_batch=2)
    batches = [batch for calls in proposer.calls.values() for _, batch in calls]
    assert batches and max(batches) <= 2, batches
    assert not proposer.calls["c"]  # it only ever ran in a batch of three
    for rid in ("a", "b"):
        steps = [step for step, _ in proposer.calls[rid]]
        assert len(steps) >= 10 and steps == list(range(steps[0], steps[0] + len(steps))), steps  # every step


def test_rejected_request_is_switched_off_probed_and_switched_on_again(checkpoint: Path) -> None:
    """Request "a" gets four wrong drafts, then right ones. Its acceptance average (0.7 old + 0.3 new, from 1.0) goes
    0.7, 0.49, 0.343, 0.240 < 0.25: four proposals in four steps, then none until the probe 16 steps later; that probe
    is accepted (0.468 >= 0.25), so it gets one in every step again. "b" alongside, always right, is never switched
    off: the gate decides per request."""
    proposer = run(checkpoint, {"a": 60, "b": 60}, {"a": 4}, max_batch=8, min_acceptance=0.25, retry_every=16)
    a = [step for step, _ in proposer.calls["a"]]
    first = a[0]
    assert a[:4] == [first, first + 1, first + 2, first + 3], a
    assert a[4] == first + 3 + 16, a  # switched off for 15 steps, probed in the 16th
    assert a[5:8] == [a[4] + 1, a[4] + 2, a[4] + 3], a  # the probe was accepted: on again
    b = [step for step, _ in proposer.calls["b"]]
    assert b[:12] == list(range(b[0], b[0] + 12)), b
