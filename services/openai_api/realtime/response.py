"""One response of a realtime session: the text model over the conversation (services/calls/generate_call.py, exactly a
Generate's request and output processing: tools, salts, metrics), and, for audio output, the voice speaking it clause
by clause as the text streams (services/processing/clauses.py cuts the clauses, services/parts/voice_part.py renders them).

    text deltas ──► output_audio_transcript.delta (or output_text.delta) ──► ClauseCutter ──► clause queue
    clause queue ──► voice.utterances ──► voice.render (worker thread) ──► OutputAudio ──► output_audio.delta

Cancelling the run's task (response.cancel, barge-in, a closed socket) closes the engine stream (the request aborts,
its KV blocks are freed), stops the voice, and ends the response `cancelled`; the session drops the audio deltas of a
cancelled response still queued for the socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnivox.models.voice.voice_model import VoiceSettings
from omnivox.services.calls.generate_call import generate_responses
from omnivox.services.errors import ServiceError
from omnivox.services.openai_api.openai_request import chat_request
from omnivox.services.openai_api.realtime.audio_io import OutputAudio
from omnivox.services.openai_api.realtime.config import SessionConfig
from omnivox.services.openai_api.realtime.conversation import Item, Spoken, function_call_item
from omnivox.services.openai_api.realtime.protocol import Event, new_id, usage
from omnivox.services.parts.voice_part import VoicePart
from omnivox.services.processing.clauses import DEFAULT_MAX_CLAUSE_CHARS, ClauseCutter
from omnivox.v1 import generation_pb2

# The first clause is cut at a word boundary past this many characters when no punctuation came sooner: the first
# audio waits for the first clause, and SmolLM2's first sentences often run 60-120 characters without a comma
# ("The African elephant is a massive and majestic creature that ..."), 1-2 s of decoding on a busy CPU.
FIRST_CLAUSE_CHARS = 40
AUDIO_DELTA_MS = 200  # audio is sent in deltas of at most this much: a client can stop playback at a fine grain
_FINISH = {generation_pb2.FINISH_REASON_LENGTH: ("incomplete", "max_output_tokens")}


@dataclass
class ResponseRun:
    """One response; `emit(event, response_id)` queues a server event for the socket."""

    config: SessionConfig
    messages: list[dict[str, Any]]
    emit: Callable[[Event, str | None], None]
    registry: Any
    metrics: Any
    voice: VoicePart | None
    add_item: Callable[[Item], str | None] | None  # None: an out-of-band response (conversation "none")
    spoken: dict[str, Spoken]
    id: str = field(default_factory=lambda: new_id("resp"))
    status: str = "in_progress"
    reason: str | None = None
    output: list[Item] = field(default_factory=list)
    message: Item | None = None
    text: list[str] = field(default_factory=list)
    first_audio_at: float | None = None  # time.monotonic() of the first audio delta queued
    last_audio_at: float | None = None
    cancel_requested_at: float | None = None  # time.monotonic() of response.cancel or the barge-in
    usage: dict[str, Any] = field(default_factory=usage)
    _clauses: asyncio.Queue = field(default_factory=asyncio.Queue)
    _speaker: asyncio.Task | None = None
    _audio: OutputAudio | None = None

    @property
    def audio(self) -> bool:
        return self.config.output_modalities == ["audio"] and self.voice is not None

    def wire(self) -> dict[str, Any]:
        details = None if self.reason is None else {"type": self.status, "reason": self.reason}
        return {"object": "realtime.response", "id": self.id, "status": self.status, "status_details": details,
                "output": self.output, "conversation_id": "conv_default" if self.add_item else None,
                "output_modalities": self.config.output_modalities, "usage": self.usage,
                "max_output_tokens": self.config.max_output_tokens or "inf",
                "audio": {"output": {"format": {"type": self.config.output_format}, "voice": self.config.voice}},
                "metadata": None}  # fmt: skip

    def _event(self, event: Event) -> None:
        self.emit(event, self.id)

    def _part_event(self, kind: str, **fields: Any) -> None:
        assert self.message is not None
        self._event({"type": kind, "response_id": self.id, "item_id": self.message["id"], "output_index":
                     self.output.index(self.message), "content_index": 0, **fields})  # fmt: skip

    async def run(self) -> None:
        self._event({"type": "response.created", "response": self.wire()})
        try:
            await self._generate()
            if self._speaker is not None:
                self._clauses.put_nowait(None)
                await self._speaker
            self.status = "completed" if self.status == "in_progress" else self.status
        except asyncio.CancelledError:
            self.status, self.reason = "cancelled", self.reason or "client_cancelled"
            raise
        except ServiceError as err:
            self.status, self.reason = "failed", None
            self.emit({"type": "error", "error": {"type": "server_error" if err.code.name == "INTERNAL" else
                       "invalid_request_error", "code": err.code.name.lower(), "message": err.message,
                       "param": None, "event_id": None}}, None)  # fmt: skip
        finally:
            if self._speaker is not None and not self._speaker.done():
                self._speaker.cancel()
                await asyncio.gather(self._speaker, return_exceptions=True)
            if self._audio is not None:
                self._audio.close()
            self._finish()

    def _body(self) -> dict[str, Any]:
        cfg = self.config
        body: dict[str, Any] = {"model": cfg.model, "messages": self.messages, "cache_salt": cfg.cache_salt}
        if cfg.tools and cfg.tool_choice != "none":
            body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                             "parameters")}} for t in cfg.tools]  # fmt: skip
            choice = cfg.tool_choice
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} if isinstance(
                choice, dict) else choice  # fmt: skip
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        if cfg.max_output_tokens is not None:
            body["max_tokens"] = cfg.max_output_tokens
        return body

    async def _generate(self) -> None:
        request = chat_request(self._body())
        request.request_id = uuid.uuid4().hex
        cutter = ClauseCutter(FIRST_CLAUSE_CHARS)
        calls: dict[int, Item] = {}
        responses = generate_responses(request, self.registry, self.metrics)
        async with contextlib.aclosing(responses):
            async for response in responses:
                if response.WhichOneof("response") == "summary":
                    self._summary(response.summary, calls)
                    break
                delta = response.delta
                if delta.text:
                    self._text(delta.text, cutter)
                for call in delta.tool_calls:
                    self._tool_delta(call, calls)
        if self.audio:
            for clause in cutter.flush():
                self._speak(clause)

    def _text(self, text: str, cutter: ClauseCutter) -> None:
        if self.message is None:
            self.message = {"id": new_id("item"), "object": "realtime.item", "type": "message", "role": "assistant",
                            "status": "in_progress", "content": []}  # fmt: skip
            self._add(self.message)
            part = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
            self._part_event("response.content_part.added", part=part)
        self.text.append(text)
        if not self.audio:
            self._part_event("response.output_text.delta", delta=text)
            return
        self._part_event("response.output_audio_transcript.delta", delta=text)
        for clause in cutter.feed(text):
            cutter.max_chars = DEFAULT_MAX_CLAUSE_CHARS  # after the first clause, the usual cuts
            self._speak(clause)

    def _add(self, item: Item) -> None:
        self.output.append(item)
        self._event({"type": "response.output_item.added", "response_id": self.id,
                     "output_index": len(self.output) - 1, "item": item})  # fmt: skip
        if self.add_item is not None:
            previous = self.add_item(item)
            self._event({"type": "conversation.item.added", "previous_item_id": previous, "item": item})

    def _tool_delta(self, call: Any, calls: dict[int, Item]) -> None:
        item = calls.get(call.index)
        if item is None:
            item = function_call_item(call.id or new_id("call"), call.name, "")
            item["status"] = "in_progress"
            calls[call.index] = item
            self._add(item)
        item["arguments"] += call.arguments
        if call.arguments:
            self._event({"type": "response.function_call_arguments.delta", "response_id": self.id,
                         "item_id": item["id"], "output_index": self.output.index(item),
                         "call_id": item["call_id"], "delta": call.arguments})  # fmt: skip

    def _summary(self, summary: generation_pb2.GenerateSummary, calls: dict[int, Item]) -> None:
        u = summary.usage
        self.usage = usage(u.prompt_tokens, u.output_tokens, u.cached_prompt_tokens)
        for index, call in enumerate(summary.tool_calls):  # the parsed calls are the truth (the deltas may lag)
            item = calls.get(index)
            if item is not None:
                item.update(arguments=call.arguments, name=call.name or item["name"])
        status = _FINISH.get(summary.finish_reason)
        if status is not None:
            self.status, self.reason = status

    def _speak(self, clause: str) -> None:
        if self._speaker is None:
            self._speaker = asyncio.create_task(self._speak_clauses())
        self._clauses.put_nowait(clause)

    async def _speak_clauses(self) -> None:
        assert self.voice is not None and self.message is not None
        voice = self.voice.voice
        name = self.config.voice if self.config.voice in voice.voices else voice.default_voice
        settings = VoiceSettings(name, self.config.speed, None)
        rng = np.random.default_rng()
        self._audio = out = OutputAudio(self.config.output_format, voice.sample_rate)
        spoken = self.spoken.setdefault(self.message["id"], Spoken())
        while (clause := await self._clauses.get()) is not None:
            start = out.ms
            for utterance in await self.voice.run(voice.utterances, clause):
                pcm = await self.voice.run(voice.render, utterance, settings, rng)
                self._send_audio(out.encode(pcm))
            spoken.clauses.append((start, out.ms, clause))
        self._send_audio(out.finish())

    def _send_audio(self, data: bytes) -> None:
        assert self._audio is not None
        step = max(2, self._audio.encoder.sample_rate * AUDIO_DELTA_MS // 1000 * (2 if self._audio.format ==
                   "audio/pcm" else 1))  # fmt: skip
        for i in range(0, len(data), step):
            now = time.monotonic()
            self.first_audio_at = self.first_audio_at or now
            self.last_audio_at = now
            self._part_event("response.output_audio.delta", delta=base64.b64encode(data[i : i + step]).decode())

    def _finish(self) -> None:
        """The done events of every output item, then response.done (also when cancelled or failed)."""
        item_status = "completed" if self.status == "completed" else "incomplete"
        if self.message is not None:
            text = "".join(self.text)
            if self.audio:
                self._part_event("response.output_audio.done")
                self._part_event("response.output_audio_transcript.done", transcript=text)
                part = {"type": "audio", "transcript": text}
                self.message["content"] = [{"type": "output_audio", "transcript": text}]
            else:
                self._part_event("response.output_text.done", text=text)
                part = {"type": "text", "text": text}
                self.message["content"] = [{"type": "output_text", "text": text}]
            self._part_event("response.content_part.done", part=part)
        for index, item in enumerate(self.output):
            item["status"] = item_status
            if item["type"] == "function_call":
                self._event({"type": "response.function_call_arguments.done", "response_id": self.id,
                             "item_id": item["id"], "output_index": index, "call_id": item["call_id"],
                             "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
            self._event({"type": "response.output_item.done", "response_id": self.id, "output_index": index,
                         "item": item})  # fmt: skip
            if self.add_item is not None:
                self._event({"type": "conversation.item.done", "item": item})
        self._event({"type": "response.done", "response": self.wire()})
