"""The shared decode engine: continuous batching over a paged KV cache, with a complete sampler."""

from omnivox.engine.block_pool import KVUsage
from omnivox.engine.engine import Engine, build_model
from omnivox.engine.errors import InvalidRequest
from omnivox.engine.outputs import RequestOutput, TokenLogprob
from omnivox.engine.params import SamplingParams, TokenConstraint
from omnivox.engine.request import EmbeddingSegment

__all__ = [
    "Engine",
    "EmbeddingSegment",
    "InvalidRequest",
    "KVUsage",
    "RequestOutput",
    "SamplingParams",
    "TokenConstraint",
    "TokenLogprob",
    "build_model",
]
