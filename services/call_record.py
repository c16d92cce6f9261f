"""The record of the call a task serves (CallRecord), reachable from any processing step through `current_call()`:
the gRPC interceptor (services/grpc_api/logs.py) and the HTTP front open it, processing fills in numbers only (ids, model name,
token counts, timings), and the call's log line and tracing spans are written from it when the call ends.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

# The record of the RPC the current task serves (set by CallInterceptor; None outside an omnivox RPC).
_CURRENT: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("omnivox_call", default=None)


@dataclass
class CallRecord:
    method: str
    started: float = field(default_factory=time.monotonic)
    caller: str = ""  # the API key's id or the client certificate's name; "" when the server has no auth
    fields: dict[str, Any] = field(default_factory=dict)  # numbers and ids only: never request or response content
    # Named spans of the call's life, time.monotonic() start and end: queue, prefill, decode, ... (tracing's spans)
    phases: list[tuple[str, float, float]] = field(default_factory=list)

    def set(self, **values: str | int | float | None) -> None:
        self.fields.update(values)

    def phase(self, name: str, start: float, end: float) -> None:
        if end >= start:
            self.phases.append((name, start, end))


def current_call() -> CallRecord:
    """The running RPC's record, or a detached one (servicers called outside the interceptor, e.g. in tests)."""
    return _CURRENT.get() or CallRecord("")


def set_current_call(record: CallRecord) -> contextvars.Token:
    """Make `record` the current call's (the HTTP front's calls, which no interceptor opens); reset with the token."""
    return _CURRENT.set(record)


def reset_current_call(token: contextvars.Token) -> None:
    _CURRENT.reset(token)
