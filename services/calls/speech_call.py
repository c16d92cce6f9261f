"""Both speech RPCs from a wire request to its responses, whichever front carries them (gRPC's SpeechServicer, the HTTP
front's /v1/audio/speech and /v1/audio/voices): model -> process -> admit -> engine (or voice) -> output.

  SynthesizeSpeech:           `SpeechCalls.synthesize` (here, for a model with an engine: services/processing/speech_request.py
                              plans the segments, services/output/speech_synthesis.py runs them), or
                              services/calls/voice_speech.py `synthesize_voice` for a voice without an engine.
  StreamingSynthesizeSpeech:  `SpeechCalls.stream` -> services/calls/speech_stream.py `streaming_synthesize`.
  ListVoices:                 `SpeechCalls.list_voices`.

Each yields the wire responses (format, audio chunks, summary) and raises a ServiceError (services/errors.py) that each
front reports its way. Closing the iterator early (client gone, deadline, server stop) closes the engine streams (which
aborts them and frees their KV blocks) and the codec streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from omnivox.engine import InvalidRequest
from omnivox.services import errors
from omnivox.services.call_record import current_call
from omnivox.services.calls import voice_speech
from omnivox.services.calls.speech_stream import streaming_synthesize
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import Metrics, SpeechStreamMetrics
from omnivox.services.output.speech_synthesis import SegmentedSynthesis
from omnivox.services.output.summaries import speech_summary
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.parts.voices import VoiceStore
from omnivox.services.processing import speech_request
from omnivox.services.processing.cache_salt import request_salt
from omnivox.services.processing.speech_request import SpeechLimits
from omnivox.services.processing.speech_validation import invalid, language_matches
from omnivox.v1 import speech_pb2

Response = speech_pb2.SynthesizeSpeechResponse


@dataclass
class SpeechCalls:
    """The speech processing of one server: its models, limits, metrics and created voices."""

    registry: ModelRegistry
    limits: SpeechLimits = field(default_factory=SpeechLimits)
    metrics: Metrics = field(default_factory=Metrics)
    voices: VoiceStore = field(default_factory=VoiceStore)  # created voices, under the server's data folder

    def list_voices(self, model_name: str, language_code: str) -> list[speech_pb2.Voice]:
        """Every served voice (`model_name`: one model's; INVALID_ARGUMENT when it does not speak)."""
        models = [self.registry.lookup(model_name)] if model_name else list(self.registry)
        voices = []
        for model in models:
            if "voice" in model.manifest.parts:  # a non-autoregressive voice (services/calls/voice_speech.py)
                voices += voice_speech.list_voices(model, language_code)
                continue
            layout = speech_request.layout_of(model)
            if layout is None:
                if model_name:
                    raise errors.invalid_argument(
                        [FieldViolation("model", f"model {model.name!r} does not produce speech")]
                    )
                continue
            if language_code and not language_matches(language_code, layout.language_code):
                continue
            voices += [speech_pb2.Voice(name=n, language_codes=[layout.language_code], model=model.name,
                                        kind=speech_pb2.VOICE_KIND_BUILT_IN) for n in layout.voices]  # fmt: skip
            voices += [v.to_proto(model.name, layout.language_code) for v in self.voices.list(model.name)]
        return voices

    def stream(self, requests: AsyncIterator[speech_pb2.StreamingSynthesizeSpeechRequest]) -> AsyncIterator[Response]:
        return streaming_synthesize(self, requests)

    async def synthesize(self, request: speech_pb2.SynthesizeSpeechRequest) -> AsyncIterator[Response]:
        """The format, the audio chunks (their bytes concatenated are one file), then the summary."""
        received = time.monotonic()
        salt = request_salt(request.cache_salt)  # this caller's (and cache_salt's) share of the prefix cache
        model = speech_request.speech_model(self.registry, request.model)
        if model.bundle is not None and model.bundle.voice is not None:  # no engine: services/calls/voice_speech.py
            async for response in voice_speech.synthesize_voice(self, request, model, received):
                yield response
            return
        created = {v.name: v for v in self.voices.list(model.name)}
        job = speech_request.plan_synthesis(request, model, self.limits, created, salt)
        m = self.metrics
        # Opened once admitted (a `with` enters each manager before building the next): the step arbiter puts the
        # stream first when it falls behind its playback, and the metrics close it however the stream ends.
        synthesis: SegmentedSynthesis | None = None  # built once admitted; the deadline has work while it generates
        deadline = self.registry.arbiter.open
        working = lambda: synthesis is not None and synthesis.working()  # noqa: E731
        with (
            model.admit(),
            SpeechStreamMetrics(m, model.name, received, deadline=deadline(model.engine, working=working)) as slo,
        ):
            synthesis = SegmentedSynthesis(job, self.limits.max_parallel_segments)
            try:
                yield Response(format=synthesis.audio_format())
                async for data in synthesis.audio():
                    slo.chunk(synthesis.audio_seconds - slo.meter.sent_s)
                    yield Response(audio=speech_pb2.AudioChunk(data=data))
            except InvalidRequest as err:
                raise invalid(err) from err
            except (asyncio.CancelledError, GeneratorExit):  # client gone, deadline, forced stop: as vLLM counts
                m.request_ended(model.name, "abort")
                raise
            finally:
                await synthesis.close()
            done, totals = time.monotonic(), synthesis.totals(m)
            slo.finish(totals.audio_seconds, done)
            m.success.labels(model.name, totals.finish).inc()
            m.e2e.labels(model.name).observe(done - received)
            if (span := synthesis.codec_span()) is not None:  # tracing: the codec's passes for this request
                current_call().phase("codec", *span)
            first_audio = synthesis.first_audio
            current_call().set(request_id=job.request_id, model=model.name, audio_seconds=round(totals.audio_seconds, 3),
                               ttfa_s=round(first_audio - received, 6) if first_audio is not None else None,
                               underruns=slo.meter.count)  # fmt: skip
            yield Response(summary=speech_summary(totals, received, done, first_audio, job.request_id, model.name))
