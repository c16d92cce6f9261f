"""The shared decode engine: continuous batching over a paged KV cache, with a complete sampler."""

from omnivox.engine.block_pool import KVUsage
from omnivox.engine.core import StepResult, StepStats
from omnivox.engine.engine import Engine
from omnivox.engine.errors import InvalidRequest
from omnivox.engine.loading import build_model
from omnivox.engine.outputs import RequestOutput, TokenLogprob
from omnivox.engine.params import ConstraintFactory, SamplingParams, TokenConstraint, shared
from omnivox.engine.request import EmbeddingSegment

__all__ = [
    "ConstraintFactory",
    "Engine",
    "EmbeddingSegment",
    "InvalidRequest",
    "KVUsage",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
    "StepStats",
    "TokenConstraint",
    "TokenLogprob",
    "build_model",
    "shared",
]
