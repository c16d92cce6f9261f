"""StreamingSynthesizeSpeech: text streamed in (as an LLM writes it), audio streamed out.

    config -> text chunks -> end      (client)
    format -> audio chunks -> summary (server, as SynthesizeSpeech)

Text is cut into clauses as it arrives (`ClauseCutter`: after , ; : . ! ? followed by a space, after CJK punctuation
(。！？，、；：, which no space follows), or at a space once a clause reaches max_clause_chars). Text that ends at such
punctuation with nothing after it is a complete clause once no more text comes for SETTLE_S (it may still be "3.5" or
"?!" arriving token by token): a client that sends one sentence and waits for its audio before sending more gets it.
Clauses are synthesised one after another, each with the previous clause's text and its last CONTEXT_FRAMES of codes
as a prior turn (`SpeechLayout.build_reference_prompt`), so the voice and prosody carry over. All clauses' frames go
into ONE codec stream: the streaming decoder's windows and crossfade run across clause joins exactly as within a
clause, so the joins have no seam of their own. When a clause is spoken and the next one's text has not come, the
codec stream is flushed: the clause's last window (up to a hop plus the lookahead frame, ~1.5 s of audio) goes out
now, not when the next clause's frames come (the flushed end is decoded as an utterance's end is; the next clause's
audio continues from it with its left context, in chunks growing from the first hop again).

Latency trade-off: a clause starts synthesising when it is complete, so first audio comes roughly one clause (plus a
few frames of generation) after its first word; a shorter max_clause_chars means earlier first audio but less text
per prompt (the model sees less of the sentence it is speaking).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from omnivox.codecs.audio_format import AudioStreamEncoder
from omnivox.codecs.decode_worker import END
from omnivox.engine import InvalidRequest
from omnivox.services import errors
from omnivox.services.cache_salt import request_salt
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import SpeechStreamMetrics
from omnivox.services.speech_validation import invalid, validate_speech
from omnivox.services.stream_idle import idle_bounded
from omnivox.services.streaming_transcription import next_item
from omnivox.services.summaries import seconds_to_duration
from omnivox.v1 import content_pb2, generation_pb2, speech_pb2

if TYPE_CHECKING:
    from omnivox.services.speech import SpeechServicer

DEFAULT_MAX_CLAUSE_CHARS = 120
CONTEXT_SECONDS = 2.0  # of the previous clause's audio codes in the next clause's prompt

SETTLE_S = 0.25  # text ending at clause punctuation is a complete clause after this long with no more text
_CLOSER = "\"')\\]」』）"
_CLOSERS = f"[{_CLOSER}]*"
# Latin punctuation ends a clause when a space follows (so "3.5" and "e.g." stay whole); CJK punctuation when any
# character but a closing quote or bracket does (no space follows it).
_BOUNDARY = re.compile(rf"[,;:.!?…]{_CLOSERS}(?=\s)|[。！？，、；：]{_CLOSERS}(?=[^{_CLOSER}])")
_WORD = re.compile(r"\w")  # a letter or digit, any script
_ENDS_AT_BOUNDARY = re.compile(rf"[,;:.!?…。！？，、；：]{_CLOSERS}\s*$")


class ClauseCutter:
    """Text chunks in, complete clauses out (`feed`), the rest at the end (`flush`). A piece with no letter or digit
    (the '!' of a '?!' whose '?' was cut when the text paused, a lone quote or emoji) has nothing to say: dropped, not
    spoken as a clause of its own."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CLAUSE_CHARS) -> None:
        self.max_chars = max_chars
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        clauses = []
        while True:
            m = _BOUNDARY.search(self.buffer)
            if m is not None and m.end() <= self.max_chars:
                cut = m.end()
            elif len(self.buffer) > self.max_chars:
                space = self.buffer.rfind(" ", 0, self.max_chars)
                cut = space if space > 0 else self.max_chars
            else:
                break
            clause, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:].lstrip()
            if _WORD.search(clause):
                clauses.append(clause)
        return clauses

    def flush(self) -> list[str]:
        rest, self.buffer = self.buffer.strip(), ""
        return [rest] if _WORD.search(rest) else []

    def ends_at_boundary(self) -> bool:
        """The text held ends at clause punctuation: a complete clause unless more text follows (`flush` it when
        none comes)."""
        return _ENDS_AT_BOUNDARY.search(self.buffer) is not None


async def streaming_synthesize(
    servicer: SpeechServicer,
    requests: AsyncIterator[speech_pb2.StreamingSynthesizeSpeechRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    received = time.monotonic()
    try:
        first = await anext(aiter(requests))
    except StopAsyncIteration:
        raise errors.invalid_argument(
            [FieldViolation("config", "the stream ended before the config message")]
        ) from None
    if first.WhichOneof("request") != "config":
        raise errors.invalid_argument([FieldViolation("config", "the first message must be the config")])
    cfg = first.config
    salt = request_salt(cfg.cache_salt, "config.cache_salt")  # this caller's share of the prefix cache
    if cfg.max_clause_chars < 0 or cfg.max_clause_chars > servicer.limits.max_segment_chars:
        raise errors.invalid_argument(
            [FieldViolation("config.max_clause_chars", f"must be in [0, {servicer.limits.max_segment_chars}]")]
        )
    try:  # the checks of SynthesizeSpeech, their fields named as this request has them: `config.<field>`
        model = servicer._speech_model(cfg.model)
        if model.bundle is not None and model.bundle.voice is not None:  # no engine: services/voice_speech.py
            from omnivox.services.voice_speech import stream_voice

            return await stream_voice(servicer, cfg, requests, context, model, received)
        assert model.bundle is not None and model.bundle.speech is not None and model.engine is not None
        created = {v.name: v for v in servicer.voices.list(model.name)}
        probe = speech_pb2.SynthesizeSpeechRequest(
            model=cfg.model, text=".", voice=cfg.voice, audio_config=cfg.audio_config, sampling=cfg.sampling
        )
        plan = validate_speech(probe, model, model.bundle.speech.layout, servicer.limits.max_text_chars, created)
    except errors.ServiceError as err:
        if err.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise errors.invalid_argument(
            [FieldViolation(f"config.{v.field}", v.description) for v in err.field_violations]
        ) from None
    bundle, engine = model.bundle.speech, model.engine
    layout = bundle.layout
    ref = created.get(plan.voice) if plan.voice not in layout.voices else None
    builtin_voice = "" if ref is not None else plan.voice
    cutter = ClauseCutter(cfg.max_clause_chars or DEFAULT_MAX_CLAUSE_CHARS)
    context_frames = math.ceil(CONTEXT_SECONDS * layout.sample_rate / bundle.codec.frame_samples)
    request_id = cfg.request_id or uuid.uuid4().hex
    clauses: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()  # (clause, when its text was complete)
    stats = {"tokens": 0, "cached": 0, "prompt": 0, "length": False}
    # Where each clause's audio starts on the codec stream's timeline (samples at the codec rate) and when its text was
    # complete, in order: the writer turns them into per-clause first-audio latencies and text-aware underruns.
    marks: list[tuple[int, float]] = []
    text_end: list[float] = []  # when the end of the text was read
    generating = False  # a clause is being spoken (the idle bound waits while it is)
    last_out = time.monotonic()  # when audio last went out (the idle bound counts from it too)

    async def read() -> None:
        total = 0
        loop = asyncio.get_running_loop()
        settle: asyncio.TimerHandle | None = None

        def settled(arrived: float) -> None:  # no text came after the clause punctuation: the clause is complete
            for clause in cutter.flush():
                clauses.put_nowait((clause, arrived))

        def busy() -> bool:  # its text is being spoken, or audio went out within the idle bound
            recent = time.monotonic() - last_out < (servicer.registry.stream_idle_s or 0)
            return generating or recent or not clauses.empty() or bool(stream.pending) or not stream.chunks.empty()

        try:
            stream_idle_s = servicer.registry.stream_idle_s
            async for req in idle_bounded(requests, stream_idle_s, "text", busy, lambda req: bool(req.text.strip())):
                kind = req.WhichOneof("request")
                if kind == "end":
                    break
                if kind == "config":
                    raise errors.invalid_argument([FieldViolation("config", "only the first message may be a config")])
                if kind != "text":
                    raise errors.invalid_argument(
                        [FieldViolation("request", "a message after the config sets none of text, end")]
                    )
                total += len(req.text)
                if total > servicer.limits.max_text_chars:
                    raise errors.invalid_argument(
                        [FieldViolation("text", f"more than {servicer.limits.max_text_chars} characters in all")]
                    )
                now = time.monotonic()
                for clause in cutter.feed(req.text):
                    clauses.put_nowait((clause, now))
                if settle is not None:
                    settle.cancel()
                settle = loop.call_later(SETTLE_S, settled, now) if cutter.ends_at_boundary() else None
        finally:
            if settle is not None:
                settle.cancel()
        text_end.append(time.monotonic())
        for clause in cutter.flush():
            clauses.put_nowait((clause, text_end[0]))
        clauses.put_nowait(None)

    async def produce() -> None:
        prev_text, prev_frames = (ref.transcript, list(ref.frames)) if ref is not None else (None, [])
        index = 0
        pushed = 0  # frames pushed to the codec stream, all clauses
        nonlocal generating
        while True:
            if clauses.empty():  # the next clause's text has not come: send all of this one's audio now
                bundle.worker.flush(stream)
            if (item := await clauses.get()) is None:
                break
            generating = True
            clause, complete_at = item
            marks.append((pushed * bundle.codec.frame_samples, complete_at))
            if prev_text is None:
                prompt = layout.build_prompt(bundle.text_tokenizer, clause, builtin_voice)
            else:
                tail = prev_frames if index == 0 else prev_frames[-context_frames:]  # a created voice: all of it
                prompt = layout.build_reference_prompt(bundle.text_tokenizer, prev_text, tail, clause, builtin_voice)
            params = servicer._params(plan, model, layout, bundle, clause, prompt, index)
            frames: list[list[int]] = []
            frame: list[int] = []
            count = 0
            gen = engine.stream(prompt, params, request_id=f"{request_id}-{index}", cache_salt=salt)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    new: list[list[int]] = []
                    for token in out.new_token_ids:
                        if token == layout.end_of_speech:
                            break
                        frame.append(layout.code_of(token, count))
                        count += 1
                        if len(frame) == layout.frame_size:
                            new.append(frame)
                            frame = []
                    bundle.worker.push(stream, new)
                    frames += new
                    pushed += len(new)
                    if out.finished:
                        stats["cached"] += out.num_cached_tokens
                        stats["length"] = stats["length"] or out.finish_reason == "length"
                        if out.error is not None:  # its own values left it nothing to sample
                            raise invalid(out.error)
                        if out.finish_reason == "error":
                            raise errors.internal("the engine failed while computing this request")
            stats["tokens"] += count
            stats["prompt"] += len(prompt)
            prev_text, prev_frames = clause, frames
            index += 1
            generating = False
        bundle.worker.finish(stream)

    encoder = AudioStreamEncoder(plan.encoding, plan.sample_rate, source_rate=bundle.worker.sample_rate)
    stream = bundle.worker.open(measured=False)  # its frames wait on the text: not the engine's pace
    tasks: list[asyncio.Task] = []
    first_audio: float | None = None
    m = servicer.metrics
    deadline = servicer.registry.arbiter.open  # called once admitted: the arbiter puts it first when behind
    with model.admit(), SpeechStreamMetrics(m, model.name, received, deadline=deadline(engine)) as slo:
        try:
            await context.write(
                speech_pb2.StreamingSynthesizeSpeechResponse(
                    format=speech_pb2.AudioFormat(
                        encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{plan.encoding.value}"),
                        sample_rate_hertz=plan.sample_rate,
                        channels=encoder.channels,
                    )
                )
            )
            tasks = [asyncio.create_task(read()), asyncio.create_task(produce())]

            codec_samples = 0  # handed to the encoder so far (codec rate)
            started = 0  # clauses whose first audio was sent

            async def send(data: bytes) -> None:
                nonlocal first_audio, started, last_out
                now = last_out = time.monotonic()
                first_audio = first_audio or now
                while started < len(marks) and marks[started][0] < codec_samples:
                    m.clause_first_audio.labels(model.name).observe(max(now - marks[started][1], 0.0))
                    started += 1
                ready = marks[started - 1][1] if started else None  # the text of this chunk's last clause
                slo.chunk(encoder.samples_out / plan.sample_rate - slo.meter.sent_s, now, ready)
                await context.write(
                    speech_pb2.StreamingSynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=data))
                )

            while (item := await next_item(stream.chunks, tasks)) is not END:
                if isinstance(item, BaseException):
                    raise item
                codec_samples += len(item)
                if data := encoder.encode(item):
                    await send(data)
            if tail := encoder.finish():
                await send(tail)
        except InvalidRequest as err:
            raise invalid(err) from err
        except asyncio.CancelledError:  # client cancel, deadline, idle bound, forced stop: counted as vLLM does
            m.request_ended(model.name, "abort")
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bundle.worker.close(stream)
            encoder.close()
        done_t = time.monotonic()
        audio_seconds = encoder.samples_out / plan.sample_rate
        slo.finish(audio_seconds, done_t)
        m.stream_clauses.labels(model.name).observe(len(marks))
        if text_end and first_audio is not None:
            m.text_end_lag.labels(model.name).observe(max(slo.last_audio - text_end[0], 0.0))
        m.success.labels(model.name, "length" if stats["length"] else "stop").inc()
        m.e2e.labels(model.name).observe(done_t - received)
    summary = speech_pb2.SpeechSummary(
        audio_seconds=audio_seconds,
        audio_tokens=stats["tokens"],
        real_time_factor=(done_t - received) / audio_seconds if audio_seconds > 0 else 0.0,
        total=seconds_to_duration(done_t - received),
        finish_reason=generation_pb2.FINISH_REASON_LENGTH if stats["length"] else generation_pb2.FINISH_REASON_STOP,
        request_id=request_id,
        model=model.name,
        cached_prompt_tokens=stats["cached"],
        prompt_tokens=stats["prompt"],
    )
    if first_audio is not None:
        summary.time_to_first_audio.CopyFrom(seconds_to_duration(first_audio - received))
    await context.write(speech_pb2.StreamingSynthesizeSpeechResponse(summary=summary))
