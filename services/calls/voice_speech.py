"""SpeechService for non-autoregressive voices (services/parts/voice_part.py): the same contract as the Orpheus path
(services/grpc_api/speech.py, speech_stream.py): format first, encoded audio chunks, a summary with time to first audio and
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
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omnivox.codecs.audio_format import AudioStreamEncoder
from omnivox.models.voice import UnknownVoice, VoiceNeedsDownload
from omnivox.models.voice.voice_model import VoiceSettings
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import SpeechStreamMetrics
from omnivox.services.output.summaries import SpeechTotals, audio_format, speech_summary
from omnivox.services.parts.registry import ServedModel
from omnivox.services.parts.voice_part import VoicePart
from omnivox.services.processing import validation
from omnivox.services.processing.clause_reader import read_clauses
from omnivox.services.processing.clauses import DEFAULT_MAX_CLAUSE_CHARS, SETTLE_S, ClauseCutter
from omnivox.services.processing.speech_text import split_text
from omnivox.services.processing.speech_validation import (
    check_audio_config,
    check_text,
    check_voice_language,
    language_matches,
)
from omnivox.services.processing.streams import next_item
from omnivox.v1 import speech_pb2

if TYPE_CHECKING:
    from omnivox.services.calls.speech_call import SpeechCalls


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
    for an unknown voice, FAILED_PRECONDITION for one whose weights are not here (the text and audio checks are
    SynthesizeSpeech's own: services/processing/speech_validation.py)."""
    voice = part.voice
    v = validation.Violations()
    stripped = check_text(v, text, max_chars)
    encoding, rate = check_audio_config(v, audio_config, voice.sample_rate, prefix)
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
    check_voice_language(model.name, name, voice_sel.language_code, voice.language_code)
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
    """One call's output side: renders text in the worker and encodes it; counts what the summary reports."""

    def __init__(self, model: ServedModel, plan: VoicePlan, slo: SpeechStreamMetrics) -> None:
        self.part = voice_part_of(model)
        assert self.part is not None
        self.model, self.plan, self.slo = model, plan, slo
        self.encoder = AudioStreamEncoder(plan.encoding, plan.sample_rate, source_rate=self.part.voice.sample_rate)
        self.rng = np.random.default_rng(plan.settings.seed)
        self.first_audio: float | None = None
        self.phoneme_ids = 0

    def audio_format(self) -> speech_pb2.AudioFormat:
        return audio_format(self.plan.encoding, self.plan.sample_rate, self.encoder.channels)

    @property
    def audio_seconds(self) -> float:
        return self.encoder.samples_out / self.plan.sample_rate

    async def speak(self, utterances: Iterable[Any], ready: float | None = None) -> AsyncIterator[bytes]:
        """Render and encode each utterance in turn (`ready`: when their text was complete, for the underruns)."""
        for utterance in utterances:
            pcm = await self.part.run(self.part.voice.render, utterance, self.plan.settings, self.rng)
            self.phoneme_ids += len(utterance.ids)
            if data := self._sent(self.encoder.encode(pcm), ready):
                yield data

    def finish(self) -> bytes:
        return self._sent(self.encoder.finish(), None)

    def _sent(self, data: bytes, ready: float | None) -> bytes:
        if data:
            now = time.monotonic()
            self.first_audio = self.first_audio or now
            self.slo.chunk(self.audio_seconds - self.slo.meter.sent_s, now, ready)
        return data

    def summary(self, received: float, done: float, request_id: str) -> speech_pb2.SpeechSummary:
        # no tokens: the prompt is the phoneme ids the voice read
        totals = SpeechTotals(self.audio_seconds, 0, 0, self.phoneme_ids, "stop")
        return speech_summary(totals, received, done, self.first_audio, request_id, self.model.name)


async def synthesize_voice(
    calls: SpeechCalls, request: speech_pb2.SynthesizeSpeechRequest, model: ServedModel, received: float
) -> AsyncIterator[speech_pb2.SynthesizeSpeechResponse]:
    Response = speech_pb2.SynthesizeSpeechResponse
    part = voice_part_of(model)
    assert part is not None
    limits, m = calls.limits, calls.metrics
    plan = validate_voice(model, part, request.text, request.voice, request.audio_config, request.sampling,
                          limits.max_text_chars)  # fmt: skip
    request_id = request.request_id or uuid.uuid4().hex
    segments = split_text(plan.text, limits.max_segment_chars)
    deadline = calls.registry.arbiter.open  # the engines wait while this stream is behind (engine/arbiter.py)
    with model.admit(), SpeechStreamMetrics(m, model.name, received, deadline=deadline(part)) as slo:
        speaker = _Speaker(model, plan, slo)
        try:
            first = await part.run(part.voice.utterances, segments[0])  # before the format: an error is the status
            if not first and len(segments) == 1:
                raise _nothing_to_say(model)
            yield Response(format=speaker.audio_format())
            for i, segment in enumerate(segments):
                utterances = first if i == 0 else await part.run(part.voice.utterances, segment)
                async for data in speaker.speak(utterances):
                    yield Response(audio=speech_pb2.AudioChunk(data=data))
            if speaker.phoneme_ids == 0:
                raise _nothing_to_say(model)
            if tail := speaker.finish():
                yield Response(audio=speech_pb2.AudioChunk(data=tail))
        except (asyncio.CancelledError, GeneratorExit):  # client gone, deadline, forced stop: counted as vLLM does
            m.request_ended(model.name, "abort")
            raise
        finally:
            speaker.encoder.close()
        done = time.monotonic()
        slo.finish(speaker.audio_seconds, done)
        m.success.labels(model.name, "stop").inc()
        m.e2e.labels(model.name).observe(done - received)
    yield Response(summary=speaker.summary(received, done, request_id))


async def stream_voice(
    calls: SpeechCalls,
    cfg: speech_pb2.StreamingSpeechConfig,
    requests: AsyncIterator[speech_pb2.StreamingSynthesizeSpeechRequest],
    model: ServedModel,
    received: float,
) -> AsyncIterator[speech_pb2.StreamingSynthesizeSpeechResponse]:
    Response = speech_pb2.StreamingSynthesizeSpeechResponse
    part = voice_part_of(model)
    assert part is not None
    limits, m = calls.limits, calls.metrics
    plan = validate_voice(model, part, ".", cfg.voice, cfg.audio_config, cfg.sampling, limits.max_text_chars,
                          prefix="config.")  # fmt: skip
    request_id = cfg.request_id or uuid.uuid4().hex
    cutter = ClauseCutter(cfg.max_clause_chars or DEFAULT_MAX_CLAUSE_CHARS)
    clauses: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()  # (clause, when its text was complete)
    speaking = False

    def busy() -> bool:  # its text is being spoken: the idle bound waits
        return speaking or not clauses.empty()

    # The engines wait while this stream is behind (engine/arbiter.py), only while it speaks a clause: waiting for
    # the client's next text it is not behind.
    deadline = calls.registry.arbiter.open
    with (
        model.admit(),
        SpeechStreamMetrics(m, model.name, received, deadline=deadline(part, working=lambda: speaking)) as slo,
    ):
        speaker = _Speaker(model, plan, slo)
        reader = asyncio.create_task(
            read_clauses(requests, cutter, clauses, limits.max_text_chars, SETTLE_S, calls.registry.stream_idle_s, busy)
        )
        count = 0
        try:
            yield Response(format=speaker.audio_format())
            while (item := await next_item(clauses, [reader])) is not None:
                clause, complete_at = item
                speaking = True
                utterances = await part.run(part.voice.utterances, clause)
                sent: float | None = None
                async for data in speaker.speak(utterances, complete_at):
                    sent = sent or time.monotonic()
                    yield Response(audio=speech_pb2.AudioChunk(data=data))
                if sent is not None:
                    m.clause_first_audio.labels(model.name).observe(max(sent - complete_at, 0.0))
                count += 1
                speaking = False
            await reader
            if tail := speaker.finish():
                yield Response(audio=speech_pb2.AudioChunk(data=tail))
        except (asyncio.CancelledError, GeneratorExit):
            m.request_ended(model.name, "abort")
            raise
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            speaker.encoder.close()
        done = time.monotonic()
        slo.finish(speaker.audio_seconds, done)
        m.stream_clauses.labels(model.name).observe(count)
        m.success.labels(model.name, "stop").inc()
        m.e2e.labels(model.name).observe(done - received)
    yield Response(summary=speaker.summary(received, done, request_id))
