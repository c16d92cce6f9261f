"""One JSON line per omnivox RPC at its end, and the per-RPC status counter.

`CallInterceptor` wraps every omnivox.v1 method: it opens a `CallRecord` (reachable from the servicer through
`current_call()`), and when the call ends, however it ends, counts its gRPC status and writes one line to the
`omnivox.requests` logger:

    {"event": "rpc", "method": "Generate", "request_id": "...", "model": "tiny", "caller": "alice",
     "status": "OK", "prompt_tokens": 12, "output_tokens": 30, "cached_tokens": 0, "ttft_s": 0.041, "total_s": 0.52}

Servicers fill in numbers only (ids, model name, token counts, timings, audio seconds): prompts, outputs and audio
never reach this line (a test sends a canary string and greps the log for it).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from omnivox.services.call_record import CallRecord, reset_current_call, set_current_call
from omnivox.services.metrics import Metrics

request_log = logging.getLogger("omnivox.requests")

OMNIVOX_PREFIX = "/omnivox.v1."

Behavior = Callable[..., Any]


def wrap_handler(
    handler: grpc.RpcMethodHandler | None, around: Callable[[Behavior], Behavior]
) -> grpc.RpcMethodHandler | None:
    """The same handler with its behaviour (whichever of the four kinds it is) replaced by `around(behaviour)`."""
    if handler is None:
        return None
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: around(behavior)})  # RpcMethodHandler is a namedtuple
    return handler


DEADLINE_SKEW_S = 0.1  # a cancel this close to the call's deadline is the deadline's


def around_call(
    behavior: Behavior, before: Callable[[Any], Awaitable[None]], after: Callable[[Any, grpc.StatusCode], None]
) -> Behavior:
    """Run `before(context)` ahead of the behaviour and `after(context, code)` once it ended with status `code`.
    Handlers here are coroutines that write through `context.write`; async-generator handlers are wrapped too."""

    def code_of(exc: BaseException | None, context: Any) -> grpc.StatusCode:
        if exc is None:
            return grpc.StatusCode.OK
        if isinstance(exc, asyncio.CancelledError):
            # The client cancels at its own deadline; the server's copy of it (the grpc-timeout header, counted from
            # the headers' arrival) runs a little later, so a call cut by its deadline can still show a few ms left
            # (counted CANCELLED once in CI: test_metrics_parse_counters_only_grow_and_gauges_return_to_zero).
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= DEADLINE_SKEW_S
            return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)

    if inspect.isasyncgenfunction(behavior):

        async def gen_wrapper(request: Any, context: Any) -> Any:
            exc: BaseException | None = None
            try:
                await before(context)
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                after(context, code_of(exc, context))

        return gen_wrapper

    async def wrapper(request: Any, context: Any) -> Any:
        exc: BaseException | None = None
        try:
            await before(context)
            return await behavior(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            after(context, code_of(exc, context))

    return wrapper


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Status counter + one JSON log line per omnivox RPC; health and reflection pass untouched."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if not method.startswith(OMNIVOX_PREFIX):
            return handler
        name = method.rsplit("/", 1)[-1]

        def around(behavior: Behavior) -> Behavior:
            record = CallRecord(name)
            token: list[contextvars.Token] = []

            async def before(context: Any) -> None:
                record.started = time.monotonic()
                token.append(set_current_call(record))

            def after(context: Any, code: grpc.StatusCode) -> None:
                self.metrics.grpc_status.labels(name, code.name).inc()
                line = {"event": "rpc", "method": name, "caller": record.caller, **record.fields}
                line.update(status=code.name, total_s=round(time.monotonic() - record.started, 6))
                request_log.info(json.dumps(line, sort_keys=False))
                if token:
                    reset_current_call(token[0])

            return around_call(behavior, before, after)

        return wrap_handler(handler, around)
