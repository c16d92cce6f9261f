"""SpeechService (the gRPC face): each RPC writes what services/calls/speech_call.py `SpeechCalls` yields.

A speech model is a checkpoint folder with `speech_layout.json` (models/orpheus.py: where the audio tokens live and how
the prompt is framed) and a SNAC codec in `<folder>/<layout.codec_folder>`, or a voice without an engine
(services/parts/voice_part.py). SynthesizeSpeech reads admit -> process -> engine.stream -> output:

  services/calls/speech_call.py (the call) -> services/processing/speech_request.py (the model, validation, segments, their prompts and
  parameters) -> services/output/speech_synthesis.py (one engine request per segment in parallel, frames through
  services/output/audio_frames.py to the model's DecodeWorker, chunks encoded in order) -> services/output/summaries.py.

StreamingSynthesizeSpeech is services/calls/speech_stream.py; voices without an engine are services/calls/voice_speech.py.
Leaving the handler in any way (done, cancelled, deadline, error) closes the call's iterator, which closes the
segments' engine streams (aborting them and freeing their KV blocks) and the codec streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors
from omnivox.services.calls import voice_speech
from omnivox.services.calls.speech_call import SpeechCalls
from omnivox.services.grpc_api.rpc_errors import rpc_method
from omnivox.services.metrics import Metrics
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.parts.voices import VoiceStore
from omnivox.services.processing import speech_request
from omnivox.services.processing.csm_voice import load_voice_encoder
from omnivox.services.processing.speech_request import SpeechLimits
from omnivox.v1 import speech_pb2, speech_pb2_grpc

__all__ = ["SpeechLimits", "SpeechServicer"]


async def _write_all(responses: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
    async with contextlib.aclosing(responses):
        async for response in responses:
            await context.write(response)


class SpeechServicer(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        limits: SpeechLimits | None = None,
        metrics: Metrics | None = None,
        voices: VoiceStore | None = None,
    ) -> None:
        self.calls = SpeechCalls(registry, limits or SpeechLimits(), metrics or Metrics(), voices or VoiceStore())
        self.registry, self.limits, self.metrics, self.voices = (
            registry,
            self.calls.limits,
            self.calls.metrics,
            self.calls.voices,
        )

    @rpc_method
    async def ListVoices(
        self, request: speech_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> speech_pb2.ListVoicesResponse:
        return speech_pb2.ListVoicesResponse(voices=self.calls.list_voices(request.model, request.language_code))

    @rpc_method
    async def SynthesizeSpeech(
        self, request: speech_pb2.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await _write_all(self.calls.synthesize(request), context)

    @rpc_method
    async def StreamingSynthesizeSpeech(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await _write_all(self.calls.stream(request_iterator), context)

    @rpc_method
    async def CreateVoice(self, request: speech_pb2.CreateVoiceRequest, context: grpc.aio.ServicerContext):
        model = speech_request.speech_model(self.registry, request.model)
        assert model.bundle is not None
        if model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        assert model.bundle.speech is not None
        layout = model.bundle.speech.layout
        if isinstance(layout, SpeechLayout):
            voice = await self.voices.create(model.name, layout, model.bundle.source / layout.codec_folder, request)
        else:  # CSM: the reference encoded by the folder's Mimi, a context turn of every prompt in this voice
            source, n = model.bundle.source, layout.num_codebooks
            voice = await self.voices.create(
                model.name, layout, source, request, lambda: load_voice_encoder(model.name, source, n),
                model.context_length // 2,
            )  # fmt: skip
        return speech_pb2.CreateVoiceResponse(voice=voice.to_proto(model.name, layout.language_code))

    @rpc_method
    async def DeleteVoice(self, request: speech_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        model = speech_request.speech_model(self.registry, request.model)
        if model.bundle is not None and model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        if request.name in speech_request.layout_of(model).voices:
            raise errors.failed_precondition(
                f"voice {request.name!r} is built into model {model.name!r}: only created voices can be deleted"
            )
        self.voices.delete(model.name, request.name)
        return speech_pb2.DeleteVoiceResponse()
