"""A Whisper window's audio as the decodes over it hold it (services/calls/whisper.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnivox.engine.request import EncoderInput
from omnivox.services.parts.whisper_part import WhisperPart


@dataclass
class WindowAudio:
    """A window's log-mel features and content key: each engine request over it takes its own encoder reference (the
    encoder runs once; the cross K/V is shared through the encoder cache)."""

    part: WhisperPart
    key: str
    features: Any  # [n_mels, 3000] float32 CPU (or a short window's first frames)
    salt: str
    held: EncoderInput | None = None  # taken early so the entry stays cached between the probe and the decode

    def take(self) -> EncoderInput:
        if self.held is not None:
            enc, self.held = self.held, None
            return enc
        return self.part.encoder_input(self.key, self.features, self.salt)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None
