"""Audio encoders of audio-LLMs (audio tower + projector), one module per family, one contract (`AudioEncoder`).

`load_audio_encoder(path)` picks the family from the checkpoint's `model_type`. The text decoder of the same folder is
read by `models.checkpoint.iter_checkpoint_tensors(path)` (names rewritten to a causal LM's, both key layouts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from omnivox.models.audio.base import AudioEncoder, AudioInputs, audio_side_tensors
from omnivox.models.audio.qwen2_audio import Qwen2AudioEncoder
from omnivox.models.audio.qwen3_asr import Qwen3ASRAudioEncoder
from omnivox.models.audio.voxtral import VoxtralAudioEncoder

FAMILIES: dict[str, type[AudioEncoder]] = {
    "qwen2_audio": Qwen2AudioEncoder,
    "qwen3_asr": Qwen3ASRAudioEncoder,
    "voxtral": VoxtralAudioEncoder,
}


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
    return FAMILIES[family].from_folder(path, device=device, dtype=dtype)


__all__ = [
    "FAMILIES",
    "AudioEncoder",
    "AudioInputs",
    "Qwen2AudioEncoder",
    "Qwen3ASRAudioEncoder",
    "VoxtralAudioEncoder",
    "audio_family",
    "load_audio_encoder",
    "audio_side_tensors",
]
