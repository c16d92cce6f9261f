"""GenerationService (the gRPC face of Generate): admit -> process -> engine.stream -> output.

Request processing is services/generate_request.py (sizes, fields, cascade, grammars, tools, reasoning, the prompt),
output processing services/generate_output.py (deltas, reasoning and tool-call rewrites, the summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from omnivox.engine import RequestOutput
from omnivox.engine.errors import InvalidRequest
from omnivox.services import generate_request, validation
from omnivox.services.errors import rpc_method
from omnivox.services.generate_output import GenerateOutput
from omnivox.services.logs import current_call
from omnivox.services.metrics import Metrics
from omnivox.services.registry import ModelRegistry
from omnivox.v1 import generation_pb2, generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics()

    @rpc_method
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        received, call = time.monotonic(), current_call()
        checked = await generate_request.check(request, self.registry)
        call.set(model=checked.model.name)
        with checked.model.admit():  # counted against the queue bound, and waited for by a drain
            job = await generate_request.process(checked, call.phase)
            output = GenerateOutput(job, received, self.metrics, call)
            last: RequestOutput | None = None
            stream = job.stream()
            # Leaving this block in any way (finished, client cancelled, deadline passed, server stopping) closes the
            # engine stream, which aborts the request and frees its KV blocks at once.
            async with contextlib.aclosing(stream):
                try:
                    async for last in stream:
                        if (response := output.delta(last)) is not None:
                            await context.write(response)
                except InvalidRequest as err:  # raised by add_request, before the engine queued anything
                    job.prompt.release()
                    raise validation.from_invalid_request(err) from err
                except asyncio.CancelledError:  # client cancel, deadline, forced stop: the engine request aborts
                    self.metrics.request_ended(job.model.name, "abort")
                    raise
            for response in output.finish(last):
                await context.write(response)
