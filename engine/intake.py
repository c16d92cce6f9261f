"""Request intake: tokenise, validate, and build the `Request` (its own constraint and generator included).

Everything here runs before a request is queued, on the caller's thread; it raises InvalidRequest naming the field
and leaves the engine untouched.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from omnivox.engine.errors import InvalidRequest
from omnivox.engine.params import SamplingParams
from omnivox.engine.request import EmbeddingSegment, EncoderInput, Request
from omnivox.models.config import ModelConfig

Prompt = str | Sequence[int]


class RequestIntake:
    def __init__(self, config: ModelConfig, tokenizer: Any, device: torch.device, encoder_decoder: bool = False):
        self.config = config
        self.is_encoder_decoder = encoder_decoder
        self.tokenizer = tokenizer
        self.device = device
        self._ids = itertools.count()

    def tokenize(self, prompt: Prompt) -> list[int]:
        vocab = self.config.input_vocab_size or self.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "this model has no tokenizer: send token ids")
            return list(self.tokenizer(prompt).input_ids) if prompt else []
        if isinstance(prompt, Sequence | torch.Tensor):
            ids = [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
            return ids
        raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_segments(self, segments: Sequence[EmbeddingSegment], num_prompt_tokens: int) -> list[EmbeddingSegment]:
        segs = sorted(segments, key=lambda s: s.start)
        for seg in segs:
            if not isinstance(seg, EmbeddingSegment):
                raise InvalidRequest("segments", f"expected EmbeddingSegment, got {type(seg).__name__}")
            if seg.end > num_prompt_tokens:
                raise InvalidRequest("segments", f"segment [{seg.start}, {seg.end}) lies outside the prompt")
            if seg.is_produced and seg.embeds().shape[1] != self.config.hidden_size:
                raise InvalidRequest(
                    "segments", f"segment width {seg.embeds().shape[1]} != hidden {self.config.hidden_size}"
                )
        if any(a.end > b.start for a, b in itertools.pairwise(segs)):
            raise InvalidRequest("segments", "segments overlap")
        return segs

    def build(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        segments: Sequence[EmbeddingSegment] | None,
        rope_positions: tuple[torch.Tensor, int] | None = None,
        encoder_input: EncoderInput | None = None,
        cache_salt: str = "",
    ) -> Request:
        """rope_positions: M-RoPE ([3, len(prompt)] positions, delta of generated tokens), for models that use it.
        encoder_input: what an encoder-decoder model's decoder cross-attends to (required there, refused elsewhere).
        cache_salt: only requests with the same salt share prefix-cache blocks (Request.cache_salt)."""
        cfg = self.config
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if len(ids) >= cfg.max_model_len:
            raise InvalidRequest(
                "prompt", f"{len(ids)} tokens do not fit the context of {cfg.max_model_len} tokens with room to answer"
            )
        params.validate(cfg.vocab_size)
        room = cfg.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                "max_tokens", f"{params.max_tokens} exceeds the {room} tokens left in the context after the prompt"
            )
        segs = self.check_segments(segments or [], len(ids))
        if self.is_encoder_decoder != (encoder_input is not None):
            need = "needs" if self.is_encoder_decoder else "takes no"
            raise InvalidRequest("encoder_input", f"this {cfg.family} model {need} an encoder input (audio)")
        if not isinstance(cache_salt, str):
            raise InvalidRequest("cache_salt", f"expected a string, got {type(cache_salt).__name__}")
        if encoder_input is not None and not isinstance(encoder_input, EncoderInput):
            raise InvalidRequest("encoder_input", f"expected EncoderInput, got {type(encoder_input).__name__}")
        positions, delta = rope_positions if rope_positions is not None else (None, 0)
        if positions is not None and tuple(positions.shape) != (3, len(ids)):
            raise InvalidRequest("rope_positions", f"must be [3, {len(ids)}], got {tuple(positions.shape)}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        # A fresh constraint per request: a stateful one shared by two requests would mix their matcher states.
        constraint = params.constraint_factory() if params.constraint_factory is not None else None
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            params=params,
            max_tokens=params.max_tokens or room,
            eos_token_ids=cfg.eos_token_ids,
            segments=segs,
            constraint=constraint,
            generator=generator,
            rope_positions=positions,
            rope_delta=int(delta),
            encoder_input=encoder_input,
            cache_salt=cache_salt,
        )
