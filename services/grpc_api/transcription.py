"""TranscriptionService, the gRPC face of transcription: each RPC admits, processes and outputs through the modules
every front shares (Transcribe: services/calls/transcribe_call.py; StreamingTranscribe:
services/calls/streaming_transcribe_call.py), and writes their responses to the call.

Transcribe: speech in, text deltas out, then one summary (text, language, audio seconds, real-time factor, segments
with their offsets). Audio-LLMs (Qwen2-Audio, Qwen3-ASR, Voxtral) transcribe window by window
(services/calls/audio_llm_windows.py), Whisper models through services/calls/whisper.py. StreamingTranscribe (Whisper): live
audio in, speech events and interim / final results per utterance out.
"""

from __future__ import annotations

import contextlib

import grpc

from omnivox.services.calls.streaming_transcribe_call import streaming_transcribe
from omnivox.services.calls.transcribe_call import transcribe_call
from omnivox.services.grpc_api.rpc_errors import rpc_method
from omnivox.services.metrics import Metrics
from omnivox.services.parts.registry import ModelRegistry
from omnivox.v1 import transcription_pb2, transcription_pb2_grpc


class TranscriptionServicer(transcription_pb2_grpc.TranscriptionServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics()

    @rpc_method
    async def Transcribe(self, request: transcription_pb2.TranscribeRequest, context: grpc.aio.ServicerContext) -> None:
        await transcribe_call(request, self.registry, self.metrics, context.write)

    @rpc_method
    async def StreamingTranscribe(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        responses = streaming_transcribe(request_iterator, self.registry, self.metrics)
        async with contextlib.aclosing(responses):
            async for response in responses:
                await context.write(response)
