"""A request as a small state object: its tokens, its block table, and how far the cache has computed it."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from omnivox.engine.params import SamplingParams


@dataclass
class EmbeddingSegment:
    """Embeddings ([n, hidden]) that replace the input embeddings of prompt positions [start, start + n)."""

    start: int
    embeds: torch.Tensor
    content_hash: str | None = None  # identifies the content in the prefix cache; computed from the tensor if None

    def __post_init__(self) -> None:
        if self.embeds.dim() != 2:
            raise ValueError(f"segment embeds must be [n, hidden], got shape {tuple(self.embeds.shape)}")
        if self.content_hash is None:
            data = self.embeds.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            self.content_hash = hashlib.sha256(data).hexdigest()

    @property
    def end(self) -> int:
        return self.start + self.embeds.shape[0]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never runs past the context
    eos_token_ids: tuple[int, ...]
    segments: list[EmbeddingSegment] = field(default_factory=list)
    on_output: Callable | None = None  # called with each RequestOutput (from the engine thread)

    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of this request's full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet admitted)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = None  # per-request sampling stream when seeded
    detok: object = None  # engine.detokenizer.IncrementalDetokenizer
    logprobs: list = field(default_factory=list)  # TokenLogprob of every output token (when asked for)
    num_emitted_logprobs: int = 0

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompt"
        for seg in self.segments:
            assert seg.start >= 0 and seg.end <= len(self.prompt_token_ids), "segment outside the prompt"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_id(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
