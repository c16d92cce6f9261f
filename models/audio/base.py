"""The audio-encoder contract shared by every audio-LLM family, and reading a bundle's tensors by part.

An audio-LLM checkpoint folder ("bundle") holds an audio tower, a projector and a text decoder. Two key layouts occur:
- the hub's (and what transformers 5's `save_pretrained` writes for Qwen2-Audio, through its conversion mapping):
  `audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`;
- transformers' runtime module names (what `save_pretrained` writes for Qwen3-ASR, and `state_dict()` for all):
  `model.audio_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`.
A leading `thinker.` (Qwen-Omni style exports) is dropped too. `split_bundle_name` maps both to
(part, name inside the part); the text decoder's names come out as a plain causal LM's (`model.layers.0...`,
`lm_head.weight`), which is what `models.decoder`'s `load_weights` reads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import LogMelExtractor, MelBatch, MelSettings
from omnivox.models.checkpoint import iter_checkpoint_tensors

AUDIO_TOWER = "audio_tower"
PROJECTOR = "multi_modal_projector"
LANGUAGE_MODEL = "language_model"


def split_bundle_name(name: str) -> tuple[str, str]:
    """`(part, name within the part)` for a bundle tensor name, in either key layout (see the module docstring)."""
    name = name.removeprefix("thinker.")
    for part in (AUDIO_TOWER, PROJECTOR):
        for prefix in (f"{part}.", f"model.{part}."):
            if name.startswith(prefix):
                return part, name[len(prefix) :]
    for prefix in ("language_model.lm_head.", "lm_head."):
        if name.startswith(prefix):
            return LANGUAGE_MODEL, "lm_head." + name[len(prefix) :]
    for prefix in ("language_model.model.", "model.language_model.", "language_model.", "model."):
        if name.startswith(prefix):
            return LANGUAGE_MODEL, "model." + name[len(prefix) :]
    raise ValueError(f"bundle tensor {name!r} belongs to no known part (audio tower, projector, language model)")


def iter_bundle_tensors(folder: str | os.PathLike, parts: set[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield `(part, name, tensor)` for the tensors of `parts` only; safetensors tensors of other parts are not read."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:  # a PyTorch .bin bundle: read through the generic reader, keep the parts asked for
        for name, tensor in iter_checkpoint_tensors(folder):
            part, inner = split_bundle_name(name)
            if part in parts:
                yield part, inner, tensor
        return
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part, inner = split_bundle_name(name)
                if part in parts:
                    yield part, inner, f.get_tensor(name)


def text_decoder_tensors(folder: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """The bundle's text decoder as a plain causal LM's `(name, tensor)` pairs, for the engine's decoder loader."""
    for _, name, tensor in iter_bundle_tensors(folder, {LANGUAGE_MODEL}):
        yield name, tensor


def load_module_state(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Assign `state` to a module built on the meta device; every parameter and persistent buffer must be present."""
    expected = set(module.state_dict().keys())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint lacks {missing[:4]} ({len(missing)}), has no place for {unexpected[:4]}")
    for name, tensor in state.items():
        want = module.get_parameter(name) if name in dict(module.named_parameters()) else module.get_buffer(name)
        if tuple(want.shape) != tuple(tensor.shape):
            raise ValueError(f"{what}.{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(want.shape)}")
    module.load_state_dict(state, assign=True)


@dataclass
class AudioInputs:
    """What `AudioEncoder.features` prepares for `encode`: the log-mel batch and each clip's placeholder count."""

    mel: MelBatch
    num_tokens: list[int]


class AudioEncoder(ABC):
    """An audio-LLM's audio tower + projector: decoded samples in, [num_tokens, text_hidden] embeddings out.

    Contract:
    - `sample_rate`: the rate `features` expects (decode audio parts to it); `limits`: what an audio part may be
      (`codecs.audio_input.decode_audio(..., limits=encoder.limits)` enforces it).
    - `num_placeholders(num_samples)`: how many `placeholder_token_id` tokens the prompt holds for a clip of that many
      samples (the family's own formula, the one its processor uses); `encode` asserts its output has that length.
    - `features(clips)`: clips are 1-D float32 arrays/tensors at `sample_rate`; any number, any lengths within limits.
    - `encode(inputs)`: one batched pass over all clips (of one or many requests); returns one [num_tokens_i,
      text_hidden] tensor per clip in `dtype` on `device`. A clip's embeddings do not depend on its batch mates.
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
    @abstractmethod
    def from_folder(
        cls, path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> AudioEncoder: ...

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
    def encode(self, inputs: AudioInputs) -> list[torch.Tensor]: ...

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
