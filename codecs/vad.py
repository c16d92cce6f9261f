"""Energy-based voice activity detection on a stream of mono float32 samples (16 kHz by default).

The stream is cut into 30 ms frames counted from sample 0 (480 samples at 16 kHz); each frame's energy is
`10 log10(mean(x^2))` in dB relative to full scale (a full-scale square wave is 0 dBFS, a full-scale sine -3 dBFS).
Chunks of any size go in (`feed`); the remainder that does not fill a frame waits for the next chunk. Out come
`SpeechEvent`s: START at the first sample of the first voiced frame of an utterance, END after the last sample of its
last voiced frame, each with the stream position at which it was decided (`decided_at`, for latency accounting).

The thresholds, and why:
- Noise floor: tracks the lower envelope of the frame energies. It falls fast, by at most FLOOR_FALL_DB_PER_FRAME
  (3 dB per 30 ms frame: a 100 ms pause brings it down 9 dB, one odd quiet frame only 3 dB; measured: falling at
  once, the single frame where espeak-ng's digital silence meets the room's -60 dBFS noise, at -69.7 dBFS, pulled
  the floor 18 dB down, and the pause before the next sentence counted as speech). It rises by at most
  FLOOR_RISE_IDLE_DB_PER_S (6 dB/s) between utterances, FLOOR_RISE_SPEECH_DB_PER_S (3 dB/s) inside one. Speech has
  gaps (between words, stop closures) every few hundred ms that pull the floor back down, so the rise in speech only
  matters for sound without dips: a steady noise or hum that got louder (a fan turned on) is learnt, and the
  utterance it opened ends, within about 3 s per 9 dB. Frames under FLOOR_MIN_DBFS (-70 dBFS) leave the floor where
  it is: digital silence (-inf, or -100 dBFS of dither) says nothing about the room, and following it down would make
  the room's own noise count as speech when it comes back. The floor starts at the first frame's energy capped at
  INITIAL_FLOOR_DBFS (-45 dBFS), so speech from the very first frame (espeak-ng starts at sample 0; normal speech is
  -35 .. -15 dBFS) is still heard; the price: a stream that opens with steady noise louder than -33 dBFS is heard as
  speech for its first seconds, until the floor catches up.
- START_MARGIN_DB (12 dB): a frame is voiced when it is this far above the floor. A 30 ms frame of stationary noise
  varies by well under 1 dB (white noise: 0.3 dB standard deviation over 480 samples), vowels are 20-40 dB above a
  quiet room; 12 dB keeps steady noise out and lets the onset of all but the softest consonants in.
- CONTINUE_MARGIN_DB (6 dB): inside an utterance the bar is lower (hysteresis), so weak consonants and trailing
  syllables 6-12 dB above the floor do not count as silence.
- START_MS (90 ms, 3 frames) of consecutive voiced frames open an utterance: a click or a door knock (< 90 ms) does
  not, the shortest stressed syllables (~100 ms) do.
- END_SILENCE_MS (600 ms) of unvoiced frames close it (the hangover): pauses between words are mostly under 300 ms,
  between sentences 500 ms and more, so 600 ms ends an utterance at a sentence break and not inside one.
- MAX_SPEECH_MS (29 s): an utterance this long is cut (END then START at the same sample), so each one fits a 30 s
  Whisper window with room for padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

FLOOR_MIN_DBFS = -70.0
INITIAL_FLOOR_DBFS = -45.0
FLOOR_RISE_IDLE_DB_PER_S = 6.0
FLOOR_RISE_SPEECH_DB_PER_S = 3.0
FLOOR_FALL_DB_PER_FRAME = 3.0
START_MARGIN_DB = 12.0
CONTINUE_MARGIN_DB = 6.0
FRAME_MS = 30
START_MS = 90
END_SILENCE_MS = 600
MAX_SPEECH_MS = 29_000


class SpeechEventKind(StrEnum):
    START = "start"
    END = "end"


@dataclass(frozen=True)
class SpeechEvent:
    kind: SpeechEventKind
    offset: int  # sample index: START = first sample of the utterance, END = one past its last sample
    decided_at: int  # samples of the stream seen when the event was decided (>= offset)
    cut: bool = False  # an END at MAX_SPEECH_MS: the speech goes on, in the utterance that STARTs at the same offset


@dataclass(frozen=True)
class VadConfig:
    """Settings of a VoiceActivityDetector; the defaults are the documented thresholds above."""

    sample_rate: int = 16000
    frame_ms: int = FRAME_MS
    start_margin_db: float = START_MARGIN_DB
    continue_margin_db: float = CONTINUE_MARGIN_DB
    start_ms: int = START_MS
    end_silence_ms: int = END_SILENCE_MS
    max_speech_ms: int = MAX_SPEECH_MS
    floor_min_dbfs: float = FLOOR_MIN_DBFS
    initial_floor_dbfs: float = INITIAL_FLOOR_DBFS
    floor_rise_idle_db_per_s: float = FLOOR_RISE_IDLE_DB_PER_S
    floor_rise_speech_db_per_s: float = FLOOR_RISE_SPEECH_DB_PER_S
    floor_fall_db_per_frame: float = FLOOR_FALL_DB_PER_FRAME

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.frame_ms <= 0:
            raise ValueError("sample_rate and frame_ms must be positive")
        if self.continue_margin_db > self.start_margin_db:
            raise ValueError("continue_margin_db must not exceed start_margin_db (the hysteresis would invert)")
        if not 0 < self.start_ms <= self.max_speech_ms or self.end_silence_ms <= 0:
            raise ValueError("need 0 < start_ms <= max_speech_ms and end_silence_ms > 0")

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000

    def frames(self, ms: int) -> int:
        """Whole frames covering `ms` milliseconds (at least one)."""
        return max(1, math.ceil(ms / self.frame_ms))


def frame_energies_dbfs(samples: np.ndarray, frame: int) -> np.ndarray:
    """Energy in dBFS of each whole `frame`-sample frame of `samples` [N] -> [N // frame] (silence: -inf)."""
    n = len(samples) // frame
    x = np.asarray(samples[: n * frame], dtype=np.float64).reshape(n, frame)
    with np.errstate(divide="ignore"):
        return 10.0 * np.log10(np.mean(x * x, axis=1))


class VoiceActivityDetector:
    """Streaming detector: `feed` chunks of any size, get START/END events; `flush` at the end of the stream."""

    def __init__(self, config: VadConfig | None = None) -> None:
        self.config = config or VadConfig()
        c = self.config
        self._frame = c.frame_samples
        self._start_frames = c.frames(c.start_ms)
        self._end_frames = c.frames(c.end_silence_ms)
        self._max_frames = max(self._start_frames, c.max_speech_ms // c.frame_ms)
        frame_s = c.frame_ms / 1000
        self._rise_idle = c.floor_rise_idle_db_per_s * frame_s
        self._rise_speech = c.floor_rise_speech_db_per_s * frame_s
        self._pending = np.zeros(0, np.float32)  # samples not yet in a whole frame
        self.position = 0  # samples consumed into whole frames
        self.floor_db: float | None = None
        self.in_speech = False
        self.speech_start: int | None = None  # offset of the open utterance
        self._run = 0  # consecutive voiced frames while idle
        self._run_start = 0
        self._silent = 0  # consecutive unvoiced frames while in speech
        self._last_voiced_end = 0
        self._speech_frames = 0

    @property
    def last_voiced_end(self) -> int:
        """One past the last sample of the latest voiced frame: where the open utterance's END would fall now."""
        return self._last_voiced_end

    def feed(self, samples: np.ndarray) -> list[SpeechEvent]:
        """Take the next samples [N] of the stream; return the events they decide."""
        data = np.concatenate([self._pending, np.asarray(samples, np.float32).reshape(-1)])
        whole = len(data) // self._frame * self._frame
        self._pending = data[whole:]
        events: list[SpeechEvent] = []
        for energy in frame_energies_dbfs(data[:whole], self._frame):
            self._step(float(energy), events)
        return events

    def end_now(self) -> list[SpeechEvent]:
        """Close an open utterance here, at its last voiced frame (push-to-talk released); the stream goes on, and
        speech that continues opens a new utterance after START_MS."""
        self._run = 0
        if not self.in_speech:
            return []
        self.in_speech, self.speech_start, self._silent = False, None, 0
        return [SpeechEvent(SpeechEventKind.END, self._last_voiced_end, self.position)]

    def flush(self) -> list[SpeechEvent]:
        """End of stream: close an open utterance at its last voiced frame (a partial last frame is ignored)."""
        self._pending = np.zeros(0, np.float32)
        return self.end_now()

    def _step(self, energy: float, events: list[SpeechEvent]) -> None:
        c = self.config
        start, end = self.position, self.position + self._frame
        self.position = end
        if self.floor_db is None:
            self.floor_db = max(c.floor_min_dbfs, min(energy, c.initial_floor_dbfs))
        margin = c.continue_margin_db if self.in_speech else c.start_margin_db
        voiced = energy >= self.floor_db + margin
        # The floor: down fast, up slowly (slower inside an utterance). Frames under the minimum (digital silence,
        # a muted microphone, espeak-ng's gaps between words) say nothing about the room's noise: left out.
        if energy < c.floor_min_dbfs:
            pass
        elif energy < self.floor_db:
            self.floor_db = max(energy, self.floor_db - c.floor_fall_db_per_frame)
        else:
            rise = self._rise_speech if self.in_speech or self._run else self._rise_idle
            self.floor_db += min(energy - self.floor_db, rise)
        if not self.in_speech:
            if not voiced:
                self._run = 0
                return
            if self._run == 0:
                self._run_start = start
            self._run += 1
            self._last_voiced_end = end
            if self._run >= self._start_frames:
                self.in_speech, self.speech_start = True, self._run_start
                self._silent, self._run = 0, 0
                self._speech_frames = (end - self._run_start) // self._frame
                events.append(SpeechEvent(SpeechEventKind.START, self._run_start, end))
            return
        self._speech_frames += 1
        if voiced:
            self._silent = 0
            self._last_voiced_end = end
        else:
            self._silent += 1
        if self._silent >= self._end_frames:
            self.in_speech, self.speech_start = False, None
            events.append(SpeechEvent(SpeechEventKind.END, self._last_voiced_end, end))
        elif self._speech_frames >= self._max_frames:  # cut a too-long utterance; the next one starts here
            events.append(SpeechEvent(SpeechEventKind.END, end, end, cut=True))
            events.append(SpeechEvent(SpeechEventKind.START, end, end))
            self.speech_start, self._speech_frames, self._last_voiced_end = end, 0, end
