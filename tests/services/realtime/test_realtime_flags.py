"""`omnivox serve --realtime-*`: the flags parse into RealtimeLimits (a bad value is a one-line CLI error), reach the
realtime route through ServerOptions, and hold in a real session (a tiny text model, no voice or Whisper needed); the
Whisper window flags the realtime turns share parse and are checked."""

from __future__ import annotations

import json

import pytest
from support.checkpoints import make_checkpoint
from support.realtime_support import run
from support.service_harness import ServerThread

from omnivox.benchmarks.realtime_sessions import RawSession
from omnivox.services.cli import build_parser
from omnivox.services.cli._common import CliError
from omnivox.services.cli._realtime_flags import realtime_limits
from omnivox.services.openai_api.realtime.limits import RealtimeLimits
from omnivox.services.parts.loading import EngineOptions, ModelSpec


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_flags_parse_into_limits_and_defaults_are_the_dataclass():
    assert realtime_limits(serve_args()) == RealtimeLimits()
    limits = realtime_limits(serve_args("--realtime-max-session", "90", "--realtime-idle-timeout", "5",
                                        "--realtime-max-buffer", "12.5", "--realtime-max-events-per-second", "3",
                                        "--realtime-max-event-mib", "1"))  # fmt: skip
    assert limits == RealtimeLimits(max_session_s=90, idle_timeout_s=5, max_buffer_s=12.5, max_events_per_s=3,
                                    max_event_bytes=1 << 20)  # fmt: skip
    for flag in ("--realtime-max-session", "--realtime-max-events-per-second", "--realtime-max-event-mib"):
        with pytest.raises(CliError, match=flag):
            realtime_limits(serve_args(flag, "0"))


def test_the_limits_hold_in_a_session(tmp_path):
    """--realtime-max-events-per-second 2 and --realtime-max-event-mib, through ServerOptions to a live session."""
    limits = realtime_limits(serve_args("--realtime-max-events-per-second", "2", "--realtime-max-event-mib", "0.001"))
    spec = ModelSpec(path=make_checkpoint(tmp_path / "tiny", family="llama"), name="tiny")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.02, device="cpu"), http_port=0,
                      realtime_limits=limits) as server:  # fmt: skip
        assert server.server.http.realtime.limits is limits

        async def talk():
            session = await RawSession.open(f"ws://127.0.0.1:{server.server.http_port}/v1/realtime?model=tiny")
            await session.until("session.created")
            await session.ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "x" * 2000}))
            too_large = (await session.until("error"))["error"]
            for i in range(4):  # the bucket holds 2, refilled at 2 a second: the 3rd and 4th of a burst are dropped
                await session.send({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": f"e{i}"})
            errors = [(await session.until("error"))["error"] for _ in range(4)]
            await session.close()
            return too_large, errors

        too_large, errors = run(talk())
    assert too_large["code"] == "event_too_large"
    assert [e["code"] for e in errors].count("rate_limit_exceeded") >= 2, errors


def test_whisper_window_flags():
    """--whisper-short-window (Transcribe's and StreamingTranscribe's rule) and --whisper-int8-short-window parse;
    a window that leaves no 3.5 s margin, or is the full one, is a one-line CLI error before anything loads."""
    from omnivox.services.cli.serve import check_server_flags

    args = serve_args("--whisper-short-window", "10", "--whisper-int8-short-window")
    assert (args.whisper_short_window, args.whisper_int8_short_window) == (10.0, True)
    check_server_flags(args)
    assert serve_args().whisper_short_window is None and not serve_args().whisper_int8_short_window
    for bad in ("3", "30"):
        with pytest.raises(CliError, match="--whisper-short-window"):
            check_server_flags(serve_args("--whisper-short-window", bad))
