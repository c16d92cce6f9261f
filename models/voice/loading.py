"""Which voice family a path holds, and loading it."""

from __future__ import annotations

from pathlib import Path

from omnivox.models.voice.piper_config import find_piper_voice
from omnivox.models.voice.voice_model import VoiceModel


def voice_family(path: Path) -> str | None:
    """ "hibari" for an unpacked hibari-tts wheel, "piper" for a Piper voice (folder or .onnx), else None."""
    from omnivox.models.voice.hibari import is_hibari_folder

    if path.is_dir() and is_hibari_folder(path):
        return "hibari"
    return "piper" if find_piper_voice(path) is not None else None


def load_voice(path: Path, threads: int = 1) -> VoiceModel:
    """The voice at `path` (blocking: reads the model, warms the phonemizer). ValueError naming what is wrong."""
    family = voice_family(path)
    if family == "hibari":
        from omnivox.models.voice.hibari import HibariVoice

        return HibariVoice(path, threads)
    if family == "piper":
        from omnivox.models.voice.piper import PiperVoice

        return PiperVoice(path, threads)
    raise ValueError(f"{path} is not a voice model (a Piper NAME.onnx + NAME.onnx.json, or an unpacked hibari-tts)")
