"""One Generate from a wire request to its responses, whichever front carries it (gRPC's GenerationServicer, the
HTTP front's /v1/chat/completions and /v1/completions): check -> admit -> process -> engine.stream -> output.

Closing the iterator early (client gone, deadline passed, server stopping) closes the engine stream, which aborts the
request and frees its KV blocks at once; a refusal is a ServiceError (services/errors.py) each front reports its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from omnivox.engine import RequestOutput
from omnivox.engine.errors import InvalidRequest
from omnivox.services.call_record import current_call
from omnivox.services.metrics import Metrics
from omnivox.services.output.generate_output import GenerateOutput
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.processing import generate_request, validation
from omnivox.v1 import generation_pb2


async def generate_responses(
    request: generation_pb2.GenerateRequest,
    registry: ModelRegistry,
    metrics: Metrics,
    raw_prompt: str | None = None,
    admitted: bool = False,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The deltas then the summary of one request. `raw_prompt`: a completion's text, tokenised without the chat
    template (the request's contents then only carry it for the size and field checks). `admitted`: the caller holds
    the model's queue slot for it (the HTTP front's n choices are one queued request, as in vLLM, whose n children
    come from one API request)."""
    received, call = time.monotonic(), current_call()
    checked = await generate_request.check(request, registry)
    checked.raw_prompt = raw_prompt
    call.set(model=checked.model.name)
    # counted against the queue bound, and waited for by a drain
    with contextlib.nullcontext() if admitted else checked.model.admit():
        job = await generate_request.process(checked, call.phase)
        output = GenerateOutput(job, received, metrics, call)
        last: RequestOutput | None = None
        stream = job.stream()
        async with contextlib.aclosing(stream):
            try:
                async for last in stream:
                    if (response := output.delta(last)) is not None:
                        yield response
            except InvalidRequest as err:  # raised by add_request, before the engine queued anything
                job.prompt.release()
                raise validation.from_invalid_request(err) from err
            except (asyncio.CancelledError, GeneratorExit):  # client gone, deadline, forced stop: the request aborts
                metrics.request_ended(job.model.name, "abort")
                raise
        for response in output.finish(last):
            yield response
