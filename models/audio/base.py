"""The audio-encoder contract shared by every audio-LLM family, and reading the audio side of a checkpoint.

An audio-LLM checkpoint folder holds an audio tower, a projector and a text decoder, in one of two key layouts:
- the hub's (and what transformers 5's `save_pretrained` writes for Qwen2-Audio and Voxtral, through its conversion
  mapping): `audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`;
- transformers' runtime module names (what `save_pretrained` writes for Qwen3-ASR): `model.audio_tower.*`,
  `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`.
`models.checkpoint.iter_checkpoint_tensors(path, part)` routes every name to its part (AUDIO, PROJECTOR, or
DECODER, whose names it rewrites to a plain causal LM's for the engine); `audio_side_tensors` strips the part prefix
so the names match transformers' tower and projector modules.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import LogMelExtractor, MelBatch, MelSettings
from omnivox.models.audio.transcription import TranscriptionRequestError, forced_language_code
from omnivox.models.checkpoint import AUDIO, PROJECTOR, iter_checkpoint_tensors


def audio_side_tensors(path: str | os.PathLike, dtype: torch.dtype) -> tuple[dict, dict]:
    """(tower state, projector state) of the checkpoint at `path`, named as inside transformers' modules
    (`conv1.weight`, `linear.weight`), cast to `dtype`; the decoder's tensors are not read."""
    states = []
    for part, prefix in ((AUDIO, "audio_tower."), (PROJECTOR, "multi_modal_projector.")):
        state = {}
        for name, tensor in iter_checkpoint_tensors(path, part):
            inner = name.removeprefix("model.")
            if not inner.startswith(prefix):
                raise ValueError(f"{path}: {name!r} is not an audio-LLM {part} tensor")
            state[inner[len(prefix) :]] = tensor.to(dtype)
        states.append(state)
    return states[0], states[1]


def load_module_state(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Assign `state` to a module built on the meta device; every parameter and persistent buffer must be present."""
    expected = set(module.state_dict().keys())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint lacks {missing[:4]} ({len(missing)}), has no place for {unexpected[:4]}")
    current = module.state_dict()
    for name, tensor in state.items():
        want = current[name]
        if tuple(want.shape) != tuple(tensor.shape):
            raise ValueError(f"{what}.{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(want.shape)}")
    module.load_state_dict(state, assign=True)


@dataclass
class AudioInputs:
    """What `AudioEncoder.features` prepares for `encode`: the log-mel batch and each clip's placeholder count."""

    mel: MelBatch
    num_tokens: list[int]

    @staticmethod
    def concat(parts: Sequence[AudioInputs]) -> AudioInputs:
        """One batch of the clips of several `features` calls (e.g. of several requests), in order. Shorter feature
        matrices are zero-padded with mask 0, which is what a clip's own features hold past its end."""
        if len(parts) == 1:
            return parts[0]
        frames = max(p.mel.features.shape[-1] for p in parts)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [..., T] -> [..., frames], zeros after
            return torch.nn.functional.pad(x, (0, frames - x.shape[-1]))

        return AudioInputs(
            MelBatch(
                features=torch.cat([pad(p.mel.features) for p in parts]),
                mask=torch.cat([pad(p.mel.mask) for p in parts]),
                valid_frames=[n for p in parts for n in p.mel.valid_frames],
            ),
            [n for p in parts for n in p.num_tokens],
        )


class AudioEncoder(ABC):
    """An audio-LLM's audio tower + projector: decoded samples in, [num_tokens, text_hidden] embeddings out.

    Contract:
    - `sample_rate`: the rate `features` expects (decode audio parts to it); `limits`: what an audio part may be
      (`codecs.audio_input.decode_audio(..., limits=encoder.limits)` enforces it).
    - `num_placeholders(num_samples)`: how many `placeholder_token_id` tokens the prompt holds for a clip of that many
      samples (the family's own formula, the one its processor uses); `encode` asserts its output has that length.
    - `features(clips)`: clips are 1-D float32 arrays/tensors at `sample_rate`; any number, any lengths within limits.
    - `encode(inputs)`: `inputs` is one `features` result or a sequence of them (e.g. one per request); one
      batched pass over all their clips returns one [num_tokens_i, text_hidden] tensor per clip, in order, in
      `dtype` on `device`. A clip's embeddings do not depend on its batch mates (tested).
    - Prompts: the chat template writes the marker token (`marker_token_id`) once per clip; `expand_prompt(token_ids,
      num_tokens)` repeats it to each clip's count and says where each clip's run starts (an `EmbeddingSegment` per
      clip: start, num_tokens, key). User text must not be able to produce the marker (tokenize it apart).
    - `feature_settings()`: a stable string of every setting that changes the embeddings, for content keys.
    """

    family: str = ""

    def __init__(self, mel: MelSettings, device: torch.device, dtype: torch.dtype, name: str) -> None:
        self.mel_settings = mel
        self.device = torch.device(device)
        self.dtype = dtype
        self.name = name
        self.extractor = LogMelExtractor(mel, self.device)

    @classmethod
    def from_folder(
        cls, path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
    ) -> AudioEncoder:
        """The family's tower and projector of the checkpoint folder (`kwargs`: the family's own, e.g. max_seconds):
        its config and feature extractor read by transformers, the modules built on the meta device, then loaded."""
        import transformers

        path = Path(path)
        config = transformers.AutoConfig.from_pretrained(path)
        if config.model_type != cls.family:
            raise ValueError(f"{path}: model_type {config.model_type!r} is not {cls.family}")
        mel = cls.mel_settings_for(transformers.AutoFeatureExtractor.from_pretrained(path), config)
        with torch.device("meta"):
            tower, projector = cls.build_modules(config)
        tower_state, projector_state = audio_side_tensors(path, dtype)
        load_module_state(tower, tower_state, "audio_tower")
        load_module_state(projector, projector_state, "multi_modal_projector")
        cls.after_load(tower)
        return cls(config, mel, tower, projector, device, dtype, name=path.name, **kwargs)  # type: ignore[call-arg]

    @classmethod
    @abstractmethod
    def mel_settings_for(cls, feature_extractor: Any, config: Any) -> MelSettings:
        """The log-mel settings of the checkpoint's feature extractor, as this family's processor pads."""

    @classmethod
    @abstractmethod
    def build_modules(cls, config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(audio tower, projector), transformers' modules of this family (built under the meta device)."""

    @classmethod
    def after_load(cls, tower: torch.nn.Module) -> None:
        """What the checkpoint does not hold, computed once its weights are in (nothing by default)."""
        return None

    # --- transcription (TranscriptionService.Transcribe) ---
    @classmethod
    def transcription_messages(cls, language: str | None = None, context: str | None = None) -> list[dict]:
        """Chat messages asking the model to transcribe one audio clip (the `{"type": "audio"}` part marks where it
        goes). Render with `processor.apply_chat_template(messages, tokenize=False, continue_final_message=...)`,
        where `continue_final_message = messages[-1]["role"] == "assistant"` (Qwen3-ASR's prefilled answer)."""
        raise TranscriptionRequestError("model", f"transcription prompts for {cls.family!r} are not built here")

    @classmethod
    def parse_transcription(cls, text: str, language: str | None = None) -> tuple[str | None, str]:
        """(language code or None, transcript) from the generated text. `language`: the one the request forced."""
        return forced_language_code(language), text.strip()

    @classmethod
    def answer_header_tag(cls, language: str | None) -> str | None:
        """The tag that ends a header the answer opens with before its transcript (read by parse_transcription), or
        None when the answer is all transcript (the default: a forced language, or a family that writes none)."""
        return None

    @property
    def sample_rate(self) -> int:
        return self.mel_settings.sample_rate

    @property
    @abstractmethod
    def placeholder_token_id(self) -> int: ...

    @property
    @abstractmethod
    def text_hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def limits(self) -> AudioLimits: ...

    @abstractmethod
    def num_placeholders(self, num_samples: int) -> int: ...

    @abstractmethod
    def _encode_batch(self, inputs: AudioInputs) -> list[torch.Tensor]: ...

    @property
    def marker_token_id(self) -> int:
        """The token the chat template writes once per clip; both families repeat it as the placeholder."""
        return self.placeholder_token_id

    def encode(self, inputs: AudioInputs | Sequence[AudioInputs]) -> list[torch.Tensor]:
        if not isinstance(inputs, AudioInputs):
            if not inputs:
                return []
            inputs = AudioInputs.concat(list(inputs))
        batch = inputs
        with torch.inference_mode():
            out = self._encode_batch(batch)
        for n, emb in zip(batch.num_tokens, out, strict=True):
            if tuple(emb.shape) != (n, self.text_hidden_size):
                raise AssertionError(f"{self.family}: embeddings {tuple(emb.shape)} for a clip of {n} placeholders")
        return out

    def expand_prompt(self, token_ids: Sequence[int], num_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Repeat the i-th marker token `num_tokens[i]` times; returns (expanded ids, start of each clip's run).

        A prompt already expanded (runs of exactly those lengths, as transformers' processor writes) is returned
        as it is. The number of marker runs must equal the number of clips."""
        marker = self.marker_token_id
        runs: list[tuple[int, int]] = []  # (start, length) of each run of markers
        for i, t in enumerate(token_ids):
            if t == marker:
                if runs and runs[-1][0] + runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((i, 1))
        if len(runs) != len(num_tokens):
            raise ValueError(f"the prompt has {len(runs)} audio markers for {len(num_tokens)} clips")
        if all(length == n for (_, length), n in zip(runs, num_tokens, strict=True)):
            return list(token_ids), [start for start, _ in runs]
        if any(length != 1 for _, length in runs):
            raise ValueError(f"audio marker runs of {[n for _, n in runs]} tokens for clips of {list(num_tokens)}")
        out: list[int] = []
        starts: list[int] = []
        clips = iter(num_tokens)
        for t in token_ids:
            if t == marker:
                starts.append(len(out))
                out.extend([marker] * next(clips))
            else:
                out.append(t)
        return out, starts

    def feature_settings(self) -> str:
        return f"{self.family}|{self.mel_settings.key()}|dtype={self.dtype}"

    def features(self, clips: list[np.ndarray | torch.Tensor]) -> AudioInputs:
        tensors = [torch.as_tensor(c, dtype=torch.float32).reshape(-1) for c in clips]
        return AudioInputs(self.extractor.extract(tensors), [self.num_placeholders(t.numel()) for t in tensors])

    def _min_samples(self) -> int:
        """The fewest samples that give at least one embedding (searched over the family's formula)."""
        for n in range(1, 64 * self.mel_settings.hop_length):
            if self.num_placeholders(n) >= 1:
                return n
        raise ValueError(f"{self.family}: no clip length under 64 frames gives an embedding")
