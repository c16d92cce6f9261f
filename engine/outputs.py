"""What the engine hands back: one RequestOutput per request per step that produced something."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the N most likely (token id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # every output character released so far (text that may still become a stop string is held back)
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output of this request
    new_text: str = ""  # since the previous output of this request
    new_logprobs: list[TokenLogprob] | None = None  # one per new token when logprobs were asked for
    logprobs: list[TokenLogprob] | None = None  # one per output token so far when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (engine failure) | None while running
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
    arrival_time: float = 0.0  # time.monotonic() when the request was added

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
