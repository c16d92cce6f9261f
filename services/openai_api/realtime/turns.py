"""The user's side of a session: the input audio buffer, turn detection, and each committed turn's transcription.

Audio appended is decoded to 16 kHz (services/openai_api/realtime/audio_io.py) and, with `server_vad`, fed to the energy
detector of StreamingTranscribe (codecs/vad.py; `silence_duration_ms` is its end silence, `threshold` scales its start
margin). Its START is `speech_started` (and the barge-in that cancels a playing response); its END commits the
utterance, from `prefix_padding_ms` before its start to `END_PAD_MS` past its last voiced frame, as a user item.
Without turn detection the client commits (`input_audio_buffer.commit`: the whole buffer).

Every committed turn is transcribed by a served Whisper model (services/calls/whisper.py `transcribe`, the same pass as
Transcribe): the text model reads the transcript (a cascade: it hears no audio). The transcription events are sent
when the session's `audio.input.transcription` is set; the transcript is made either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnivox.codecs.vad import SpeechEvent, SpeechEventKind, VadConfig, VoiceActivityDetector
from omnivox.services.openai_api.realtime.audio_io import WHISPER_RATE, InputAudio
from omnivox.services.openai_api.realtime.config import TurnDetection
from omnivox.services.openai_api.realtime.protocol import RealtimeError

END_PAD_MS = 200  # past the last voiced frame: the detector's edges cut into soft endings (StreamingTranscribe's PAD_S)
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less than 100 ms of audio (input_audio_buffer_commit_empty)
IDLE_KEEP_MS = 2000  # audio kept while no one speaks (the prefix padding reaches back at most 2 s)


def vad_config(td: TurnDetection) -> VadConfig:
    start = 24.0 * td.threshold  # 0.5 -> the detector's documented 12 dB margin
    return VadConfig(sample_rate=WHISPER_RATE, end_silence_ms=td.silence_duration_ms, start_margin_db=start,
                     continue_margin_db=min(start, 6.0))  # fmt: skip


@dataclass
class Turn:
    """Committed audio: 16 kHz float32 samples [N] and where it lay in the session's audio (ms)."""

    samples: np.ndarray
    start_ms: int
    end_ms: int


class InputBuffer:
    """Audio since the last commit (16 kHz), positions counted over the whole session."""

    def __init__(self, fmt: str, turn_detection: TurnDetection | None, max_s: float) -> None:
        self.input = InputAudio(fmt)
        self.max_samples = round(max_s * WHISPER_RATE)
        self.samples = np.zeros(0, np.float32)
        self.start = 0  # session position of samples[0]
        self.received = 0  # samples appended over the session
        self.speech_start: int | None = None
        self.configure(turn_detection)

    def configure(self, turn_detection: TurnDetection | None) -> None:
        self.turn_detection = turn_detection
        self.vad = None if turn_detection is None else VoiceActivityDetector(vad_config(turn_detection))
        self.vad_offset = self.received  # the detector counts from where it was made
        self.speech_start = None

    def set_format(self, fmt: str) -> None:
        if fmt != self.input.format:
            self.input = InputAudio(fmt)

    @staticmethod
    def ms(position: int) -> int:
        return position * 1000 // WHISPER_RATE

    def append(self, data: bytes) -> list[SpeechEvent]:
        """Decode and keep the audio; the detector's events (offsets in session samples)."""
        pcm = self.input.feed(data)
        if self.vad is None and len(self.samples) + len(pcm) > self.max_samples:
            raise RealtimeError(f"the input audio buffer holds at most {self.max_samples // WHISPER_RATE} s; commit "
                                "or clear it", "audio", code="input_audio_buffer_full")  # fmt: skip
        self.samples = np.concatenate([self.samples, pcm])
        self.received += len(pcm)
        events = []
        if self.vad is not None:
            for ev in self.vad.feed(pcm):
                events.append(SpeechEvent(ev.kind, ev.offset + self.vad_offset, ev.decided_at + self.vad_offset,
                                          ev.cut))  # fmt: skip
                if ev.kind is SpeechEventKind.START:
                    self.speech_start = events[-1].offset
                else:
                    self.speech_start = None
        return events

    def trim(self) -> None:
        """While no one speaks keep IDLE_KEEP_MS; in speech everything from the padded start (bounded). Called
        after the events of an append were handled (an END commits audio from before it)."""
        if self.vad is None:
            return
        if self.speech_start is None:
            keep = self.received - IDLE_KEEP_MS * WHISPER_RATE // 1000
        else:
            keep = max(self.speech_start - 2 * WHISPER_RATE, self.received - self.max_samples)
        if keep > self.start:
            self.samples, self.start = self.samples[keep - self.start :], keep

    def take(self, start: int, end: int) -> Turn:
        """The samples [start, end) (clipped to what is held), and everything before `end` dropped."""
        a, b = max(start, self.start), min(end, self.received)
        clip = self.samples[a - self.start : max(a, b) - self.start].copy()
        self.samples, self.start = self.samples[max(b - self.start, 0) :], max(b, self.start)
        return Turn(clip, self.ms(a), self.ms(max(a, b)))

    def _padded(self, speech_start: int, end: int) -> tuple[int, int]:
        assert self.turn_detection is not None
        return speech_start - self.turn_detection.prefix_padding_ms * WHISPER_RATE // 1000, end

    def peek_speech(self, speech_start: int, voiced_end: int) -> Turn:
        """The span commit_speech would take for an END at `voiced_end` (nothing dropped)."""
        a, b = self._padded(speech_start, voiced_end + END_PAD_MS * WHISPER_RATE // 1000)
        a, b = max(a, self.start), min(b, self.received)
        return Turn(self.samples[a - self.start : max(a, b) - self.start].copy(), self.ms(a), self.ms(max(a, b)))

    def commit_speech(self, ev: SpeechEvent, speech_start: int) -> Turn:
        assert self.turn_detection is not None
        pad = self.turn_detection.prefix_padding_ms * WHISPER_RATE // 1000
        end = ev.offset if ev.cut else ev.offset + END_PAD_MS * WHISPER_RATE // 1000
        return self.take(speech_start - pad, end)

    def commit_all(self) -> Turn:
        if len(self.samples) < MIN_COMMIT_MS * WHISPER_RATE // 1000:
            held = len(self.samples) * 1000 // WHISPER_RATE
            raise RealtimeError(f"buffer too small: at least {MIN_COMMIT_MS} ms of audio is needed, {held} ms held",
                                None, code="input_audio_buffer_commit_empty")  # fmt: skip
        if self.vad is not None:
            self.vad.end_now()
            self.speech_start = None
        return self.take(self.start, self.received)

    def clear(self) -> None:
        self.samples, self.start = np.zeros(0, np.float32), self.received
        if self.vad is not None:
            self.vad.end_now()
        self.speech_start = None
