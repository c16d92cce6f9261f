"""The omnivox.v1 services a server offers, each as a ServiceBinding (its full name, how to add it, its servicer).
services/grpc_api/server.py adds every one of them to its grpc.aio server; a new service is one more entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from omnivox.services.grpc_api.generation import GenerationServicer
from omnivox.services.grpc_api.model_service import ModelServicer
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.grpc_api.transcription import TranscriptionServicer
from omnivox.services.metrics import Metrics
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.parts.voices import VoiceStore
from omnivox.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    speech_pb2,
    speech_pb2_grpc,
    transcription_pb2,
    transcription_pb2_grpc,
)


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer and how to add it: one per omnivox service."""

    full_name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


def omnivox_services(
    registry: ModelRegistry, metrics: Metrics | None = None, data_dir: Path | None = None
) -> list[ServiceBinding]:
    """Every omnivox.v1 service this server offers. A new service is one more entry here."""
    bindings = [
        ServiceBinding(
            generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            generation_pb2_grpc.add_GenerationServiceServicer_to_server,
            GenerationServicer(registry, metrics),
        ),
        ServiceBinding(
            model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
            model_pb2_grpc.add_ModelServiceServicer_to_server,
            ModelServicer(registry),
        ),
        ServiceBinding(
            speech_pb2.DESCRIPTOR.services_by_name["SpeechService"].full_name,
            speech_pb2_grpc.add_SpeechServiceServicer_to_server,
            SpeechServicer(registry, metrics=metrics, voices=VoiceStore(data_dir)),
        ),
        ServiceBinding(
            transcription_pb2.DESCRIPTOR.services_by_name["TranscriptionService"].full_name,
            transcription_pb2_grpc.add_TranscriptionServiceServicer_to_server,
            TranscriptionServicer(registry, metrics=metrics),
        ),
    ]
    return bindings
