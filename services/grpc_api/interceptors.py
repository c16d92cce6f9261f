"""The server's interceptor chain, outermost first: calls (status counter + JSON log line; it opens the CallRecord
the others write to), tracing when an exporter is configured, then auth when keys, client certificates or quotas
are."""

from __future__ import annotations

from typing import Any

import grpc

from omnivox.services.grpc_api.auth import AuthInterceptor, KeyFile, Quota
from omnivox.services.grpc_api.logs import CallInterceptor
from omnivox.services.metrics import Metrics


def server_interceptors(metrics: Metrics, options: Any) -> tuple[list[grpc.aio.ServerInterceptor], Any]:
    """(the chain, the tracing interceptor or None) for a ServerOptions."""
    chain: list[grpc.aio.ServerInterceptor] = [CallInterceptor(metrics)]
    tracing = None
    if options.trace_exporter is not None:
        from omnivox.services.grpc_api.tracing import (
            TracingInterceptor,  # OpenTelemetry is imported only when asked for
        )

        tracing = TracingInterceptor(options.trace_exporter)
        chain.append(tracing)
    if options.api_keys or options.tls_client_ca or options.quota != Quota():
        keys = KeyFile(options.api_keys) if options.api_keys else None  # re-read when it changes
        chain.append(AuthInterceptor(keys, mtls=options.tls_client_ca is not None, quota=options.quota))
    return chain, tracing
