"""Audio encoders of audio-LLMs (audio tower + projector), one module per family, one contract (`AudioEncoder`).

`load_audio_encoder(path)` picks the family from the checkpoint's `model_type`. The text decoder of the same folder is
read by `models.checkpoint.iter_checkpoint_tensors(path)` (names rewritten to a causal LM's, both key layouts).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omnivox.models.audio.base import AudioEncoder, AudioInputs, audio_side_tensors

if TYPE_CHECKING:
    from omnivox.models.audio.qwen2_audio import Qwen2AudioEncoder
    from omnivox.models.audio.qwen3_asr import Qwen3ASRAudioEncoder
    from omnivox.models.audio.voxtral import VoxtralAudioEncoder

# model_type -> (module, encoder class), imported when first loaded: each family's module imports transformers'
# modeling code (its masking_utils loads torch._dynamo), 2-3 s that every `omnivox serve` start paid, audio or not.
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen2_audio": ("omnivox.models.audio.qwen2_audio", "Qwen2AudioEncoder"),
    "qwen3_asr": ("omnivox.models.audio.qwen3_asr", "Qwen3ASRAudioEncoder"),
    "voxtral": ("omnivox.models.audio.voxtral", "VoxtralAudioEncoder"),
}
_MODULE_OF = {name: module for module, name in FAMILIES.values()}


def encoder_class(family: str) -> type[AudioEncoder]:
    """The AudioEncoder subclass of a family (a key of FAMILIES), its module imported on first use."""
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> type[AudioEncoder]:  # the encoder classes by name, imported on first access
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def audio_family(path: str | os.PathLike) -> str | None:
    """The audio family of a checkpoint folder (its config's `model_type`), or None when it has no audio encoder."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    return model_type if model_type in FAMILIES else None


def load_audio_encoder(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> AudioEncoder:
    family = audio_family(path)
    if family is None:
        raise ValueError(f"{path}: not an audio-LLM checkpoint we read (families: {', '.join(FAMILIES)})")
    return encoder_class(family).from_folder(path, device=device, dtype=dtype)


__all__ = [
    "FAMILIES",
    "AudioEncoder",
    "AudioInputs",
    "Qwen2AudioEncoder",
    "Qwen3ASRAudioEncoder",
    "VoxtralAudioEncoder",
    "audio_family",
    "encoder_class",
    "load_audio_encoder",
    "audio_side_tensors",
]
