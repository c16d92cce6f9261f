"""Speech output processing: an autoregressive speech model's audio tokens -> complete codec frames, incrementally.

Both speech RPCs (SynthesizeSpeech per segment, StreamingSynthesizeSpeech per clause) feed each engine output's new
token ids to one AudioFrameAssembler and push the frames it completes to the codec stream. The layout
(models/orpheus.py SpeechLayout) says which token ends the speech and what code a token is at its frame position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from omnivox.models.orpheus import SpeechLayout

if TYPE_CHECKING:
    from omnivox.services.parts.csm_part import CsmLayout

log = logging.getLogger(__name__)


class AudioFrameAssembler:
    """Audio tokens in, complete frames (`layout.frame_size` codes each) out; a partial frame waits for its rest.

    The stream ends at end-of-speech, or at a token that is no audio token at its position (the token constraint
    rules that out; if it happens anyway the audio ends there, logged, rather than failing the call)."""

    def __init__(self, layout: SpeechLayout | CsmLayout, label: str = "") -> None:
        self.layout = layout
        self.label = label  # names the stream in the log ("segment 2", "clause 0")
        self.audio_tokens = 0  # audio tokens taken so far (a partial frame's included)
        self.ended = False
        self._frame: list[int] = []

    def feed(self, token_ids: Sequence[int], engine_frames: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """The frames the new tokens complete; nothing once the speech has ended. `engine_frames`: a frame model's
        (CSM, services/parts/csm_part.py) whole frames, one per token (`RequestOutput.new_frames`), taken as they are."""
        if engine_frames:
            self.audio_tokens += len(token_ids)
            return self.layout.codec_frames(engine_frames)
        frames: list[list[int]] = []
        layout = self.layout
        for token in token_ids:
            if self.ended or token == layout.end_of_speech:
                self.ended = True
                break
            try:
                code = layout.code_of(token, self.audio_tokens)
            except ValueError:  # cannot happen under the constraint; end the audio if it does
                log.warning("%s: token %d is not an audio token; ending", self.label, token)
                self.ended = True
                break
            self._frame.append(code)
            self.audio_tokens += 1
            if len(self._frame) == layout.frame_size:
                frames.append(self._frame)
                self._frame = []
        return frames
