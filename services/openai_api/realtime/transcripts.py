"""Each committed turn's transcript (services/calls/whisper.py `transcribe`, under the Whisper model's admission), and the
early pass that starts it before the turn is committed.

The early pass: the detector ends a turn after `silence_duration_ms` (500 by default) of silence, but the turn's
audio is known `END_PAD_MS` (200 ms) after its last voiced frame. So once that much silence follows, the pass starts
on exactly the span the commit will take; if speech comes back first, it is cancelled (its engine request aborts) and
a later one starts. At the END, a pass on the same span is the turn's transcription: the wait for the transcript
shrinks by silence_duration_ms - END_PAD_MS (300 ms by default).

A turn of up to TURN_WINDOW_S - SHORT_WINDOW_MARGIN_S (6.5 s) is encoded in a TURN_WINDOW_S (10 s) window, not the
30 s one Transcribe keeps (issue 31): whisper-base's encoder took 0.28x the time, word error rate 0.048 against 0.056
on 32 clips of 1.8-6.1 s, hibari and espeak-ng (BENCHMARKS.md "Whisper short windows"). Longer turns take 30 s.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services.calls.whisper import WhisperResult, transcribe
from omnivox.services.errors import ServiceError
from omnivox.services.openai_api.realtime.conversation import Item
from omnivox.services.openai_api.realtime.turns import END_PAD_MS, WHISPER_RATE, Turn

# The encoder window of a turn's pass (services/parts/whisper_part.py `encoder_frames`); OMNIVOX_TURN_WINDOW_S=30 gives
# every turn the 30 s window (the A/B switch of benchmarks/realtime_sessions.py --turn-window-s).
TURN_WINDOW_S = float(os.environ.get("OMNIVOX_TURN_WINDOW_S", "10"))


class TurnTranscriber:
    def __init__(self, session: Any) -> None:
        self.session = session
        self.early: tuple[tuple[int, int], asyncio.Task] | None = None  # ((start, last voiced end), its pass)

    async def run_pass(self, turn: Turn, on_text: Any = None) -> WhisperResult:
        whisper, cfg = self.session.models.whisper, self.session.config.transcription or {}
        # Due now (engine/arbiter.py): the speaker waits for this pass, so Whisper never yields to speech during it.
        with whisper.admit(), whisper.bundle.whisper.deadline(0):
            return await transcribe(whisper.bundle.whisper, turn.samples, language=cfg.get("language") or None,
                                    prompt=cfg.get("prompt") or None, on_text=on_text,
                                    cache_salt=self.session.salt(), encoder_window_s=TURN_WINDOW_S)  # fmt: skip

    # --- the early pass --------------------------------------------------------------------------------------------
    def watch(self, buffer: Any, speech: tuple[str, int] | None) -> None:
        """After an append: start the early pass once END_PAD_MS of silence follows the open utterance's last voiced
        frame; cancel one whose span speech has since grown past."""
        vad = buffer.vad
        if speech is None or vad is None or not vad.in_speech:
            return
        voiced_end = vad.last_voiced_end + buffer.vad_offset
        key = (speech[1], voiced_end)
        if self.early is not None and self.early[0] != key:
            self.cancel()
        if self.early is not None or vad.position + buffer.vad_offset - voiced_end < END_PAD_MS * WHISPER_RATE // 1000:
            return
        turn = buffer.peek_speech(speech[1], voiced_end)
        self.early = (key, self.session.spawn(self.run_pass(turn)))

    def take(self, start: int, voiced_end: int) -> asyncio.Task | None:
        """The early pass on exactly this span, if one runs (handed over); any other is cancelled."""
        early, self.early = self.early, None
        if early is not None and early[0] == (start, voiced_end):
            return early[1]
        if early is not None:
            early[1].cancel()
        return None

    def cancel(self) -> None:
        if self.early is not None:
            self.early[1].cancel()
            self.early = None

    # --- a turn's transcription -------------------------------------------------------------------------------------
    async def transcribe_item(self, item: Item, turn: Turn, early: asyncio.Task | None = None) -> None:
        """The item's transcript (its first content part), with the transcription events when the session asks."""
        session = self.session
        announce = session.config.transcription is not None
        part = item["content"][0]

        def delta(text: str) -> None:
            if announce and text:
                session.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item["id"],
                              "content_index": 0, "delta": text})  # fmt: skip

        async def on_text(text: str, index: int) -> None:
            delta(text)

        try:
            if early is not None:
                result = await early
                delta(result.text)
            else:
                result = await self.run_pass(turn, on_text)
        except (TranscriptionRequestError, ServiceError, RuntimeError) as err:
            part["transcript"] = ""
            if announce:
                session.emit({"type": "conversation.item.input_audio_transcription.failed", "item_id": item["id"],
                              "content_index": 0, "error": {"type": "transcription_error", "code": None,
                              "message": str(err), "param": None}})  # fmt: skip
            return
        part["transcript"] = result.text.strip()
        if announce:
            session.emit({"type": "conversation.item.input_audio_transcription.completed", "item_id": item["id"],
                          "content_index": 0, "transcript": part["transcript"],
                          "usage": {"type": "duration", "seconds": round(len(turn.samples) / WHISPER_RATE, 3)}})  # fmt: skip
        session.emit({"type": "conversation.item.done", "previous_item_id": None, "item": item})
