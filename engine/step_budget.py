"""How many prompt tokens one step may carry, so that a step with decodes in it costs about a target ITL.

On a CPU a step's time grows with its tokens (issue 33, 2-core AVX2 host: ~29 ms for one decode row, over a second
for a 128-token chunk, so at 16 concurrent a user's ITL p99 was 1,161 ms: every decode rode with a 128-row prefill).
vLLM's and SGLang's chunked prefill bound the tokens of a mixed step; so does this: when decodes are running, the
step's prefill chunks and admissions share at most `mixed_step_tokens - decode tokens` (never under
`min_prefill_tokens`, so prompts still progress every step); a step with no decode in it takes the whole
`max_tokens`. The token count comes from a target step time and the machine's own step times, measured at start-up
(`StepCosts.measure`, a straight line through the times of a few chunk sizes), then rescaled by the mixed steps
the engine really runs (`StepTimeHold`), since a shared machine's speed moves after start-up.
While another engine's audio stream is behind its deadline (engine/arbiter.py), a step of an engine serving no audio
carries at most `behind_prefill_tokens` of prompt whatever its decodes (the arbiter's wait is bounded, so the text
engine still steps; a short step holds the shared cores for less: on the 2-core AVX2 host a 128-token chunk took over
a second, a 16-token one about a tenth of that).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnivox.engine.params import SamplingParams

if TYPE_CHECKING:
    from omnivox.engine.core import StepResult
    from omnivox.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBudget:
    max_tokens: int  # tokens of any step (max_num_batched_tokens)
    mixed_step_tokens: int | None = None  # decode + prefill tokens of a step with decodes in it; None = max_tokens
    min_prefill_tokens: int = 16  # prompt tokens a mixed step still carries when its decodes fill it (<= mixed)
    behind_prefill_tokens: int | None = 16  # prompt tokens of any step while other audio is behind; None = no cut

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1 and self.min_prefill_tokens >= 1
        assert self.mixed_step_tokens is None or self.mixed_step_tokens >= self.min_prefill_tokens
        assert self.behind_prefill_tokens is None or self.behind_prefill_tokens >= 1

    def prefill_tokens(self, num_decode_tokens: int, audio_behind: bool = False) -> int:
        """Prompt tokens (running prefills and admissions together) a step with these decode tokens may carry;
        audio_behind: another engine's audio stream is behind its deadline (engine/arbiter.py `behind_for`)."""
        tokens = self.max_tokens
        if num_decode_tokens and self.mixed_step_tokens is not None:
            tokens = max(self.min_prefill_tokens, self.mixed_step_tokens - num_decode_tokens)
        if audio_behind and self.behind_prefill_tokens is not None:
            tokens = min(tokens, self.behind_prefill_tokens)
        return tokens


@dataclass(frozen=True)
class StepCosts:
    """A step's wall time as a straight line in its tokens: fixed_ms + per_token_ms * tokens."""

    fixed_ms: float  # reading the weights once (memory-bound on CPU), whatever the rows
    per_token_ms: float  # compute per row

    def ms(self, tokens: int) -> float:
        """The wall time the line gives a step of `tokens` tokens."""
        return self.fixed_ms + self.per_token_ms * tokens

    def tokens_within(self, step_ms: float) -> int:
        """The most tokens a step may carry to cost at most step_ms (at least 1)."""
        return max(1, math.floor((step_ms - self.fixed_ms) / max(self.per_token_ms, 1e-6)))

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> StepCosts:
        """Least squares through (tokens, ms) samples, the median time per token count first (a shared machine's
        outliers), slope and intercept kept non-negative."""
        by_n: dict[int, list[float]] = {}
        for n, ms in samples:
            by_n.setdefault(n, []).append(ms)
        points = [(n, statistics.median(v)) for n, v in sorted(by_n.items())]
        assert len(points) >= 2, "step costs need at least two token counts"
        mean_n = statistics.fmean(n for n, _ in points)
        mean_t = statistics.fmean(t for _, t in points)
        var = sum((n - mean_n) ** 2 for n, _ in points)
        slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / var)
        return cls(max(0.0, mean_t - slope * mean_n), slope)

    @classmethod
    def measure(cls, engine: Engine, repeats: int = 2) -> StepCosts:
        """Time the engine's own steps: prompts of a quarter, a half and all of max_num_batched_tokens (one prefill
        step each) and their decode steps (one token), each size `repeats` times after one warm-up pass."""
        top = engine.max_num_batched_tokens
        sizes = sorted({max(2, top // 4), max(2, top // 2), max(2, top)})
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size
        samples: list[tuple[int, float]] = []
        observe = lambda result: samples.append((result.plan.num_tokens, result.stats.seconds * 1e3))  # noqa: E731
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
        engine.step_observers.append(observe)
        try:
            for rep in range(repeats + 1):
                if rep == 1:
                    samples.clear()  # the warm-up pass: first-call allocations, cold caches
                for n in sizes:
                    engine.generate([[rng.randrange(vocab) for _ in range(n)]], params)
        finally:
            engine.step_observers.remove(observe)
        return cls.fit([(n, ms) for n, ms in samples if n])


class StepTimeHold:
    """Keeps a scheduler's mixed steps at about `step_ms` as the machine's speed changes: the start-up StepCosts
    line, scaled by how much slower than it the recent mixed steps ran (a shared host's load moves; measured on the
    2-core AVX2 host, a 300 ms budget fitted at start-up gave mixed steps of 328 ms at p50 and 794 ms at p99 once the
    load rose). After every step with both decodes and prompt tokens (the steps the budget bounds) it refits the
    scale as the `quantile` of measured / predicted ms over the last `window` of them, so that that share of mixed
    steps fits, and gives the scheduler the StepBudget of that many tokens (never under two prompt floors)."""

    def __init__(
        self, engine: Engine, costs: StepCosts, step_ms: float, min_prefill_tokens: int = 16, window: int = 32,
        quantile: float = 0.9,
    ) -> None:  # fmt: skip
        self.engine, self.costs, self.step_ms = engine, costs, step_ms
        self.min_prefill_tokens, self.window, self.quantile = min_prefill_tokens, window, quantile
        self.ratios: list[float] = []  # measured / predicted ms of the last `window` mixed steps
        self.scale = 1.0
        self.budget = self._install()

    def tokens(self) -> int:
        """Decode + prompt tokens a mixed step may carry at the current scale."""
        top = self.engine.max_num_batched_tokens
        floor = min(top, 2 * self.min_prefill_tokens)
        return min(top, max(floor, self.costs.tokens_within(self.step_ms / self.scale)))

    def _install(self) -> StepBudget:
        return hold_step_tokens(self.engine, self.tokens(), self.min_prefill_tokens)

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, ms: float) -> None:
        """One step's tokens and wall time; a mixed one moves the scale and the installed budget."""
        if not (num_decode_tokens and num_prefill_tokens):
            return  # a step the budget does not bound says nothing about it
        predicted = self.costs.ms(num_decode_tokens + num_prefill_tokens)
        self.ratios = [*self.ratios[-(self.window - 1) :], ms / max(predicted, 1e-6)]
        ranked = sorted(self.ratios)
        self.scale = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        if self.tokens() != self.budget.mixed_step_tokens:
            self.budget = self._install()

    def observe_step(self, result: StepResult) -> None:
        """Engine.step_observers entry."""
        s = result.stats
        self.observe(s.num_decode_tokens, s.num_prefill_tokens, s.seconds * 1e3)


def hold_step_ms(engine: Engine, step_ms: float, min_prefill_tokens: int = 16) -> StepTimeHold:
    """Measure this machine's step costs and keep the engine's mixed steps at about step_ms from now on (the budget
    follows the measured mixed steps: StepTimeHold); returns the hold (its `budget` is the scheduler's)."""
    costs = StepCosts.measure(engine)
    hold = StepTimeHold(engine, costs, step_ms, min_prefill_tokens)
    tokens = hold.budget.mixed_step_tokens
    if costs.ms(tokens) > step_ms:
        log.warning(
            "a %d-token step costs about %.0f ms here, over the %.0f ms asked for", tokens, costs.ms(tokens), step_ms
        )
    log.info(
        "step costs %.1f ms + %.2f ms/token: a mixed step carries at most %d tokens for %.0f ms (rescaled by the "
        "mixed steps measured from now on)",
        costs.fixed_ms,
        costs.per_token_ms,
        tokens,
        step_ms,
    )
    engine.step_observers.append(hold.observe_step)
    return hold


def hold_step_tokens(engine: Engine, tokens: int, min_prefill_tokens: int = 16) -> StepBudget:
    """Give the engine's scheduler a mixed-step budget of `tokens` (decode + prefill) and return it."""
    budget = StepBudget(engine.max_num_batched_tokens, tokens, min(min_prefill_tokens, max(1, tokens // 2)))
    engine.scheduler.budget = budget
    return budget
