"""`GET /v1/realtime?model=NAME`: the WebSocket route on the HTTP front (services/openai_api/http_front.py mounts it).

Before the upgrade: the Bearer key (the HTTP front's CallGate, services/openai_api/http_call_gate.py: the same keys and
quotas; a session holds one of its caller's concurrent streams until it closes) and the models: `model` names a served
text model (default: the default model), the voice is the first served voice model (hibari out of the box), the
Whisper model the server's ASR model (or the first served). A refusal is an HTTP status with OpenAI's error JSON, as
the other routes.
After it, three tasks: the reader (client events, in order, into RealtimeSession.handle), the sender (the session's
event queue to the socket) and the watchdog (session length, idle timeout, the server's drain: each ends the
session with a final `error` event). However the session ends (the client closes, the socket dies, the server
stops), every task it started is cancelled: engine requests abort, KV blocks and admission slots are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from omnivox.services import call_record, errors
from omnivox.services.errors import Code, ServiceError
from omnivox.services.openai_api.realtime.limits import RealtimeLimits
from omnivox.services.openai_api.realtime.metrics import RealtimeMetrics
from omnivox.services.openai_api.realtime.protocol import RealtimeError, error_event
from omnivox.services.openai_api.realtime.session import Models, RealtimeSession

log = logging.getLogger(__name__)
WATCH_S = 0.1  # the watchdog's period
CLOSE_NORMAL, CLOSE_RESTART = 1000, 1012


def session_models(registry: Any, name: str) -> Models:
    text = registry.get_ready(registry.lookup(name).name)
    if text.engine is None or text.bundle is None or text.bundle.whisper is not None:
        raise errors.invalid_argument([errors.FieldViolation("model", f"model {text.name!r} is not a text model")])
    voice = next((m for m in registry if m.bundle is not None and m.bundle.voice is not None), None)
    whisper = None
    if registry.asr_model:
        whisper = registry.lookup(registry.asr_model)
    else:
        whisper = next((m for m in registry if m.bundle is not None and m.bundle.whisper is not None), None)
    return Models(text, voice, whisper)


class RealtimeRoute:
    """The route's state on the front: its limits and the sessions open (the tests and the drain read them)."""

    def __init__(self, front: Any, error_response: Any, limits: RealtimeLimits | None = None) -> None:
        """`front`: the HttpFront (registry, metrics, its CallGate); `error_response`: its ServiceError -> JSON."""
        self.front, self.error_response, self.limits = front, error_response, limits or RealtimeLimits()
        self.metrics = RealtimeMetrics(front.metrics.registry)
        self.sessions: set[RealtimeSession] = set()

    async def __call__(self, websocket: WebSocket) -> None:
        front = self.front
        record = call_record.CallRecord("Realtime")
        token = call_record.set_current_call(record)
        code, taken = Code.OK, None
        try:
            try:
                taken = front.gate.admit(websocket.headers.items(), record)
                models = session_models(front.registry, websocket.query_params.get("model", ""))
            except ServiceError as err:
                code = err.code
                await _deny(websocket, self.error_response(err))
                return
            await websocket.accept()
            record.set(model=models.text.name)
            session = RealtimeSession(models, front.registry, front.metrics, self.limits, self.metrics)
            self.sessions.add(session)
            self.metrics.sessions.labels(models.text.name).inc()
            try:
                await self._serve(websocket, session)
            finally:
                self.sessions.discard(session)
                await session.close()
                self.metrics.sessions.labels(models.text.name).dec()
        except asyncio.CancelledError:
            code = Code.CANCELLED
            raise
        finally:
            front.gate.end(record, code, taken)
            call_record.reset_current_call(token)

    async def _serve(self, websocket: WebSocket, session: RealtimeSession) -> None:
        session.start()
        tasks = [asyncio.create_task(self._read(websocket, session)),
                 asyncio.create_task(_send(websocket, session)),
                 asyncio.create_task(self._watch(session))]  # fmt: skip
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if (final := task.result()) is not None:  # the watchdog's final event, then the close
                    event, close_code = final
                    session.emit(event)
                    session.out.put_nowait(None)
                    await asyncio.wait_for(tasks[1], timeout=5)
                    with contextlib.suppress(Exception):
                        await websocket.close(close_code)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the client went away: what it held is freed below
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, websocket: WebSocket, session: RealtimeSession) -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return None
            text = message.get("text")
            if text is None:
                text = (message.get("bytes") or b"").decode("utf-8", "replace")
            session.handle(text)

    async def _watch(self, session: RealtimeSession) -> tuple[dict[str, Any], int]:
        limits = self.limits
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            if self.front.registry.draining:
                return _final("server_shutting_down", "the server is shutting down; reconnect", "server_error"), \
                    CLOSE_RESTART  # fmt: skip
            if now - session.started > limits.max_session_s:
                return _final("session_expired", f"the session hit its maximum duration of {limits.max_session_s:g} s"
                              ), CLOSE_NORMAL  # fmt: skip
            if session.idle() and now - session.last_event > limits.idle_timeout_s:
                return _final("idle_timeout", f"no event for {limits.idle_timeout_s:g} s"), CLOSE_NORMAL


def _final(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return error_event(RealtimeError(message, None, code=code, kind=kind), None)


async def _send(websocket: WebSocket, session: RealtimeSession) -> None:
    while (item := await session.out.get()) is not None:
        if (text := session.wire(item)) is not None:
            await websocket.send_text(text)


async def _deny(websocket: WebSocket, response: Any) -> None:
    """An HTTP status with OpenAI's error JSON instead of the upgrade (uvicorn's denial response extension), else a
    policy-violation close before accepting (the client sees a 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(response)
        return
    log.info("realtime refused: %s", json.loads(response.body)["error"]["message"])
    await websocket.close(1008)
