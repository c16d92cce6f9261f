"""One arbiter across the process's engines: audio with a deadline steps before text, which has none.

Each served model has its own engine thread, and on a CPU they all compete for the same cores (on a GPU, the same
device). Measured before this (issue 33, embedded defaults, 6 text streams + 2 speech syntheses + 2 transcriptions):
speech first audio p50 20 s and RTF 2.0, every speech stream ran dry, while text kept a 1.2 s TTFT.

Two kinds of audio stream hold a deadline (a monotonic time): a speech stream's is when its listener's buffer runs
dry (before its first audio: its first-audio target; services/metrics.py SpeechStreamMetrics moves it on every chunk
sent); a transcription pass's is its start plus its clip's seconds (RTF 1: a batch Transcribe no slower than real
time, a live stream's passes keeping up with its audio; services/calls/whisper.py opens it). A stream is behind when
its deadline is within `margin_s` and it has work in its engine now (`working`; by default its engine having any
unfinished request; a speech stream's sender counts its codec's backlog too, services/output/speech_synthesis.py
`working`: mixed_load on 2 cores at load ~7, two speech streams of 9.8 s each over a 23.6 s round, the speech
engine thread was runnable 8 s and the codec's 19 s, and with engine work alone the stream was not behind while its
codec worked through the rest and nothing yielded to it). A stream with no work
has nothing to prioritise and is never behind: a streamed-text synthesis waiting for its client's next clause once
its audio is out (its deadline passes while it waits, and counting it held every text step back for as long as the
client paused).

Policy in one line: an engine none of whose own streams is behind yields its step (waits, up to `max_wait_s`,
polling every `poll_s`) while another engine's stream is behind; an engine with a stream of its own behind never
yields. So a text engine (no deadlines) yields to any audio behind, and an audio engine whose streams are all ahead
of their deadlines yields too: the nearest deadline goes first. Measured (mixed_load, 2 cores, load ~8): whisper-base
transcribing 6 s clips at RTF 0.12, due at RTF 1, never yielded and took 25 % of the server's CPU while both speech
streams ran at RTF 2.1. A transcription pass is due at RTF 1 of its clip (services/parts/whisper_part.py), so its
engine yields only until the pass is within `margin_s` of that: a short live pass (1 s of audio, margin 1 s) is
behind at once and never waits, and a batch clip still finishes within its RTF 1. (Before transcriptions had a
deadline they yielded every step to an always-behind speech stream: mixed_load measured transcription RTF 1.83 ->
4.35.) The engine also reads `behind_for` after its wait: a text step taken while audio is still behind carries at
most StepBudget.behind_prefill_tokens of prompt (engine/step_budget.py), so its turn on the cores is short. Yielding
is bounded, so every engine progresses: at worst one step each `max_wait_s`.

The engine knows nothing of gRPC: the arbiter sees engines as things with unfinished requests (an engine-less voice's
worker pool, services/parts/voice_part.py, is one too: its streams are behind like any other, and it never steps), and
deadlines as monotonic times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Stepping(Protocol):
    def has_unfinished(self) -> bool: ...


class PlaybackDeadline:
    """One audio stream's deadline as its sender reports it: the monotonic time its listener's buffer runs dry (a
    transcription pass: when its result is due)."""

    def __init__(
        self, arbiter: StepArbiter, owner: Stepping, dry_at: float, working: Callable[[], bool] | None = None
    ) -> None:
        """working: whether this stream has work in owner now (None: owner has any unfinished request)."""
        self.arbiter, self.owner, self.dry_at, self.working = arbiter, owner, dry_at, working

    def has_work(self) -> bool:
        return self.working() if self.working is not None else self.owner.has_unfinished()

    def update(self, dry_at: float) -> None:
        """The listener now runs dry at dry_at (audio was sent, or its playback stalled)."""
        with self.arbiter.cond:
            self.dry_at = dry_at
            self.arbiter.cond.notify_all()

    def close(self) -> None:
        self.arbiter.close(self)

    def __enter__(self) -> PlaybackDeadline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepArbiter:
    def __init__(
        self,
        margin_s: float = 1.0,
        max_wait_s: float = 0.1,
        poll_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """margin_s: a stream whose buffer runs dry sooner than this is behind (0: the arbiter is off) (a speech engine's next chunk takes
        several steps plus a codec pass). max_wait_s: the longest one step of another engine waits."""
        self.margin_s, self.max_wait_s, self.poll_s, self.clock = margin_s, max_wait_s, poll_s, clock
        self.cond = threading.Condition()
        self.deadlines: list[PlaybackDeadline] = []
        # Called after every yield with (engine, seconds waited) on the yielding engine's thread; must not raise.
        self.yield_observers: list[Callable[[Stepping, float], None]] = []

    def open(
        self, owner: Stepping, due_in_s: float = 1.0, working: Callable[[], bool] | None = None
    ) -> PlaybackDeadline:
        """A stream of owner's starting now, due in due_in_s (a speech stream's first audio: `update` then moves its
        deadline on); working: whether it has work in owner now (None: owner has any unfinished request)."""
        deadline = PlaybackDeadline(self, owner, self.clock() + due_in_s, working)
        with self.cond:
            self.deadlines.append(deadline)
        return deadline

    def close(self, deadline: PlaybackDeadline) -> None:
        with self.cond:
            if deadline in self.deadlines:
                self.deadlines.remove(deadline)
            self.cond.notify_all()

    def behind(self, now: float | None = None) -> list[PlaybackDeadline]:
        """The streams behind their deadline now whose engine still has work for them."""
        if self.margin_s <= 0:  # off
            return []
        now = self.clock() if now is None else now
        with self.cond:
            return [d for d in self.deadlines if d.dry_at - now < self.margin_s and d.has_work()]

    def serves_audio(self, engine: Stepping) -> bool:
        """engine has work for an audio stream of its own now."""
        with self.cond:
            return any(d.owner is engine and d.has_work() for d in self.deadlines)

    def behind_for(self, engine: Stepping, now: float | None = None) -> list[PlaybackDeadline]:
        """The streams behind that engine yields to: other engines' while none of its own is behind."""
        behind = self.behind(now)
        if any(d.owner is engine for d in behind):
            return []
        return behind

    def must_yield(self, engine: Stepping, now: float | None = None) -> bool:
        return bool(self.behind_for(engine, now))

    def wait_turn(self, engine: Stepping) -> float:
        """Called by an engine's thread before each step: wait while must_yield (at most max_wait_s); returns the
        seconds waited (0.0 when it was this engine's turn)."""
        start = self.clock()
        if not self.must_yield(engine, start):
            return 0.0
        with self.cond:
            while self.clock() - start < self.max_wait_s and self.must_yield(engine):
                self.cond.wait(self.poll_s)
        waited = self.clock() - start
        for observe in self.yield_observers:
            observe(engine, waited)
        return waited
