"""What every non-autoregressive voice offers the speech worker: utterances from text, then audio from each."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class UnknownVoice(ValueError):
    """The model has no voice of that name (NOT_FOUND at the API)."""

    def __init__(self, voice: str, voices: tuple[str, ...]) -> None:
        super().__init__(f"no voice {voice!r} (voices: {', '.join(voices)})")
        self.voice = voice


class VoiceNeedsDownload(ValueError):
    """The voice exists, but its weights are not here and would come from a model hub (FAILED_PRECONDITION)."""

    def __init__(self, voice: str, where: str) -> None:
        super().__init__(f"voice {voice!r} is not bundled: its weights would be downloaded from {where}")
        self.voice = voice


class NothingToSay(ValueError):
    """The text holds nothing the phonemizer can speak (emoji only, another script it has no rules for)."""


@dataclass(frozen=True)
class Utterance:
    """One model call's input: the phoneme ids (with the model's pads) and the text they came from."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class VoiceSettings:
    """How to speak: the voice, the pace (1.0 = the model's own; 2.0 twice as fast) and the noise seed."""

    voice: str
    speed: float = 1.0
    seed: int | None = None


class VoiceModel(Protocol):
    """A voice model. `utterances` is pure Python (the phonemizer); `render` runs the ONNX model (it releases the GIL).
    Both are blocking: the speech worker calls them in its threads, never on the event loop."""

    family: str  # "hibari", "piper"
    sample_rate: int  # Hz of what `render` returns
    language_code: str  # BCP-47, e.g. "en-US"
    voices: tuple[str, ...]  # built-in voices that can be spoken here
    default_voice: str

    def check_voice(self, voice: str) -> None:
        """UnknownVoice or VoiceNeedsDownload unless `voice` can be spoken here."""

    def utterances(self, text: str) -> list[Utterance]:
        """The text as model inputs, in order (one per sentence, or less); [] when nothing in it can be spoken."""

    def render(self, utterance: Utterance, settings: VoiceSettings, rng: np.random.Generator) -> np.ndarray:
        """(T,) float32 PCM in [-1, 1] at `sample_rate`."""


def clip_pcm(audio: np.ndarray) -> np.ndarray:
    """(T,) float32 in [-1, 1]: a VITS decoder's output overshoots 1 by a few percent on plosives."""
    return np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)


def speakable(text: str) -> str:
    """Control and format characters as spaces (espeak read a BEL or a zero-width joiner as a word)."""
    return "".join(" " if unicodedata.category(c)[0] == "C" else c for c in text)
