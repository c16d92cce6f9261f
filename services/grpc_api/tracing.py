"""Optional OpenTelemetry tracing: one SERVER span per omnivox RPC, continuing the client's `traceparent`, with a
child span per phase the servicer recorded (`CallRecord.phase`: queue, prefill, decode, ...).

Off unless configured (`serve --trace-console`, or `--otlp-endpoint` with opentelemetry-exporter-otlp installed);
the OpenTelemetry packages are imported only then (`pip install omnivox[tracing]`). The provider is this server's
own, never the process-global one, so embedding applications keep theirs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from omnivox.services.call_record import current_call
from omnivox.services.grpc_api.logs import OMNIVOX_PREFIX, Behavior, around_call, wrap_handler


def _epoch_offset_ns() -> int:
    """What to add to a time.monotonic() instant (in ns) to put it on the wall clock spans are written in.

    Read once per call and shared by its phases: read per phase, a thread descheduled between the two clock reads
    shifted one phase against the next (at load 7 a 'decode' span sorted before its 'prefill')."""
    return time.time_ns() - time.monotonic_ns()


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Place it inside CallInterceptor (which opens the CallRecord the phases come from)."""

    def __init__(self, exporter: Any, batch: bool = True, service_name: str = "omnivox") -> None:
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("omnivox.services")
        self.propagator = TraceContextTextMapPropagator()
        self.getter = DefaultGetter()

    def shutdown(self) -> None:
        self.provider.shutdown()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        handler = await continuation(details)
        method = details.method or ""
        if not method.startswith(OMNIVOX_PREFIX):
            return handler
        carrier = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        parent = self.propagator.extract(carrier)

        def around(behavior: Behavior) -> Behavior:
            spans: list[Any] = []

            async def before(context: Any) -> None:
                span = self.tracer.start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER)
                span.set_attribute("rpc.system", "grpc")
                spans.append(span)

            def after(context: Any, code: grpc.StatusCode) -> None:
                if not spans:
                    return
                span = spans.pop()
                record = current_call()
                in_span = trace.set_span_in_context(span)
                offset_ns = _epoch_offset_ns()
                for name, start, end in record.phases:
                    child = self.tracer.start_span(name, context=in_span, start_time=offset_ns + int(start * 1e9))
                    child.end(end_time=offset_ns + int(end * 1e9))
                for key, value in record.fields.items():
                    if isinstance(value, str | int | float) and not isinstance(value, bool):
                        span.set_attribute(f"omnivox.{key}", value)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code is not grpc.StatusCode.OK:
                    span.set_status(Status(StatusCode.ERROR, code.name))
                span.end()

            return around_call(behavior, before, after)

        return wrap_handler(handler, around)


def exporter_for(console: bool, otlp_endpoint: str | None) -> Any | None:
    """The span exporter `serve` was asked for, or None (tracing off)."""
    if otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError("--otlp-endpoint needs `pip install opentelemetry-exporter-otlp`") from exc
        return OTLPSpanExporter(endpoint=otlp_endpoint, insecure=otlp_endpoint.startswith("http://"))
    if console:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return None
