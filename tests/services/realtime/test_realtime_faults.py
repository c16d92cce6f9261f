"""GET /v1/realtime under faults and limits, with the embedded defaults in one real server: barge-in cancels at once
and frees the engine, a socket killed mid-response leaks nothing, malformed events get `error` and the session goes
on, the events-per-second, buffer, session-length and idle limits, the drain's final event, Bearer keys and quotas."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time

import pytest
from support.realtime_support import QUESTION, STORY, TEXT_ONLY, engine_idle, metric_values, run, url
from support.service_harness import nothing_left

from omnivox.benchmarks.realtime_sessions import RawSession
from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="no espeak-ng")]


def test_malformed_events_get_errors_and_the_session_goes_on(server):
    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        errors = []
        for bad in ("{not json", json.dumps({"type": "no.such.event", "event_id": "e1"}),
                    json.dumps({"type": "session.update", "event_id": "e2", "session": {"output_modalities": ["x"]}}),
                    json.dumps({"type": "input_audio_buffer.append", "event_id": "e3", "audio": "***"}),
                    json.dumps({"type": "conversation.item.truncate", "event_id": "e4", "item_id": "nope",
                                "content_index": 0, "audio_end_ms": 5})):  # fmt: skip
            await session.ws.send(bad)
            errors.append((await session.until("error"))["error"])
        await session.send({"type": "session.update", "session": TEXT_ONLY})
        await session.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": QUESTION}]}})  # fmt: skip
        await session.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        done = await session.until("response.done")
        await session.close()
        return errors, done

    errors, done = run(talk())
    assert [e["event_id"] for e in errors] == [None, "e1", "e2", "e3", "e4"]
    assert [e["param"] for e in errors[2:]] == ["session.output_modalities", "audio", "item_id"]
    assert done["response"]["status"] in ("completed", "incomplete")
    nothing_left(server, DEFAULT_MODEL_NAME)


def test_barge_in_cancels_the_response_and_truncate_trims_what_was_heard(server, question_pcm):
    """Speech starting while an answer plays cancels it at once (response.done cancelled / turn_detected, no KV
    block held); no audio delta of the cancelled response goes out after speech_started, even one already rendered
    and queued for the socket; conversation.item.truncate trims the assistant item's transcript to the audio played."""

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {"type": "realtime", "temperature": 0}})
        await session.send({"type": "conversation.item.create", "item": STORY})
        await session.send({"type": "response.create"})
        seen: list = []
        for _ in range(3):  # ~0.6 s of the answer played
            await session.until("response.output_audio.delta", seen=seen)
        item_id = next(e["item"]["id"] for e in seen if e["type"] == "response.output_item.added")
        interrupting = asyncio.create_task(session.stream(question_pcm, realtime=False, silence_ms=1200))
        done = await session.until("response.done", seen=seen)
        stopped_audio = sum(e["type"] == "response.output_audio.delta" for e in seen)
        # at response.done the text model's request is aborted and its KV blocks freed (the interruption's own
        # answer cannot start before its Whisper pass, >= 0.3 s later)
        nothing_left(server, DEFAULT_MODEL_NAME, timeout=0.3)
        await session.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                            "audio_end_ms": 300})  # fmt: skip
        truncated = await session.until("conversation.item.truncated")
        await session.send({"type": "conversation.item.retrieve", "item_id": item_id})
        kept = (await session.until("conversation.item.retrieved"))["item"]
        await interrupting
        answer = await session.until("response.done", timeout=240)
        await session.close()
        return done, stopped_audio, truncated, kept, answer, seen

    done, stopped_audio, truncated, kept, answer, seen = run(talk())
    assert done["response"]["status"] == "cancelled", done["response"]
    cancelled = done["response"]["id"]
    started = next(i for i, e in enumerate(seen) if e["type"] == "input_audio_buffer.speech_started")
    late = [e for e in seen[started:] if e["type"] == "response.output_audio.delta" and e["response_id"] == cancelled]
    assert not late, f"{len(late)} audio deltas of the cancelled response after speech_started"
    # the cancel path (task cancelled, voice stopped, response.done queued) is one event-loop turn: 1 s is far above
    # it on a loaded 2-core machine (the benchmark measures it: barge_in_cancel_to_done_max_s)
    assert done["received_at"] - seen[started]["received_at"] < 1.0
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    full = done["response"]["output"][0]["content"][0]["transcript"]
    heard = kept["content"][0]["transcript"]
    assert truncated["audio_end_ms"] == 300 and len(heard) < len(full) and full.startswith(heard), (heard, full)
    assert answer["response"]["status"] == "completed"  # the interruption was heard and answered
    assert stopped_audio >= 3
    engine_idle(server)
    metrics = metric_values(server)
    assert metrics['omnivox_realtime_barge_in_seconds_count{model="smollm2-135m-instruct"}'] >= 1
    assert metrics['omnivox_realtime_turn_first_audio_seconds_count{model="smollm2-135m-instruct"}'] >= 1
    assert metrics['omnivox_realtime_responses_total{model="smollm2-135m-instruct",status="cancelled"}'] >= 1


def test_socket_killed_mid_response_leaks_nothing(server):
    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "conversation.item.create", "item": STORY})
        await session.send({"type": "response.create"})
        await session.until("response.output_audio.delta")
        session.ws.transport.abort()  # no close handshake: the socket just dies
        session.reader.cancel()

    run(talk())
    engine_idle(server)
    route = server.server.http.realtime
    deadline = time.monotonic() + 10
    while route.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not route.sessions
    assert metric_values(server)['omnivox_realtime_sessions_active{model="smollm2-135m-instruct"}'] == 0


def test_limits_events_per_second_and_idle_timeout(server):
    from omnivox.services.openai_api.realtime.session import RealtimeLimits

    route = server.server.http.realtime
    before = route.limits
    route.limits = RealtimeLimits(max_events_per_s=5, idle_timeout_s=0.5)

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        for _ in range(12):
            await session.send({"type": "input_audio_buffer.clear"})
        seen: list = []
        final = await session.until("error", seen=seen)
        while final["error"]["code"] != "idle_timeout":
            final = await session.until("error", seen=seen)
        await asyncio.wait_for(session.reader, 10)  # the server closed the socket after its final event
        return seen, session.ws.close_code

    try:
        seen, close_code = run(talk())
    finally:
        route.limits = before
    cleared = sum(e["type"] == "input_audio_buffer.cleared" for e in seen)
    limited = [e for e in seen if e["type"] == "error" and e["error"]["code"] == "rate_limit_exceeded"]
    assert 5 <= cleared < 12 and len(limited) == 12 - cleared, [e["type"] for e in seen]
    assert close_code == 1000


def test_drain_closes_sessions_with_a_final_event(server):
    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        server.registry.draining = True
        try:
            final = await session.until("error", timeout=10)
            await asyncio.wait_for(session.reader, 10)
        finally:
            server.registry.draining = False
        return final, session.ws.close_code

    final, close_code = run(talk())
    assert final["error"]["code"] == "server_shutting_down" and close_code == 1012


def test_bearer_key_and_quota_hold_for_the_session(server):
    """With keys, the upgrade needs `Authorization: Bearer KEY` (401 with OpenAI's error JSON otherwise), and an
    open session holds one of its caller's concurrent streams (a second is refused 429 with max_concurrent 1)."""
    import websockets

    from omnivox.services.grpc_api.auth import AuthInterceptor, Quota, digest

    front = server.server.http
    before = front.auth
    front.auth = AuthInterceptor({digest("key-of-bob-456"): "bob"}, quota=Quota(max_concurrent=1))

    async def talk():
        statuses = []
        for key in (None, "wrong"):
            with pytest.raises(websockets.InvalidStatus) as info:
                await RawSession.open(url(server), api_key=key)
            body = json.loads(info.value.response.body)
            statuses.append((info.value.response.status_code, body["error"]["type"]))
        session = await RawSession.open(url(server), api_key="key-of-bob-456")
        created = await session.until("session.created")
        with pytest.raises(websockets.InvalidStatus) as info:
            await RawSession.open(url(server), api_key="key-of-bob-456")
        statuses.append((info.value.response.status_code, None))
        await session.close()
        return statuses, created

    try:
        statuses, created = run(talk())
    finally:
        front.auth = before
    assert statuses == [(401, "authentication_error"), (401, "authentication_error"), (429, None)]
    assert created["session"]["model"] == DEFAULT_MODEL_NAME


def test_buffer_limit_and_session_length(server):
    """Without turn detection the buffer holds at most max_buffer_s (more: input_audio_buffer_full, the append
    refused); an empty commit is refused; a session past max_session_s ends with session_expired."""
    from omnivox.services.openai_api.realtime.session import RealtimeLimits

    route = server.server.http.realtime
    before = route.limits
    route.limits = RealtimeLimits(max_buffer_s=0.5, max_session_s=1.5)

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {"type": "realtime",
                            "audio": {"input": {"turn_detection": None}}}})  # fmt: skip
        await session.until("session.updated")
        second = base64.b64encode(bytes(48000)).decode()  # 1 s of pcm16 at 24 kHz
        await session.send({"type": "input_audio_buffer.append", "event_id": "big", "audio": second})
        full = (await session.until("error"))["error"]
        await session.send({"type": "input_audio_buffer.commit", "event_id": "empty"})
        empty = (await session.until("error"))["error"]
        expired = (await session.until("error", timeout=10))["error"]
        await asyncio.wait_for(session.reader, 10)
        return full, empty, expired

    try:
        full, empty, expired = run(talk())
    finally:
        route.limits = before
    assert (full["code"], full["event_id"]) == ("input_audio_buffer_full", "big")
    assert (empty["code"], empty["event_id"]) == ("input_audio_buffer_commit_empty", "empty")
    assert expired["code"] == "session_expired"
