"""ModelService: what this server serves."""

from __future__ import annotations

import grpc

from omnivox.services.grpc_api.rpc_errors import rpc_method
from omnivox.services.parts.registry import AUDIO, IMAGE, TEXT, ModelRegistry, ModelState, ServedModel
from omnivox.services.processing.validation import SAMPLING_FIELDS
from omnivox.v1 import model_pb2, model_pb2_grpc, sampling_pb2

MODALITIES = {TEXT: model_pb2.MODALITY_TEXT, IMAGE: model_pb2.MODALITY_IMAGE, AUDIO: model_pb2.MODALITY_AUDIO}


def _modalities(names: frozenset[str]) -> list[int]:
    return sorted(MODALITIES[n] for n in names)


def default_sampling(defaults: dict[str, object]) -> sampling_pb2.SamplingConfig:
    """A model's sampling defaults as the SamplingConfig a request would send to ask for them."""
    config = sampling_pb2.SamplingConfig(**{k: v for k, v in defaults.items() if k in SAMPLING_FIELDS})
    if defaults.get("logit_bias"):
        config.logit_bias.update(defaults["logit_bias"])  # type: ignore[arg-type]
    return config


def model_info(model: ServedModel, default_name: str | None) -> model_pb2.ModelInfo:
    return model_pb2.ModelInfo(
        name=model.name,
        input_modalities=_modalities(model.input_modalities),
        output_modalities=_modalities(model.output_modalities),
        context_length=model.context_length,
        has_untrained_components=bool(model.untrained_components),
        untrained_components=list(model.untrained_components),
        is_default=model.name == default_name,
        source=str(model.source or ""),
        ready=model.state is ModelState.READY,
        default_sampling=default_sampling(model.sampling_defaults),
        trained_on=model.manifest.trained_on,
    )


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    @rpc_method
    async def ListModels(
        self, request: model_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.ListModelsResponse:
        default = self.registry.default
        default_name = default.name if default is not None else None
        return model_pb2.ListModelsResponse(models=[model_info(m, default_name) for m in self.registry])
