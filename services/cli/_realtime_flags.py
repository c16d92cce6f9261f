"""`omnivox serve --realtime-*`: the limits of each `GET /v1/realtime` session (services/openai_api/realtime/limits.py;
docs/operations.md "Realtime sessions")."""

from __future__ import annotations

import argparse

from omnivox.services.cli._common import CliError
from omnivox.services.openai_api.realtime.limits import RealtimeLimits

_DEFAULTS = RealtimeLimits()


def add_realtime_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("realtime voice sessions (GET /v1/realtime on --http-port)")
    g.add_argument("--realtime-max-session", type=float, default=_DEFAULTS.max_session_s, metavar="SECONDS",
                   help="a session this old gets a final error event (session_expired) and is closed (default: "
                   "%(default)g)")  # fmt: skip
    g.add_argument("--realtime-idle-timeout", type=float, default=_DEFAULTS.idle_timeout_s, metavar="SECONDS",
                   help="a session with no client event and nothing running this long is closed (idle_timeout; "
                   "default: %(default)g)")  # fmt: skip
    g.add_argument("--realtime-max-buffer", type=float, default=_DEFAULTS.max_buffer_s, metavar="SECONDS",
                   help="input audio a session holds uncommitted; past it appends get input_audio_buffer_full "
                   "(default: %(default)g)")  # fmt: skip
    g.add_argument("--realtime-max-events-per-second", type=float, default=_DEFAULTS.max_events_per_s,
                   metavar="N", help="client events per second per session (a bucket of N refilled each second; "
                   "20 ms appends are 50/s); past it: rate_limit_exceeded (default: %(default)g)")  # fmt: skip
    g.add_argument("--realtime-max-event-mib", type=float, default=_DEFAULTS.max_event_bytes / (1 << 20),
                   metavar="MIB", help="one client event at most this large: event_too_large (default: "
                   "%(default)g, OpenAI's)")  # fmt: skip


def realtime_limits(args: argparse.Namespace) -> RealtimeLimits:
    """The flags as RealtimeLimits; CliError naming the first flag whose value is not positive."""
    values = {
        "--realtime-max-session": args.realtime_max_session,
        "--realtime-idle-timeout": args.realtime_idle_timeout,
        "--realtime-max-buffer": args.realtime_max_buffer,
        "--realtime-max-events-per-second": args.realtime_max_events_per_second,
        "--realtime-max-event-mib": args.realtime_max_event_mib,
    }
    for flag, value in values.items():
        if not value > 0:
            raise CliError(f"{flag} must be positive")
    return RealtimeLimits(
        max_session_s=args.realtime_max_session,
        idle_timeout_s=args.realtime_idle_timeout,
        max_buffer_s=args.realtime_max_buffer,
        max_events_per_s=args.realtime_max_events_per_second,
        max_event_bytes=int(args.realtime_max_event_mib * (1 << 20)),
    )
