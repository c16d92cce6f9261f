"""One realtime session: its settings, conversation, input buffer, the running response, and the client events.

Client events are handled one at a time in arrival order (`handle`); the work they start runs in tasks: a turn's
transcription (`_transcribe`), a response (`_respond`: it waits for the transcripts of the turns before it, then runs
services/openai_api/realtime/response.py). One response at a time, as OpenAI's. Server events go through one queue to the
socket (`emit`, sent by the route's sender); the audio deltas of a response cancelled meanwhile are dropped there.

Barge-in: the detector's START while a response runs (and `interrupt_response`) cancels it at once, as
response.cancel does: its engine request aborts (KV blocks freed), the voice stops, queued audio is dropped, and
response.done says `cancelled` / `turn_detected`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from omnivox.codecs.vad import SpeechEvent, SpeechEventKind
from omnivox.services.openai_api.realtime.audio_io import decode_base64
from omnivox.services.openai_api.realtime.config import OPENAI_VOICES, SessionConfig
from omnivox.services.openai_api.realtime.conversation import Conversation, Item, check_item, dumps
from omnivox.services.openai_api.realtime.limits import RealtimeLimits
from omnivox.services.openai_api.realtime.protocol import Event, RealtimeError, an_object, error_event, new_id, typed
from omnivox.services.openai_api.realtime.response import ResponseRun
from omnivox.services.openai_api.realtime.transcripts import TurnTranscriber
from omnivox.services.openai_api.realtime.turns import InputBuffer, Turn

log = logging.getLogger(__name__)


@dataclass
class Models:
    text: Any  # ServedModel with an engine
    voice: Any  # ServedModel whose bundle holds a VoicePart, or None (text output only)
    whisper: Any  # ServedModel whose bundle holds a WhisperPart, or None (no audio input)


class RealtimeSession:
    def __init__(self, models: Models, registry: Any, metrics: Any, limits: RealtimeLimits, stats: Any) -> None:
        """`metrics`: the server's (Generate's metrics); `stats`: services/openai_api/realtime/metrics.py's."""
        self.models, self.registry, self.metrics, self.limits, self.stats = models, registry, metrics, limits, stats
        self.id = new_id("sess")
        self.config = SessionConfig(model=models.text.name)
        if models.voice is None:  # nothing to speak with: text answers (session.update cannot ask for audio)
            self.config.output_modalities = ["text"]
        self.conversation = Conversation()
        self.buffer = InputBuffer(self.config.input_format, self.config.turn_detection, limits.max_buffer_s)
        self.out: asyncio.Queue[tuple[Event, str | None] | None] = asyncio.Queue()
        self.cancelled: set[str] = set()  # responses whose queued audio deltas are dropped
        self.response: ResponseRun | None = None
        self.response_task: asyncio.Task | None = None
        self.transcriptions: dict[str, asyncio.Task] = {}  # item id -> its transcription
        self.tasks: set[asyncio.Task] = set()
        self.speech: tuple[str, int] | None = None  # (item id, start sample) of the open utterance
        self.started = self.last_event = time.monotonic()
        self.tokens, self.refilled = limits.max_events_per_s, self.started
        self.transcriber = TurnTranscriber(self)
        self.finished_responses: list[ResponseRun] = []  # for the benchmark's and tests' accounting (last 16)

    # --- out ---------------------------------------------------------------------------------------------------
    def emit(self, event: Event, response_id: str | None = None) -> None:
        event = {"event_id": new_id("event"), **event}
        self.out.put_nowait((event, response_id))

    def wire(self, item: tuple[Event, str | None]) -> str | None:
        """The text to send for a queued event; None to drop it (audio of a cancelled response)."""
        event, response_id = item
        if response_id in self.cancelled and event["type"] == "response.output_audio.delta":
            return None
        return dumps(event)

    def start(self) -> None:
        self.emit({"type": "session.created", "session": self.config.wire(self.id)})

    # --- in ----------------------------------------------------------------------------------------------------
    def handle(self, text: str) -> None:
        """One client event; a bad one becomes an `error` event carrying its event_id, and the session goes on."""
        self.last_event = now = time.monotonic()
        event_id = None
        try:
            self.tokens = min(self.limits.max_events_per_s, self.tokens + (now - self.refilled) *
                              self.limits.max_events_per_s)  # fmt: skip
            self.refilled = now
            if len(text) > self.limits.max_event_bytes:
                raise RealtimeError(f"the event is {len(text)} bytes; at most {self.limits.max_event_bytes}", None,
                                    code="event_too_large")  # fmt: skip
            try:
                event = json.loads(text)
            except ValueError as exc:
                raise RealtimeError(f"the event is not JSON: {exc}", None, code="invalid_json") from None
            event = an_object(event, "event")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            if self.tokens < 1:
                raise RealtimeError(f"more than {self.limits.max_events_per_s:g} events per second; event dropped",
                                    None, code="rate_limit_exceeded", kind="rate_limit_error")  # fmt: skip
            self.tokens -= 1
            kind = event.get("type")
            handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError(f"unknown or unsupported event type {kind!r}", "type", code="invalid_event_type")
            handler(self, event)
        except RealtimeError as err:
            self.emit(error_event(err, event_id))
        except Exception as exc:  # noqa: BLE001 - a bug in one event's handling: reported, the session goes on
            log.exception("realtime event failed")
            err = RealtimeError(f"{type(exc).__name__}: {exc}", None, code="server_error", kind="server_error")
            self.emit(error_event(err, event_id))

    def session_update(self, event: Event) -> None:
        session = an_object(event.get("session"), "session")
        new = self.config.updated(session)
        self._check_config(new)
        self.config = new
        self.buffer.set_format(new.input_format)
        if "audio" in session and "turn_detection" in (session["audio"].get("input") or {}):
            self.buffer.configure(new.turn_detection)
            self.speech = None
            self.transcriber.cancel()
        self.emit({"type": "session.updated", "session": new.wire(self.id)})

    def _check_config(self, cfg: SessionConfig) -> None:
        voice = self.models.voice
        if cfg.output_modalities == ["audio"] and voice is None:
            raise RealtimeError("this server serves no voice model: output_modalities must be [\"text\"]",
                                "session.output_modalities")  # fmt: skip
        if voice is not None:
            names = voice.bundle.voice.voice.voices
            if cfg.voice not in names and cfg.voice not in OPENAI_VOICES:
                raise RealtimeError(f"no voice {cfg.voice!r} (voices: {', '.join(names)}, or an OpenAI voice name, "
                                    "spoken by the default voice)", "session.audio.output.voice")  # fmt: skip

    def append(self, event: Event) -> None:
        data = decode_base64(event.get("audio"), "audio")
        if self.models.whisper is None:
            raise RealtimeError("this server serves no Whisper model: audio input cannot be transcribed", "audio")
        for ev in self.buffer.append(data):
            self._speech_event(ev)
        self.transcriber.watch(self.buffer, self.speech)
        self.buffer.trim()

    def _speech_event(self, ev: SpeechEvent) -> None:
        ms = self.buffer.ms(ev.offset)
        if ev.kind is SpeechEventKind.START:
            item_id = new_id("item")
            self.speech = (item_id, ev.offset)
            self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms, "item_id": item_id})
            td = self.buffer.turn_detection
            if td is not None and td.interrupt_response and self.response_task is not None:
                self.cancel_response("turn_detected")
            return
        if self.speech is None:
            return
        item_id, start = self.speech
        self.speech = None
        self.emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms, "item_id": item_id})
        early = None if ev.cut else self.transcriber.take(start, ev.offset)
        self._commit(self.buffer.commit_speech(ev, start), item_id, early)
        td = self.buffer.turn_detection
        if td is not None and td.create_response and self.response_task is None:
            self._start_response({}, turn_end=time.monotonic())

    def commit(self, event: Event) -> None:
        if self.models.whisper is None:
            raise RealtimeError("this server serves no Whisper model: audio input cannot be transcribed", None)
        item_id = self.speech[0] if self.speech is not None else new_id("item")
        self.speech = None
        self.transcriber.cancel()
        self._commit(self.buffer.commit_all(), item_id)

    def _commit(self, turn: Turn, item_id: str, early: asyncio.Task | None = None) -> None:
        previous = self.conversation.last_id()
        self.emit({"type": "input_audio_buffer.committed", "item_id": item_id, "previous_item_id": previous})
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}  # fmt: skip
        self._add_item(item, None)
        self._spawn_transcription(item, turn, early)

    def clear(self, event: Event) -> None:
        self.transcriber.cancel()
        self.buffer.clear()
        self.speech = None
        self.emit({"type": "input_audio_buffer.cleared"})

    def item_create(self, event: Event) -> None:
        item = check_item(event.get("item"))
        previous = typed(event, "previous_item_id", (str,), "an item id", "previous_item_id")
        audio = [p for p in item.get("content", ()) if p.get("type") == "input_audio" and not p.get("transcript")]
        turns = []
        for i, part in enumerate(audio):
            if self.models.whisper is None:
                raise RealtimeError("this server serves no Whisper model", f"item.content[{i}].audio")
            pcm = decode_base64(part.pop("audio", None), f"item.content[{i}].audio")
            turns.append(_decoded(self.config.input_format, pcm, self.limits.max_buffer_s))
        for part in item.get("content", ()):
            part.pop("audio", None)  # not kept (nor echoed back): the transcript is what the text model reads
        self._add_item(item, previous)
        for turn in turns:
            self._spawn_transcription(item, turn)

    def _add_item(self, item: Item, previous_item_id: str | None) -> None:
        previous = self.conversation.add(item, previous_item_id)
        self.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        if item["type"] != "message" or not any(p.get("type") == "input_audio" for p in item["content"]):
            self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item})

    def item_truncate(self, event: Event) -> None:
        item_id, index, end = event.get("item_id"), event.get("content_index", 0), event.get("audio_end_ms")
        self.conversation.truncate(item_id, index, end)
        self.emit({"type": "conversation.item.truncated", "item_id": item_id, "content_index": index,
                   "audio_end_ms": end})  # fmt: skip

    def item_delete(self, event: Event) -> None:
        item_id = event.get("item_id")
        self.conversation.delete(item_id)
        if (task := self.transcriptions.pop(item_id, None)) is not None:
            task.cancel()
        self.emit({"type": "conversation.item.deleted", "item_id": item_id})

    def item_retrieve(self, event: Event) -> None:
        item = self.conversation.find(event.get("item_id"))
        self.emit({"type": "conversation.item.retrieved", "item": item})

    def response_create(self, event: Event) -> None:
        if self.response_task is not None:
            raise RealtimeError("a response is in progress: cancel it first, or wait for response.done", None,
                                code="conversation_already_has_active_response")  # fmt: skip
        overrides = an_object(event.get("response") or {}, "response")
        self._start_response(overrides)

    def response_cancel(self, event: Event) -> None:
        wanted = typed(event, "response_id", (str,), "a response id", "response_id")
        if self.response_task is None or wanted and self.response is not None and wanted != self.response.id:
            raise RealtimeError("no response in progress to cancel", "response_id", code="response_cancel_not_active")
        self.cancel_response("client_cancelled")

    # --- work ----------------------------------------------------------------------------------------------------
    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _spawn_transcription(self, item: Item, turn: Turn, early: asyncio.Task | None = None) -> None:
        self.transcriptions[item["id"]] = self.spawn(self.transcriber.transcribe_item(item, turn, early))

    def salt(self) -> str:
        from omnivox.services.processing.cache_salt import request_salt

        return request_salt(self.config.cache_salt, "session.cache_salt")

    def _start_response(self, overrides: dict[str, Any], turn_end: float | None = None) -> None:
        cfg = self.config.updated({}) if not overrides else self._response_config(overrides)
        out_of_band = overrides.get("conversation") == "none"
        context = overrides.get("input")
        run = ResponseRun(cfg, [], self.emit, self.registry, self.metrics,
                          self.models.voice.bundle.voice if self.models.voice else None,
                          None if out_of_band else self._add_response_item, self.conversation.spoken)  # fmt: skip
        self.response = run
        self.response_task = self.spawn(self._respond(run, context, turn_end))

    def _response_config(self, overrides: dict[str, Any]) -> SessionConfig:
        cfg = self.config.updated({})
        cfg.apply_common(overrides, "response")
        if (audio := overrides.get("audio")) is not None:
            out = an_object(an_object(audio, "response.audio").get("output") or {}, "response.audio.output")
            cfg.output_audio(out, "response.audio.output")
        if overrides.get("conversation") not in (None, "auto", "none"):
            raise RealtimeError("conversation must be auto or none", "response.conversation")
        if (context := overrides.get("input")) is not None and not isinstance(context, list):
            raise RealtimeError("input must be a list of items", "response.input")
        self._check_config(cfg)
        return cfg

    def _add_response_item(self, item: Item) -> str | None:
        return self.conversation.add(item)

    async def _respond(self, run: ResponseRun, context: list | None, turn_end: float | None) -> None:
        try:
            pending = [t for t in self.transcriptions.values() if not t.done()]
            await asyncio.gather(*pending, return_exceptions=True)  # the turns before this response, transcribed
            if context is not None:
                conversation = Conversation()
                for raw in context:
                    conversation.add(check_item(raw))
            else:
                conversation = self.conversation
            run.messages = conversation.messages(run.config.instructions)
            self.emit({"type": "rate_limits.updated", "rate_limits": [{"name": "requests", "limit": 1,
                       "remaining": 0, "reset_seconds": 0.0}]})  # fmt: skip
            await run.run()
        except RealtimeError as err:
            self.emit(error_event(err, None))
        finally:
            if self.response is run:
                self.response, self.response_task = None, None
            self.finished_responses = [*self.finished_responses[-15:], run]
            model = self.models.text.name
            self.stats.responses.labels(model, run.status).inc()
            if turn_end is not None and run.first_audio_at is not None:
                self.stats.turn_first_audio.labels(model).observe(run.first_audio_at - turn_end)
            if run.cancel_requested_at is not None and run.reason == "turn_detected":
                self.stats.barge_in.labels(model).observe(time.monotonic() - run.cancel_requested_at)

    def cancel_response(self, reason: str) -> None:
        run, task = self.response, self.response_task
        if run is None or task is None:
            return
        run.reason, run.cancel_requested_at = reason, time.monotonic()
        self.cancelled.add(run.id)
        task.cancel()
        self.response, self.response_task = None, None

    async def close(self) -> None:
        """Everything the session holds: responses and transcriptions cancelled (engine requests aborted)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def idle(self) -> bool:
        return not self.tasks and self.speech is None


def _decoded(fmt: str, data: bytes, max_s: float) -> Turn:
    """A conversation.item.create's input_audio, decoded to 16 kHz as appended audio is (no turn detection)."""
    buffer = InputBuffer(fmt, None, max_s)
    buffer.append(data)
    return Turn(buffer.samples, 0, buffer.ms(buffer.received))


_HANDLERS = {
    "session.update": RealtimeSession.session_update,
    "input_audio_buffer.append": RealtimeSession.append,
    "input_audio_buffer.commit": RealtimeSession.commit,
    "input_audio_buffer.clear": RealtimeSession.clear,
    "conversation.item.create": RealtimeSession.item_create,
    "conversation.item.truncate": RealtimeSession.item_truncate,
    "conversation.item.delete": RealtimeSession.item_delete,
    "conversation.item.retrieve": RealtimeSession.item_retrieve,
    "response.create": RealtimeSession.response_create,
    "response.cancel": RealtimeSession.response_cancel,
}
