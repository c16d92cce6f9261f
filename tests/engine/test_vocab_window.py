"""A step whose sampled rows all name where their admitted ids lie (`allowed_span`) projects only those vocabulary
rows (engine/vocab_window.py): the same tokens, seeds and logprobs as the full projection, fewer logits columns."""

from __future__ import annotations

import pytest
import torch
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams
from omnivox.engine.params import shared
from omnivox.engine.vocab_window import logit_window

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22]]


class _Blocks:
    """Every other id of an 80-id block that moves with the output length (3 positions), shifted by `shift`: ids
    inside the span that are not admitted, and rows of a batch at different spans."""

    def __init__(self, shift: int) -> None:
        self.shift = shift
        self.ids = [torch.arange(100 + shift + 60 * k, 180 + shift + 60 * k, 2) for k in range(3)]
        self.masks = [torch.zeros(384, dtype=torch.bool).index_fill_(0, ids, True) for ids in self.ids]

    def allowed(self, output_token_ids):
        return self.masks[len(output_token_ids) % 3]

    def allowed_ids(self, output_token_ids):
        return self.ids[len(output_token_ids) % 3]


class _BlocksWithSpan(_Blocks):
    def allowed_span(self, output_token_ids):
        ids = self.ids[len(output_token_ids) % 3]
        return int(ids[0]), int(ids[-1]) + 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tiny_checkpoint(tmp_path_factory.mktemp("window"), "llama"))


def _generate(engine, cls) -> tuple[list, list[int]]:
    """Two requests (greedy with logprobs and penalties; seeded sampling with filters, bias and bans) and the width
    of every logits tensor the runner returned."""
    widths: list[int] = []
    execute = engine.core.runner.execute

    def recording(plan, *window):
        logits, sampling = execute(plan, *window)
        if logits is not None:
            widths.append(logits.shape[1])
        return logits, sampling

    greedy = SamplingParams(
        temperature=0,
        max_tokens=14,
        ignore_eos=True,
        logprobs=3,
        repetition_penalty=1.4,
        presence_penalty=0.3,
        constraint_factory=shared(cls(0)),
    )
    sampled = SamplingParams(
        temperature=0.9,
        top_p=0.8,
        top_k=20,
        frequency_penalty=0.2,
        logit_bias={102: 3.0, 50: 5.0},  # one id inside the blocks, one outside every span
        min_tokens=6,
        stop_token_ids=[104, 3],  # banned until 6 tokens: one inside, one outside
        max_tokens=14,
        seed=11,
        logprobs=0,
        constraint_factory=shared(cls(1)),
    )
    engine.core.runner.execute = recording
    try:
        outs = engine.generate(PROMPTS, [greedy, sampled])
    finally:
        engine.core.runner.execute = execute
    return outs, widths


def test_window_gives_the_full_projections_tokens_and_logprobs(engine) -> None:
    vocab = engine.model_config.vocab_size
    full, full_widths = _generate(engine, _Blocks)
    windowed, widths = _generate(engine, _BlocksWithSpan)
    assert set(full_widths) == {vocab}
    assert max(widths) < vocab // 2  # the union of two 79-id spans, not the vocabulary
    for a, b in zip(full, windowed, strict=True):
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == 14
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
    for i, out in enumerate(windowed):  # every token is one the constraint admitted at its position
        c = _Blocks(i)
        assert all(t in c.ids[n % 3].tolist() for n, t in enumerate(out.token_ids))


class _Req:
    def __init__(self, constraint, n: int = 0) -> None:
        self.request_id = "r"
        self.constraint = constraint
        self.output_token_ids = [0] * n


def test_window_only_when_every_row_names_its_span() -> None:
    a, b = _BlocksWithSpan(0), _BlocksWithSpan(1)
    assert logit_window([_Req(a)], 384) == (100, 179)
    assert logit_window([_Req(a), _Req(b, 1)], 384) == (100, 240)  # the union of both rows' spans
    assert logit_window([_Req(a), _Req(None)], 384) is None  # an unconstrained row needs every logit
    assert logit_window([_Req(a), _Req(_Blocks(0))], 384) is None  # no span named
    assert logit_window([_Req(a), _Req(b, 2)], 384) is None  # (100, 300): over half the vocabulary, not worth it
    assert logit_window([_Req(a)], 150) is None  # a span past the vocabulary: every row

    class _Adjusting(_BlocksWithSpan):
        def adjust_logits(self, logits, output_token_ids):  # reads the whole row
            pass

    assert logit_window([_Req(_Adjusting(0))], 384) is None
