"""The client side of API keys: `authorization: Bearer KEY` added to every call of a channel.

Its own module, away from services/grpc_api/auth.py (the server's key checks, quotas and call logging, which import the
metrics and so the engine and torch): a client command given --api-key imported all of that, 5-6 s of torch per
command on a busy 2-core machine against 0.4 s without a key."""

from __future__ import annotations

import grpc


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
        self.metadata = metadata


class BearerKey(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer KEY` to every call of a (synchronous) channel: `grpc.intercept_channel(ch, it)`."""

    def __init__(self, key: str) -> None:
        self.header = ("authorization", f"Bearer {key}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, [*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request_iterator)
