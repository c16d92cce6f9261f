"""GenerationService (the gRPC face of Generate): the responses of services/calls/generate_call.py, written to the call.

Request processing is services/processing/generate_request.py (sizes, fields, cascade, grammars, tools, reasoning, the prompt),
output processing services/output/generate_output.py (deltas, reasoning and tool-call rewrites, the summary).
"""

from __future__ import annotations

import contextlib

import grpc

from omnivox.services.calls.generate_call import generate_responses
from omnivox.services.grpc_api.rpc_errors import rpc_method
from omnivox.services.metrics import Metrics
from omnivox.services.parts.registry import ModelRegistry
from omnivox.v1 import generation_pb2, generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics()

    @rpc_method
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        responses = generate_responses(request, self.registry, self.metrics)
        async with contextlib.aclosing(responses):  # a cancel closes it: the engine request aborts (generate_call.py)
            async for response in responses:
                await context.write(response)
