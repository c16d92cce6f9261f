"""Sampling parameters: what a request asks of the sampler and of the stopping rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnivox.engine.errors import InvalidRequest


class TokenConstraint(Protocol):
    """A per-request mask over the vocabulary, asked once per generated token.

    `allowed(output_token_ids)` returns a bool tensor of shape [vocab_size] (True = may be sampled) for the next token,
    or None when every token is allowed. Implementations should cache and reuse mask tensors: this runs every step.
    Structured output, TTS audio-token layouts and similar rules are all expressed through this one hook.

    A constraint may also define `allowed_ids(output_token_ids) -> LongTensor | None`: the admitted ids, ascending.
    The sampler then works on those candidates alone (O(candidates) instead of O(vocabulary) per step).
    """

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor | None: ...


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    top_k: int = 0  # 0 = off; 1 = greedy
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt and output tokens)
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0  # output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit
    seed: int | None = None  # per-request generator: result independent of batch composition
    max_tokens: int | None = None  # None = until the context is full
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] | None = None  # stop strings, not included in the output unless include_stop_str_in_output
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N >= 0: chosen token's logprob plus the top N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    token_constraint: TokenConstraint | None = field(default=None, repr=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field. Normalises `stop` from a str to a list."""
        num = (int, float)
        if not isinstance(self.temperature, num) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, num) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, num) or not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, num) or not (0.0 < self.repetition_penalty < math.inf):
            raise InvalidRequest("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, num) or not math.isfinite(v) or abs(v) > 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias", "must be a mapping of token id to bias")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or not (0 <= tok < vocab_size):
                    raise InvalidRequest("logit_bias", f"token id {tok!r} is outside the vocabulary [0, {vocab_size})")
                if not isinstance(bias, num) or math.isnan(bias):
                    raise InvalidRequest("logit_bias", f"bias for token {tok} must be a number, got {bias!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest("seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
                raise InvalidRequest("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
            if any(s == "" for s in self.stop):
                raise InvalidRequest("stop", "stop strings must not be empty")
            self.stop = list(self.stop)
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids", f"every id must be in [0, {vocab_size})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not (0 <= self.logprobs <= 20)):
            raise InvalidRequest("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
