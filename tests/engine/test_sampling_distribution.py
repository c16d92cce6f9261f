"""The sampler's output distribution, through the real engine, against an independent computation.

The expected distribution of the first token comes from transformers' logits for the prompt, with temperature and
top-k / top-p / min-p applied here in numpy; the engine draws it 2,000 times (one seeded request per draw) and a
chi-square test compares. A model whose logits are spread out (lm_head scaled) makes temperature matter.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engines import tiny_engine
from support.sampling_checks import PROMPT, chi_square_ok, expected_probs
from support.sampling_checks import spread as spread  # noqa: F401  (fixture)

from omnivox.engine import SamplingParams

DRAWS = 2000


@pytest.fixture(scope="module")
def engine(spread):
    return tiny_engine(spread[0], max_num_batched_tokens=512)


def draw(engine, **params) -> np.ndarray:
    batch = [SamplingParams(max_tokens=1, ignore_eos=True, seed=i, **params) for i in range(DRAWS)]
    outs = engine.generate([PROMPT] * DRAWS, batch)
    counts = np.zeros(engine.model_config.vocab_size)
    for out in outs:
        counts[out.token_ids[0]] += 1
    return counts


CASES = [
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.3, top_k=12),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.5, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_first_token_distribution_matches(engine, spread, params):
    probs = expected_probs(spread[1], **params)
    assert (probs > 0.005).sum() >= 5, "the case must spread over several tokens to test anything"
    counts = draw(engine, **params)
    ok, stat, limit = chi_square_ok(counts, probs)
    assert ok, f"chi-square {stat:.1f} over the limit {limit:.1f} for {params}"
    # The test has power: the same draws against temperature 1 without filters (the 'division deleted' sampler).
    if params != dict(temperature=1.0, top_p=1.0):
        assert not chi_square_ok(counts, expected_probs(spread[1], 1.0 if params["temperature"] != 1.0 else 0.5))[0]


def test_top_k_1_is_greedy_whatever_the_temperature(engine, spread):
    best = int(np.argmax(spread[1]))
    outs = engine.generate(
        [PROMPT] * 50, [SamplingParams(temperature=2.0, top_k=1, max_tokens=1, seed=i) for i in range(50)]
    )
    assert {o.token_ids[0] for o in outs} == {best}


def test_eos_and_stop_tokens_are_banned_until_min_tokens(engine):
    eos = engine.model_config.eos_token_ids[0]
    stop = 7
    pushed = SamplingParams(
        temperature=1.0, seed=0, logit_bias={eos: 80.0, stop: 79.0}, max_tokens=10, min_tokens=3, stop_token_ids=[stop]
    )
    out = engine.generate([PROMPT], pushed)[0]
    assert out.token_ids[:3] and not {eos, stop} & set(out.token_ids[:3])
    assert len(out.token_ids) == 4 and out.token_ids[3] == eos and out.finish_reason == "stop"
    free = SamplingParams(temperature=1.0, seed=0, logit_bias={eos: 80.0}, max_tokens=10)
    assert engine.generate([PROMPT], free)[0].token_ids == [eos]
