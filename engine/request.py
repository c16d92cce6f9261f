"""A request as a small state object: its tokens, its block table, and how far the cache has computed it.

Only scheduling and sampling state lives here; what the output side needs (detokenizer, logprobs, the consumer's
callback) is kept by engine/output_processor.py.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnivox.engine.errors import InvalidRequest
from omnivox.engine.params import SamplingParams, TokenConstraint
from omnivox.engine.penalty_counts import PenaltyCounts


class EmbeddingSource(Protocol):
    """Embeddings produced off the engine thread (an encoder worker), shared through an encoder cache.

    `start()` asks for them (idempotent, non-blocking); `ready()` / `failed()` say whether they exist or never
    will; `result()` returns them ([num_tokens, hidden]); `release()` drops this request's reference (once).
    """

    def start(self) -> None: ...

    def ready(self) -> bool: ...

    def failed(self) -> bool: ...

    def result(self) -> torch.Tensor: ...

    def release(self) -> None: ...


class EmbeddingSegment:
    """Embeddings ([num_tokens, hidden]) that replace the input embeddings of prompt positions [start, end).

    `key` names the segment's content: a hash of the raw input bytes and the preprocessing settings, known at
    admission before any encoder runs. It goes into the hashes of the KV blocks the segment covers, so a prefix-cache
    hit is decided without the embeddings. The embeddings come from exactly one of: `embeds` (ready), `produce()`
    (called on the engine thread, at most once, when a prefill chunk first computes one of the segment's positions)
    or `source` (an EmbeddingSource: started at admission unless the prefix cache covers the whole segment; a prefill
    chunk stops short of the segment until it is ready, so other requests never wait for an encoder).

    `bidirectional`: its positions attend to each other both ways during prefill (a Gemma 3 image), so a prefill chunk
    never ends inside it (engine/scheduler.py) and the chunk's attention mask opens the segment's block.
    """

    def __init__(
        self,
        start: int,
        num_tokens: int,
        key: str,
        produce: Callable[[], torch.Tensor] | None = None,
        embeds: torch.Tensor | None = None,
        source: EmbeddingSource | None = None,
        bidirectional: bool = False,
    ) -> None:
        if sum(x is not None for x in (produce, embeds, source)) != 1:
            raise ValueError("a segment needs exactly one of produce, embeds or source")
        if num_tokens < 1 or start < 0:
            raise ValueError(f"bad segment span: start {start}, {num_tokens} tokens")
        if not key:
            raise ValueError("a segment needs a content key")
        self.start = start
        self.num_tokens = num_tokens
        self.key = key
        self.source = source
        self.bidirectional = bidirectional
        self._produce = produce
        self._embeds: torch.Tensor | None = None
        if embeds is not None:
            self._set(embeds)

    @classmethod
    def from_embeds(cls, start: int, embeds: torch.Tensor, key: str | None = None) -> EmbeddingSegment:
        """A segment of ready embeddings; without a key, the key is a hash of the tensor's values."""
        if embeds.dim() != 2:
            raise ValueError(f"segment embeds must be [n, hidden], got shape {tuple(embeds.shape)}")
        if key is None:
            data = embeds.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            key = "tensor:" + hashlib.sha256(data).hexdigest()
        return cls(start, embeds.shape[0], key, embeds=embeds)

    def _set(self, embeds: torch.Tensor) -> None:
        if embeds.dim() != 2 or embeds.shape[0] != self.num_tokens:
            raise ValueError(f"segment of {self.num_tokens} tokens got embeddings of shape {tuple(embeds.shape)}")
        self._embeds = embeds

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_produced(self) -> bool:
        return self._embeds is not None

    def request(self) -> None:
        """Start producing the embeddings when they come from a source (admission calls this)."""
        if self.source is not None:
            self.source.start()

    def ready(self) -> bool:
        """False while a source is still producing: a prefill chunk must stop before this segment."""
        return self.source is None or self.source.ready() or self.source.failed()

    def failed(self) -> bool:
        return self.source is not None and self.source.failed()

    def release(self) -> None:
        """The request is done with these embeddings (finish, abort): drop its reference to the source."""
        if self.source is not None:
            self.source.release()

    def embeds(self) -> torch.Tensor:
        """The segment's embeddings [num_tokens, hidden], produced on first use."""
        if self._embeds is None:
            if self.source is not None:
                self._set(self.source.result())
            else:
                assert self._produce is not None
                self._set(self._produce())
                self._produce = None
        assert self._embeds is not None
        return self._embeds


class EncoderInput:
    """What an encoder-decoder request's decoder cross-attends to (Whisper's audio): one tensor per request, produced
    off the engine thread like a segment's embeddings ([num_layers, 2, heads, T_enc, head_dim]: every decoder layer's
    cross-attention keys and values, computed once per input by the encoder worker and shared through the encoder
    cache, never per step). `key` names the input (audio bytes + preprocessing + model): the decoder states of every
    position depend on it, so it salts the request's first KV block hash (prefix caching of the decoder prompt stays
    exact: two requests share decoder blocks only for the same audio and the same prompt tokens).

    Design choice (vLLM and SGLang keep a separate cross-attention KV cache with prefix caching off, and a chunked
    prefill can split a 1,500-frame encoder prefix): here the encoder output is not in the decoder's token sequence at
    all, so the paged cache and chunked prefill see only the short decoder prompt, prefix caching stays on (salted),
    and the cross K/V lives as long as some request references it (released on finish, abort or error)."""

    def __init__(self, key: str, source: EmbeddingSource | None = None, tensor: torch.Tensor | None = None) -> None:
        if (source is None) == (tensor is None):
            raise ValueError("an encoder input needs exactly one of source or tensor")
        if not key:
            raise ValueError("an encoder input needs a content key")
        self.key, self.source, self._tensor = key, source, tensor

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, key: str | None = None) -> EncoderInput:
        if key is None:
            data = tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            key = "tensor:" + hashlib.sha256(data).hexdigest()
        return cls(key, tensor=tensor)

    def request(self) -> None:
        if self.source is not None:
            self.source.start()

    def ready(self) -> bool:
        return self.source is None or self.source.ready() or self.source.failed()

    def failed(self) -> bool:
        return self.source is not None and self.source.failed()

    def result(self) -> torch.Tensor:
        if self._tensor is None:
            assert self.source is not None
            self._tensor = self.source.result()
        return self._tensor

    def release(self) -> None:
        """The request is done (finish, abort, error): drop its cross K/V and its encoder-cache reference."""
        if self.source is not None:
            self._tensor = None
            self.source.release()


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
    constraint: TokenConstraint | None = None  # this request's own, made by params.constraint_factory
    # M-RoPE (Qwen2.5-VL): [3, len(prompt)] rotary positions of the prompt; later tokens sit at index + rope_delta on
    # all three rows. None: the plain 1-D positions. KV slots are 1-D either way.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    generator: torch.Generator | None = None  # per-request sampling stream when seeded
    encoder_input: EncoderInput | None = None  # encoder-decoder models (Whisper): what the decoder cross-attends to
    # Who may share this request's prefix-cache blocks: requests with the same salt (engine/kv_manager.py puts it
    # into the first block's hash, so every later block differs too). "" shares with every unsalted request.
    cache_salt: str = ""

    output_token_ids: list[int] = field(default_factory=list)
    # The penalties' token counts, kept between steps (engine/penalty_counts.py); None until a penalty first reads them.
    penalty_counts: PenaltyCounts | None = field(default=None, repr=False, compare=False)
    # Proposed tokens after the committed ones, computed by the next step and verified by it; never hashed into the
    # prefix cache. Empty unless a proposer (speculative decoding) set them.
    draft_token_ids: list[int] = field(default_factory=list)
    # Frame models (engine/frame_step.py): each output token's whole frame of codes, and whether a frame ended it.
    output_frames: list[tuple[int, ...]] = field(default_factory=list)
    frames_ended: bool = False
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of this request's full committed blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    # Leading blocks of block_table released behind a sliding window (each entry now the pool's null block).
    num_skipped_blocks: int = 0
    num_computed_tokens: int = 0  # committed tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet admitted)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: InvalidRequest | None = None  # why a request ended with "error" when the request itself caused it
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompt"
        if self.rope_positions is not None:
            assert tuple(self.rope_positions.shape) == (3, len(self.prompt_token_ids)), "rope positions [3, prompt]"
        for seg in self.segments:
            assert seg.start >= 0 and seg.end <= len(self.prompt_token_ids), "segment outside the prompt"

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt + accepted output (drafts not included)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_id(self, i: int) -> int:
        n, m = len(self.prompt_token_ids), self.num_tokens
        if i < n:
            return self.prompt_token_ids[i]
        return self.output_token_ids[i - n] if i < m else self.draft_token_ids[i - m]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end); positions past the committed tokens are the drafts."""
        every = self.prompt_token_ids + self.output_token_ids + self.draft_token_ids if end > self.num_tokens else None
        if every is not None:
            return every[start:end]
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def rope_span(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions of tokens [start, end): [end - start], or [3, end - start] for M-RoPE requests."""
        if self.rope_positions is None:
            return torch.arange(start, end)
        n = self.rope_positions.shape[1]
        parts = []
        if start < n:
            parts.append(self.rope_positions[:, start : min(end, n)])
        if end > n:
            parts.append((torch.arange(max(start, n), end) + self.rope_delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
