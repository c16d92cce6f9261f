"""SpeechService for non-autoregressive voices (services/voice_part.py): the same contract as the Orpheus path
(services/speech.py, speech_stream.py): format first, encoded audio chunks, a summary with time to first audio and
real-time factor; every encoding and rate (resampled from the voice's own); metrics; cancellation and deadlines.

  SynthesizeSpeech:           text -> segments (speech_text.split_text) -> per segment: phonemes -> one ONNX run per
                              sentence in the worker -> encoded and written before the next sentence is rendered.
  StreamingSynthesizeSpeech:  text chunks -> clauses (clauses.ClauseCutter, the same cuts and settle rule) ->
                              each clause rendered and written as soon as it is complete.

A cancelled or timed-out call stops at once; the one utterance being rendered (tens of ms) ends in its thread.
"""

from __future__ import annotations

import asyncio
import time
import unicodedata
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omnivox.codecs.audio_format import AudioFormatError, AudioStreamEncoder, check_output_format
from omnivox.models.voice import UnknownVoice, VoiceNeedsDownload
from omnivox.models.voice.voice_model import VoiceSettings
from omnivox.services import errors, validation
from omnivox.services.clauses import DEFAULT_MAX_CLAUSE_CHARS, SETTLE_S, ClauseCutter
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import SpeechStreamMetrics
from omnivox.services.registry import ServedModel
from omnivox.services.speech_text import split_text
from omnivox.services.speech_validation import encoding_name, language_matches
from omnivox.services.stream_idle import idle_bounded
from omnivox.services.summaries import seconds_to_duration
from omnivox.services.voice_part import VoicePart
from omnivox.v1 import content_pb2, generation_pb2, speech_pb2

if TYPE_CHECKING:
    from omnivox.services.speech import SpeechServicer


MIN_RATE, MAX_RATE = 0.25, 4.0  # audio_config.speaking_rate: hibari's speed input, Piper's length_scale divisor


@dataclass
class VoicePlan:
    text: str
    settings: VoiceSettings
    encoding: object  # codecs.audio_format.AudioEncoding
    sample_rate: int


def voice_part_of(model: ServedModel) -> VoicePart | None:
    return model.bundle.voice if model.bundle is not None else None


def validate_voice(
    model: ServedModel, part: VoicePart, text: str, voice_sel, audio_config, sampling, max_chars: int, prefix: str = ""
) -> VoicePlan:
    """INVALID_ARGUMENT listing every bad field (`prefix` + field: "config." for the streaming call), then NOT_FOUND
    for an unknown voice, FAILED_PRECONDITION for one whose weights are not here."""
    voice = part.voice
    v = validation.Violations()
    stripped = text.strip()
    if not any(unicodedata.category(c)[0] not in "ZC" for c in stripped):
        v.add("text", "must not be empty (it holds only spaces, control or zero-width characters)")
    elif len(text) > max_chars:
        v.add("text", f"is {len(text)} characters; the limit is {max_chars}")
    name = encoding_name(audio_config.encoding)
    encoding, rate = None, voice.sample_rate
    if name is None:
        v.add(f"{prefix}audio_config.encoding", f"unknown encoding value {audio_config.encoding}")
    else:
        try:
            encoding, rate = check_output_format(name, audio_config.sample_rate_hertz or voice.sample_rate)
        except AudioFormatError as err:
            v.add(f"{prefix}audio_config.{err.field}", err.description)
    speed = audio_config.speaking_rate if audio_config.HasField("speaking_rate") else 1.0
    if not MIN_RATE <= speed <= MAX_RATE:  # NaN fails both
        v.add(f"{prefix}audio_config.speaking_rate", f"must be in [{MIN_RATE}, {MAX_RATE}], got {speed}")
    for field in validation.SAMPLING_FIELDS:  # no tokens are sampled: only the noise seed means something here
        if field != "seed" and sampling.HasField(field):
            v.add(f"{prefix}sampling.{field}", f"model {model.name!r} is a {voice.family} voice and samples no tokens")
    if sampling.logit_bias:
        v.add(f"{prefix}sampling.logit_bias", f"model {model.name!r} is a {voice.family} voice and samples no tokens")
    v.raise_if_any()
    name = voice_sel.name or voice.default_voice
    try:
        voice.check_voice(name)
    except UnknownVoice:
        raise errors.not_found(
            "voice", name, f"model {model.name!r} has no voice {name!r} (voices: {', '.join(voice.voices)})"
        ) from None
    except VoiceNeedsDownload as exc:
        raise errors.failed_precondition(f"model {model.name!r}: {exc}; this server never downloads weights") from None
    if voice_sel.language_code and not language_matches(voice_sel.language_code, voice.language_code):
        raise errors.not_found(
            "voice",
            f"{name}@{voice_sel.language_code}",
            f"model {model.name!r} has no voice for language {voice_sel.language_code!r} (it speaks "
            f"{voice.language_code!r})",
        )
    seed = sampling.seed if sampling.HasField("seed") else None
    return VoicePlan(stripped, VoiceSettings(name, speed, seed), encoding, rate)


def list_voices(model: ServedModel, language_code: str) -> list[speech_pb2.Voice]:
    """The voice model's built-in voices (none while it loads: its files say them once read)."""
    part = voice_part_of(model)
    if part is None or (language_code and not language_matches(language_code, part.voice.language_code)):
        return []
    return [speech_pb2.Voice(name=n, language_codes=[part.voice.language_code], model=model.name,
                             kind=speech_pb2.VOICE_KIND_BUILT_IN) for n in part.voice.voices]  # fmt: skip


def cannot_clone(model: ServedModel, part: VoicePart) -> errors.ServiceError:
    return errors.failed_precondition(
        f"model {model.name!r} is a {part.voice.family} voice: it cannot clone a voice from reference audio "
        "(CreateVoice needs a model with a speech codec, such as an Orpheus checkpoint)"
    )


def _nothing_to_say(model: ServedModel, field: str = "text") -> errors.ServiceError:
    return errors.invalid_argument(
        [FieldViolation(field, f"nothing in it can be spoken by model {model.name!r} (its phonemizer found no words)")]
    )


class _Speaker:
    """One call's output side: renders text in the worker, encodes, writes; counts what the summary reports."""

    def __init__(self, servicer: SpeechServicer, model: ServedModel, plan: VoicePlan, context, response_type) -> None:
        self.part = voice_part_of(model)
        assert self.part is not None
        self.model, self.plan, self.context, self.response = model, plan, context, response_type
        self.encoder = AudioStreamEncoder(plan.encoding, plan.sample_rate, source_rate=self.part.voice.sample_rate)
        self.rng = np.random.default_rng(plan.settings.seed)
        self.first_audio: float | None = None
        self.phoneme_ids = 0
        self.slo: SpeechStreamMetrics | None = None

    async def write_format(self) -> None:
        fmt = speech_pb2.AudioFormat(
            encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{self.plan.encoding.value}"),
            sample_rate_hertz=self.plan.sample_rate,
            channels=self.encoder.channels,
        )
        await self.context.write(self.response(format=fmt))

    async def speak(self, utterances, ready: float | None = None) -> float | None:
        """Render and send each utterance in turn; when the first of their audio went out (None: none did)."""
        first: float | None = None
        for utterance in utterances:
            pcm = await self.part.run(self.part.voice.render, utterance, self.plan.settings, self.rng)
            self.phoneme_ids += len(utterance.ids)
            if await self._send(self.encoder.encode(pcm), ready):
                first = first or time.monotonic()
        return first

    async def finish(self) -> None:
        await self._send(self.encoder.finish(), None)

    async def _send(self, data: bytes, ready: float | None) -> bool:
        if not data:
            return False
        now = time.monotonic()
        self.first_audio = self.first_audio or now
        assert self.slo is not None
        self.slo.chunk(self.encoder.samples_out / self.plan.sample_rate - self.slo.meter.sent_s, now, ready)
        await self.context.write(self.response(audio=speech_pb2.AudioChunk(data=data)))
        return True

    def summary(self, received: float, done: float, request_id: str) -> speech_pb2.SpeechSummary:
        audio_seconds = self.encoder.samples_out / self.plan.sample_rate
        summary = speech_pb2.SpeechSummary(
            audio_seconds=audio_seconds,
            real_time_factor=(done - received) / audio_seconds if audio_seconds > 0 else 0.0,
            total=seconds_to_duration(done - received),
            finish_reason=generation_pb2.FINISH_REASON_STOP,
            request_id=request_id,
            model=self.model.name,
            prompt_tokens=self.phoneme_ids,  # the phoneme ids the voice read
        )
        if self.first_audio is not None:
            summary.time_to_first_audio.CopyFrom(seconds_to_duration(self.first_audio - received))
        return summary


async def synthesize_voice(
    servicer: SpeechServicer, request: speech_pb2.SynthesizeSpeechRequest, context, model: ServedModel, received: float
) -> None:
    part = voice_part_of(model)
    assert part is not None
    limits, m = servicer.limits, servicer.metrics
    plan = validate_voice(model, part, request.text, request.voice, request.audio_config, request.sampling,
                          limits.max_text_chars)  # fmt: skip
    request_id = request.request_id or uuid.uuid4().hex
    segments = split_text(plan.text, limits.max_segment_chars)
    deadline = servicer.registry.arbiter.open  # the engines wait while this stream is behind (engine/arbiter.py)
    with model.admit(), SpeechStreamMetrics(m, model.name, received, deadline=deadline(part)) as slo:
        speaker = _Speaker(servicer, model, plan, context, speech_pb2.SynthesizeSpeechResponse)
        speaker.slo = slo
        try:
            first = await part.run(part.voice.utterances, segments[0])  # before the format: an error is the status
            if not first and len(segments) == 1:
                raise _nothing_to_say(model)
            await speaker.write_format()
            await speaker.speak(first)
            for segment in segments[1:]:
                await speaker.speak(await part.run(part.voice.utterances, segment))
            if speaker.phoneme_ids == 0:
                raise _nothing_to_say(model)
            await speaker.finish()
        except asyncio.CancelledError:  # client cancel, deadline, forced stop: counted as vLLM does
            m.request_ended(model.name, "abort")
            raise
        finally:
            speaker.encoder.close()
        done = time.monotonic()
        slo.finish(speaker.encoder.samples_out / plan.sample_rate, done)
        m.success.labels(model.name, "stop").inc()
        m.e2e.labels(model.name).observe(done - received)
    await context.write(speech_pb2.SynthesizeSpeechResponse(summary=speaker.summary(received, done, request_id)))


async def stream_voice(
    servicer: SpeechServicer,
    cfg: speech_pb2.StreamingSpeechConfig,
    requests: AsyncIterator[speech_pb2.StreamingSynthesizeSpeechRequest],
    context,
    model: ServedModel,
    received: float,
) -> None:
    part = voice_part_of(model)
    assert part is not None
    limits, m = servicer.limits, servicer.metrics
    plan = validate_voice(model, part, ".", cfg.voice, cfg.audio_config, cfg.sampling, limits.max_text_chars,
                          prefix="config.")  # fmt: skip
    request_id = cfg.request_id or uuid.uuid4().hex
    cutter = ClauseCutter(cfg.max_clause_chars or DEFAULT_MAX_CLAUSE_CHARS)
    clauses: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()  # (clause, when its text was complete)
    speaking = False

    async def read() -> None:
        total = 0
        loop = asyncio.get_running_loop()
        settle: asyncio.TimerHandle | None = None

        def settled(arrived: float) -> None:  # no text came after the clause punctuation: the clause is complete
            for clause in cutter.flush():
                clauses.put_nowait((clause, arrived))

        def busy() -> bool:
            return speaking or not clauses.empty()

        try:
            async for req in idle_bounded(requests, servicer.registry.stream_idle_s, "text", busy,
                                          lambda req: bool(req.text.strip())):  # fmt: skip
                kind = req.WhichOneof("request")
                if kind == "end":
                    break
                if kind != "text":
                    what = "only the first message may be a config" if kind == "config" else "sets none of text, end"
                    raise errors.invalid_argument([FieldViolation("config" if kind == "config" else "request", what)])
                total += len(req.text)
                if total > limits.max_text_chars:
                    raise errors.invalid_argument(
                        [FieldViolation("text", f"more than {limits.max_text_chars} characters in all")]
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
        for clause in cutter.flush():
            clauses.put_nowait((clause, time.monotonic()))
        clauses.put_nowait(None)

    deadline = servicer.registry.arbiter.open  # the engines wait while this stream is behind (engine/arbiter.py)
    with model.admit(), SpeechStreamMetrics(m, model.name, received, deadline=deadline(part)) as slo:
        speaker = _Speaker(servicer, model, plan, context, speech_pb2.StreamingSynthesizeSpeechResponse)
        speaker.slo = slo
        reader = asyncio.create_task(read())
        count = 0
        try:
            await speaker.write_format()
            while True:
                getter = asyncio.ensure_future(clauses.get())
                await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the reader ended first: with an error (raised here) or after its None
                    getter.cancel()
                    reader.result()
                    item = await clauses.get()
                else:
                    item = getter.result()
                if item is None:
                    break
                clause, complete_at = item
                speaking = True
                utterances = await part.run(part.voice.utterances, clause)
                if (sent := await speaker.speak(utterances, complete_at)) is not None:
                    m.clause_first_audio.labels(model.name).observe(max(sent - complete_at, 0.0))
                count += 1
                speaking = False
            await reader
            await speaker.finish()
        except asyncio.CancelledError:
            m.request_ended(model.name, "abort")
            raise
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            speaker.encoder.close()
        done = time.monotonic()
        slo.finish(speaker.encoder.samples_out / plan.sample_rate, done)
        m.stream_clauses.labels(model.name).observe(count)
        m.success.labels(model.name, "stop").inc()
        m.e2e.labels(model.name).observe(done - received)
    await context.write(
        speech_pb2.StreamingSynthesizeSpeechResponse(summary=speaker.summary(received, done, request_id))
    )
