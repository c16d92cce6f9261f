"""CSM's voice prompts: context turns with audio (a created voice's reference, the clause before in a stream) and the
Mimi encoder that turns a reference recording into the frames a created voice keeps (services/parts/voices.py).

A context turn is written as transformers' CsmProcessor writes a conversation's audio turn (its chat template, then
one `<|AUDIO|>` per encoded frame): `<bos>[speaker]text<eos>`, `<|AUDIO|>` x T, `<|audio_eos|>`. The model embeds
the T audio positions as each frame's summed codebook embeddings and `<|audio_eos|>` as a frame of end codes
(`CsmForConditionalGeneration._merge_input_ids_with_input_values`). Here those T + 1 positions are one embedding
segment of the prompt, produced on the engine thread by the backbone's own `frame_embeddings` and keyed by a hash of
the codes: two requests in one created voice share the reference turn's whole KV blocks (the prefix cache); a turn
the cache covers whole is never embedded again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omnivox.engine.request import EmbeddingSegment
from omnivox.services import errors

if TYPE_CHECKING:
    from omnivox.services.parts.csm_part import CsmLayout

ContextTurn = tuple[str, str, Sequence[Sequence[int]]]  # (speaker, text, frames (T x N) of its audio)


class CsmPrompt(list):
    """A CSM prompt's token ids, with the embedding segments of its context turns' audio (`engine.stream(...,
    segments=)`)."""

    def __init__(self, ids: Sequence[int], segments: list[EmbeddingSegment]) -> None:
        super().__init__(ids)
        self.segments = segments


def prompt_segments(prompt: Sequence[int]) -> list[EmbeddingSegment] | None:
    """The segments a speech prompt carries (a CSM prompt with context audio), else None."""
    return prompt.segments if isinstance(prompt, CsmPrompt) else None


def frame_embedder(model: Any, device: torch.device) -> Callable[[Sequence[Sequence[int]]], torch.Tensor]:
    """codes (T x N) -> (T x hidden): the served backbone's `frame_embeddings`, as the next step's input takes them."""

    def embed(frames: Sequence[Sequence[int]]) -> torch.Tensor:
        with torch.inference_mode():
            return model.frame_embeddings(torch.tensor(frames, dtype=torch.int64, device=device))

    return embed


def _turn_ids(tokenizer: Any, speaker: str, text: str) -> list[int]:
    ids = tokenizer(f"[{speaker}]{text}", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]


def context_prompt(
    layout: CsmLayout, tokenizer: Any, turns: Sequence[ContextTurn], text: str, speaker: str
) -> CsmPrompt:
    """`speaker` saying `text` after `turns` (oldest first): ids with one segment per turn's audio (+ its end frame)."""
    if layout.embed_frames is None or layout.audio_token_id < 0 or layout.audio_eos_token_id < 0:
        raise ValueError("this CSM layout has no audio tokens or frame embedding: context turns are not served")
    embed = layout.embed_frames
    ids: list[int] = []
    segments: list[EmbeddingSegment] = []
    for turn_speaker, turn_text, frames in turns:
        ids += _turn_ids(tokenizer, turn_speaker, turn_text)
        codes = [list(f) for f in frames] + [[layout.eos_code] * layout.num_codebooks]  # (T+1 x N)
        if any(len(f) != layout.num_codebooks for f in codes):
            raise ValueError(f"context frames must have {layout.num_codebooks} codes each")
        key = "csm-audio:" + hashlib.sha256(np.asarray(codes, dtype=np.int32).tobytes()).hexdigest()
        segments.append(EmbeddingSegment(len(ids), len(codes), key, produce=lambda c=codes: embed(c)))
        ids += [layout.audio_token_id] * (len(codes) - 1) + [layout.audio_eos_token_id]
    ids += _turn_ids(tokenizer, speaker, text)
    return CsmPrompt(ids, segments)


def csm_clause_prompt(
    layout: CsmLayout,
    tokenizer: Any,
    voice: Any,
    prev_text: str | None,
    prev_frames: Sequence[Sequence[int]],
    clause: str,
    speaker: str,
) -> CsmPrompt:
    """A StreamingSynthesizeSpeech clause as CSM's own multi-turn generation speaks a conversation: the created
    voice's reference turn first (`voice`, services/parts/voices.py CreatedVoice, or None: the same turn every clause, so
    its KV blocks stay in the prefix cache), then the clause before with the tail of its audio (`prev_text` None:
    the first clause), then the clause. Speaker `speaker` ("" the default) in every turn."""
    speaker = speaker or layout.default_voice
    turns: list[ContextTurn] = [(speaker, voice.transcript, voice.frames)] if voice is not None else []
    if prev_text is not None and prev_frames:
        turns.append((speaker, prev_text, prev_frames))
    if not turns:
        return CsmPrompt(_turn_ids(tokenizer, speaker, clause), [])
    return context_prompt(layout, tokenizer, turns, clause, speaker)


class CsmVoiceEncoder:
    """A CSM folder's Mimi encoder (its `codec_model.` tensors), loaded once: samples at the codec's rate -> frames
    of the model's `num_codebooks` codes. Thread-safe (the encoder's own lock)."""

    def __init__(self, folder: Path, num_codebooks: int) -> None:
        from omnivox.codecs.mimi_encode import MimiEncoder

        self.encoder = MimiEncoder.from_folder(folder, prefix="codec_model.")
        self.num_codebooks = num_codebooks
        self.frame_samples = self.encoder.frame_samples

    def frames_for(self, num_samples: int) -> int:
        return math.ceil(num_samples / self.frame_samples)

    def encode(self, samples: np.ndarray) -> list[list[int]]:
        """samples (T,) float32 -> frames (ceil(T / frame_samples) x num_codebooks)."""
        codes = self.encoder.encode(torch.from_numpy(np.ascontiguousarray(samples))[None], self.num_codebooks)
        return codes[0].T.tolist()


def load_voice_encoder(model_name: str, folder: Path, num_codebooks: int) -> CsmVoiceEncoder:
    """The folder's encoder; FAILED_PRECONDITION naming the model when its Mimi has none (a decoder-only export)."""
    try:
        return CsmVoiceEncoder(folder, num_codebooks)
    except (ValueError, KeyError) as err:
        raise errors.failed_precondition(
            f"model {model_name!r} cannot create voices: its Mimi codec has no encoder ({err})"
        ) from err
