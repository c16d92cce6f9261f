"""SpeechService (the gRPC face): text -> audio tokens from the shared engine -> SNAC -> encoded audio, streamed.

A speech model is a checkpoint folder with `speech_layout.json` (models/orpheus.py: where the audio tokens live and how
the prompt is framed) and a SNAC codec in `<folder>/<layout.codec_folder>`. SynthesizeSpeech reads
admit -> process -> engine.stream -> output:

  services/speech_request.py (the model, validation, segments, their prompts and parameters) ->
  services/speech_synthesis.py (one engine request per segment in parallel, frames through services/audio_frames.py
  to the model's DecodeWorker, chunks encoded in order) -> services/summaries.py (format and summary messages).

StreamingSynthesizeSpeech is services/speech_stream.py; voices without an engine are services/voice_speech.py.
Leaving the handler in any way (done, cancelled, deadline, error) closes the segments' engine streams (which aborts
them and frees their KV blocks) and the codec streams.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from omnivox.engine import InvalidRequest
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors, speech_request, voice_speech
from omnivox.services.cache_salt import request_salt
from omnivox.services.call_record import current_call
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import Metrics, SpeechStreamMetrics
from omnivox.services.registry import ModelRegistry, ServedModel
from omnivox.services.rpc_errors import rpc_method
from omnivox.services.speech_request import SpeechLimits
from omnivox.services.speech_stream import streaming_synthesize
from omnivox.services.speech_synthesis import SegmentedSynthesis
from omnivox.services.speech_validation import invalid, language_matches
from omnivox.services.summaries import speech_summary
from omnivox.services.voices import VoiceStore
from omnivox.v1 import speech_pb2, speech_pb2_grpc

__all__ = ["SpeechLimits", "SpeechServicer"]

log = logging.getLogger(__name__)


class SpeechServicer(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        limits: SpeechLimits | None = None,
        metrics: Metrics | None = None,
        voices: VoiceStore | None = None,
    ) -> None:
        self.registry = registry
        self.voices = voices or VoiceStore()  # created voices, under the server's data folder
        self.limits = limits or SpeechLimits()
        self.metrics = metrics or Metrics()

    # --- models (services/speech_request.py; voice_speech.py and speech_stream.py ask through these) ---
    def _speech_model(self, name: str) -> ServedModel:
        return speech_request.speech_model(self.registry, name)

    @staticmethod
    def _layout_of(model: ServedModel) -> SpeechLayout | None:
        return speech_request.layout_of(model)

    # --- RPCs ---
    @rpc_method
    async def ListVoices(
        self, request: speech_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> speech_pb2.ListVoicesResponse:
        models = [self.registry.lookup(request.model)] if request.model else list(self.registry)
        voices = []
        for model in models:
            if "voice" in model.manifest.parts:  # a non-autoregressive voice (services/voice_speech.py)
                voices += voice_speech.list_voices(model, request.language_code)
                continue
            layout = self._layout_of(model)
            if layout is None:
                if request.model:
                    raise errors.invalid_argument(
                        [FieldViolation("model", f"model {model.name!r} does not produce speech")]
                    )
                continue
            if request.language_code and not language_matches(request.language_code, layout.language_code):
                continue
            voices += [speech_pb2.Voice(name=n, language_codes=[layout.language_code], model=model.name,
                                        kind=speech_pb2.VOICE_KIND_BUILT_IN) for n in layout.voices]  # fmt: skip
            voices += [v.to_proto(model.name, layout.language_code) for v in self.voices.list(model.name)]
        return speech_pb2.ListVoicesResponse(voices=voices)

    @rpc_method
    async def StreamingSynthesizeSpeech(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await streaming_synthesize(self, request_iterator, context)

    @rpc_method
    async def CreateVoice(self, request: speech_pb2.CreateVoiceRequest, context: grpc.aio.ServicerContext):
        model = self._speech_model(request.model)
        assert model.bundle is not None
        if model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        assert model.bundle.speech is not None
        layout = model.bundle.speech.layout
        if not isinstance(
            layout, SpeechLayout
        ):  # CSM: its voice prompts (Mimi-encoded reference turns) are not here yet
            raise errors.failed_precondition(
                f"model {model.name!r} is a CSM model: cloning a voice from reference audio is not served for it yet"
            )
        voice = await self.voices.create(model.name, layout, model.bundle.source / layout.codec_folder, request)
        return speech_pb2.CreateVoiceResponse(voice=voice.to_proto(model.name, layout.language_code))

    @rpc_method
    async def DeleteVoice(self, request: speech_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        model = self._speech_model(request.model)
        if model.bundle is not None and model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        if request.name in self._layout_of(model).voices:
            raise errors.failed_precondition(
                f"voice {request.name!r} is built into model {model.name!r}: only created voices can be deleted"
            )
        self.voices.delete(model.name, request.name)
        return speech_pb2.DeleteVoiceResponse()

    @rpc_method
    async def SynthesizeSpeech(
        self, request: speech_pb2.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext
    ) -> None:
        received = time.monotonic()
        salt = request_salt(request.cache_salt)  # this caller's (and cache_salt's) share of the prefix cache
        model = speech_request.speech_model(self.registry, request.model)
        if model.bundle is not None and model.bundle.voice is not None:  # no engine: services/voice_speech.py
            return await voice_speech.synthesize_voice(self, request, context, model, received)
        created = {v.name: v for v in self.voices.list(model.name)}
        job = speech_request.plan_synthesis(request, model, self.limits, created, salt)
        # Opened once admitted (a `with` enters each manager before building the next): the step arbiter puts the
        # stream first when it falls behind its playback, and the metrics close it however the stream ends.
        deadline = self.registry.arbiter.open
        with (
            model.admit(),
            SpeechStreamMetrics(self.metrics, model.name, received, deadline=deadline(model.engine)) as slo,
        ):
            synthesis = SegmentedSynthesis(job, self.limits.max_parallel_segments)
            try:
                await context.write(speech_pb2.SynthesizeSpeechResponse(format=synthesis.audio_format()))
                async for data in synthesis.audio():
                    slo.chunk(synthesis.audio_seconds - slo.meter.sent_s)
                    await context.write(speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=data)))
            except InvalidRequest as err:
                raise invalid(err) from err
            except asyncio.CancelledError:  # client cancel, deadline, forced stop: counted as vLLM does
                self.metrics.request_ended(model.name, "abort")
                raise
            finally:
                await synthesis.close()
            done, totals = time.monotonic(), synthesis.totals(self.metrics)
            slo.finish(totals.audio_seconds, done)
            self.metrics.success.labels(model.name, totals.finish).inc()
            self.metrics.e2e.labels(model.name).observe(done - received)
            if (span := synthesis.codec_span()) is not None:  # tracing: the codec's passes for this request
                current_call().phase("codec", *span)
            first_audio = synthesis.first_audio
            current_call().set(request_id=job.request_id, model=model.name, audio_seconds=round(totals.audio_seconds, 3),
                               ttfa_s=round(first_audio - received, 6) if first_audio is not None else None,
                               underruns=slo.meter.count)  # fmt: skip
            summary = speech_summary(totals, received, done, first_audio, job.request_id, model.name)
            await context.write(speech_pb2.SynthesizeSpeechResponse(summary=summary))
