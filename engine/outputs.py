"""What the engine hands back: one RequestOutput per request per step that produced something."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnivox.engine.errors import InvalidRequest


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the N most likely (token id, logprob), best first


class OutputHistory:
    """One request's output so far, append-only, shared by all its RequestOutputs: each output reads the prefix that
    existed when it was made. Making an output then costs O(its new tokens); copying every token, the text and the
    logprobs so far into each one cost O(length) per step (BENCHMARKS.md, "Output processing per step")."""

    def __init__(self, logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.frames: list[tuple[int, ...]] = []  # frame models: each output token's whole frame
        self.text_parts: list[str] = []  # released text, one part per output that released some
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self._joined, self._joined_parts = "", 0  # text of the first _joined_parts parts, joined once

    def text(self, num_parts: int) -> str:
        if num_parts < self._joined_parts:  # an older output read late
            return "".join(self.text_parts[:num_parts])
        if num_parts > self._joined_parts:
            self._joined += "".join(self.text_parts[self._joined_parts : num_parts])
            self._joined_parts = num_parts
        return self._joined


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    history: OutputHistory = field(repr=False, compare=False)  # read through token_ids, text and logprobs
    num_tokens: int = 0  # output tokens so far (this output's prefix of the history)
    num_text_parts: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output of this request
    new_text: str = ""  # since the previous output of this request
    new_logprobs: list[TokenLogprob] | None = None  # one per new token when logprobs were asked for
    new_frames: list[tuple[int, ...]] = field(default_factory=list)  # frame models: each new token's whole frame
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (engine failure) | None while running
    error: InvalidRequest | None = None  # with "error": the request's own values caused it (INVALID_ARGUMENT)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
    arrival_time: float = 0.0  # time.monotonic() when the request was added
    num_logprobs: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far (a new list on each read: O(length), unlike the new_* fields)."""
        return self.history.token_ids[: self.num_tokens]

    @property
    def frames(self) -> list[tuple[int, ...]]:
        """Frame models: every output frame so far (codebook 0 first), one per output token."""
        return self.history.frames[: self.num_tokens]

    @property
    def text(self) -> str:
        """Every output character released so far (text that may still become a stop string is held back)."""
        return self.history.text(self.num_text_parts)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One per output token so far when logprobs were asked for."""
        lps = self.history.logprobs
        return None if lps is None else lps[: self.num_logprobs]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
