"""Sampling parameters: what a request asks of the sampler and of the stopping rules.

Every field's accepted range is written once, in `_RULES` below. `SamplingParams.violations()` applies the table and
returns every problem at once; the services map the field names onto their own request paths and add only checks of
their own wire format (roles, parts, sizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnivox.engine.errors import InvalidRequest


class TokenConstraint(Protocol):
    """One request's mask over the vocabulary, asked once per generated token, and told what was accepted.

    `allowed(output_token_ids)` returns a bool tensor of shape [vocab_size] (True = may be sampled) for the next token,
    or None when every token is allowed. Implementations should cache and reuse mask tensors: this runs every step.
    Structured output, TTS audio-token layouts and similar rules are all expressed through this one hook.

    A constraint may also define `allowed_ids(output_token_ids) -> LongTensor | None`: the admitted ids, ascending.
    The sampler then works on those candidates alone (O(candidates) instead of O(vocabulary) per step).
    With them, `allowed_span(output_token_ids) -> (lo, hi) | None` says that every admitted id lies in [lo, hi): a
    step whose sampled rows all name one projects only the union of their spans (engine/vocab_window.py).

    A constraint may also define `adjust_logits(logits, output_token_ids) -> None`: it edits its row of logits ([V]
    float32, bias and mask applied) in place, on the device and without a host sync (e.g. Whisper's "a timestamp when
    the timestamps' total probability beats every text token": services/processing/whisper_rules.py).

    `advance(token_ids)` is called with the tokens the request accepted this step (in order); `rollback(n)` takes
    back the last n advanced tokens (speculative tokens that were rejected after the constraint saw them). Both are
    optional: a constraint that reads everything from `output_token_ids` keeps no state and needs neither.
    """

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor | None: ...

    def advance(self, token_ids: list[int]) -> None: ...

    def rollback(self, num_tokens: int) -> None: ...


# A constraint is made per request from a factory: what is shared (a compiled grammar, a TTS layout) lives in the
# factory, the matcher state in what it returns. `SamplingParams` objects are reused across requests (generate() with
# one params for many prompts), so they must never hold a stateful constraint themselves.
ConstraintFactory = Callable[[], TokenConstraint]


def shared(constraint: TokenConstraint) -> ConstraintFactory:
    """A factory for a constraint that keeps no per-request state (every request may use the same object)."""
    return lambda: constraint


_NUM = (int, float)

# A temperature below this is greedy (vLLM's _SAMPLING_EPS). Sampled, 1e-40 overflowed logits / temperature to inf,
# the softmax to NaN, and argmax over NaNs took a token the grammar mask forbids: INTERNAL for a JSON-schema request.
GREEDY_BELOW_TEMPERATURE = 1e-5


MAX_SEED = 2**32 - 1  # seeds are 32-bit (see the "seed" rule)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, _NUM) and not isinstance(v, bool)


def _check_logit_bias(bias: Any, vocab: int) -> str | None:
    if not isinstance(bias, dict):
        return "must be a mapping of token id to bias"
    for tok, value in bias.items():
        if not _is_int(tok) or not 0 <= tok < vocab:
            return f"token id {tok!r} is outside the vocabulary [0, {vocab})"
        if not _is_num(value) or not (math.isfinite(value) or value == -math.inf):
            return f"bias for token {tok} must be a finite number or -inf (a ban), got {value!r}"
    return None


def _check_stop(stop: Any, vocab: int) -> str | None:
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        return f"must be a string or a list of strings, got {type(stop).__name__}"
    if any(s == "" for s in stop):
        return "stop strings must not be empty"
    return None


def _check_ids(ids: Any, vocab: int) -> str | None:
    if not isinstance(ids, list | tuple) or not all(_is_int(t) and 0 <= t < vocab for t in ids):
        return f"every id must be an integer in [0, {vocab})"
    return None


@dataclass(frozen=True)
class FieldRule:
    """The accepted values of one SamplingParams field: `check(value, vocab_size)` returns why a value is bad."""

    check: Callable[[Any, int], str | None]
    optional: bool = False  # None is accepted


def _rule(ok: Callable[[Any], bool], message: str, optional: bool = False) -> FieldRule:
    return FieldRule(lambda v, vocab: None if ok(v) else f"{message}, got {v!r}", optional)


# The one table of sampling ranges (services and speech validation use it through `violations()`).
_RULES: dict[str, FieldRule] = {
    "temperature": _rule(
        lambda v: _is_num(v) and math.isfinite(v) and v >= 0, "must be a finite number >= 0 (0 = greedy)"
    ),
    # -1 is off too, as in vLLM and SGLang (their clients send it for "no top-k")
    "top_k": _rule(lambda v: _is_int(v) and v >= -1, "must be an integer >= -1 (0 or -1 = off)"),
    "top_p": _rule(lambda v: _is_num(v) and 0.0 < v <= 1.0, "must be in (0, 1]"),
    "min_p": _rule(lambda v: _is_num(v) and 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "repetition_penalty": _rule(lambda v: _is_num(v) and 0.0 < v < math.inf, "must be a finite number > 0 (1 = off)"),
    "presence_penalty": _rule(lambda v: _is_num(v) and -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "frequency_penalty": _rule(lambda v: _is_num(v) and -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "logit_bias": FieldRule(_check_logit_bias, optional=True),
    # The CPU generator (mt19937) keeps a seed's low 32 bits: -1, 2**32 - 1 and 2**63 - 1 drew one stream. Seeds are
    # refused past 32 bits rather than folded, so distinct seeds are distinct streams on every device.
    "seed": _rule(lambda v: _is_int(v) and 0 <= v <= MAX_SEED, f"must be an integer in [0, {MAX_SEED}]", optional=True),
    "max_tokens": _rule(lambda v: _is_int(v) and v >= 1, "must be an integer >= 1", optional=True),
    "min_tokens": _rule(lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "stop": FieldRule(_check_stop, optional=True),
    "stop_token_ids": FieldRule(_check_ids, optional=True),
    "logprobs": _rule(lambda v: _is_int(v) and 0 <= v <= 20, "must be an integer in [0, 20]", optional=True),
    "detokenize": _rule(lambda v: isinstance(v, bool), "must be a bool"),
}


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (below GREEDY_BELOW_TEMPERATURE) = greedy (exact argmax)
    top_k: int = 0  # 0 or -1 = off; 1 = greedy
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt and output tokens)
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0  # output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit (-inf bans the token)
    seed: int | None = None  # per-request generator: result independent of batch composition
    max_tokens: int | None = None  # None = until the context is full
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] | None = None  # stop strings, not included in the output unless include_stop_str_in_output
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N >= 0: chosen token's logprob plus the top N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False: outputs carry token ids only (empty text), and no step decodes them: speech's audio-code tokens are
    # read as ids, and decoding them was ~10 % of a 2-stream speech step. Stop strings need the text, so not both.
    detokenize: bool = True
    constraint_factory: ConstraintFactory | None = field(default=None, repr=False)  # one constraint per request

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def violations(self, vocab_size: int) -> list[InvalidRequest]:
        """Every bad field at once (in table order), each as an InvalidRequest naming the SamplingParams field."""
        found: list[InvalidRequest] = []
        for name, rule in _RULES.items():
            value = getattr(self, name)
            if value is None and rule.optional:
                continue
            problem = rule.check(value, vocab_size)
            if problem is not None:
                found.append(InvalidRequest(name, problem))
        names = {v.field for v in found}
        if (
            self.max_tokens is not None
            and not names & {"max_tokens", "min_tokens"}
            and self.min_tokens > self.max_tokens
        ):
            found.append(InvalidRequest("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}"))
        if self.detokenize is False and self.stop and "stop" not in names:
            found.append(
                InvalidRequest("stop", "stop strings need the output text; they cannot be used with detokenize=False")
            )
        if self.constraint_factory is not None and not callable(self.constraint_factory):
            found.append(InvalidRequest("constraint_factory", "must be a callable that returns a new constraint"))
        return found

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field. Normalises `stop` from a str to a list."""
        found = self.violations(vocab_size)
        if found:
            raise found[0]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
