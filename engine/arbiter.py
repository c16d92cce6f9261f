"""One arbiter across the process's engines: audio with a playback deadline steps before text, which has none.

Each served model has its own engine thread, and on a CPU they all compete for the same cores (on a GPU, the same
device). Measured before this (issue 33, embedded defaults, 6 text streams + 2 speech syntheses + 2 transcriptions):
speech first audio p50 20 s and RTF 2.0, every speech stream ran dry, while text kept a 1.2 s TTFT.

Policy in one line: an engine yields its step (waits, up to `max_wait_s`, polling every `poll_s`) while another
engine's stream is behind its playback deadline and none of its own is. A stream is behind when its listener's
buffer runs dry within `margin_s` (before its first audio: when the first-audio target is that close). The speech
path reports each stream's deadline through a `PlaybackDeadline` (services/metrics.py SpeechStreamMetrics moves it
on every chunk sent); a stream whose engine has no unfinished request (its codec finishing the tail, a client that
has not sent its next text) has nothing to prioritise and is not counted. Yielding is bounded, so text always
progresses: at worst one step each `max_wait_s`.

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
    """One audio stream's deadline as its sender reports it: the monotonic time its listener's buffer runs dry."""

    def __init__(self, arbiter: StepArbiter, owner: Stepping, dry_at: float) -> None:
        self.arbiter, self.owner, self.dry_at = arbiter, owner, dry_at

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

    def open(self, owner: Stepping, first_audio_s: float = 1.0) -> PlaybackDeadline:
        """A stream of owner's starting now: behind until its first audio unless that comes within first_audio_s
        (then `update` moves its deadline on)."""
        deadline = PlaybackDeadline(self, owner, self.clock() + first_audio_s)
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
            return [d for d in self.deadlines if d.dry_at - now < self.margin_s and d.owner.has_unfinished()]

    def must_yield(self, engine: Stepping, now: float | None = None) -> bool:
        behind = self.behind(now)
        return bool(behind) and all(d.owner is not engine for d in behind)

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
