"""A realtime session's limits (`omnivox serve --realtime-*`, services/cli/_realtime_flags.py; docs/operations.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealtimeLimits:
    max_session_s: float = 1800.0  # then a final `error` (session_expired) and the socket closes
    idle_timeout_s: float = 600.0  # no client event and nothing running this long: closed (idle_timeout)
    max_buffer_s: float = 60.0  # input audio held (uncommitted, without turn detection: appends refused past it)
    max_events_per_s: float = 200.0  # a bucket of this many events refilled per second (20 ms appends are 50/s)
    max_event_bytes: int = 15 << 20  # one client event (OpenAI's 15 MiB for an append)
