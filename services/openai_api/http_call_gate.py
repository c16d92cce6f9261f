"""The HTTP front's call gate: who calls (Bearer key, quota) on the way in, and the status counter, log line and quota
given back on the way out. Every route on the HTTP port goes through it: the HTTP calls (services/openai_api/
http_front.py `HttpFront.call`) and the realtime sessions (services/openai_api/realtime/route.py), so both hold the
same keys and quotas as the gRPC chain (`AuthInterceptor`: one book for both fronts)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from omnivox.services import call_record
from omnivox.services.errors import Code, ServiceError
from omnivox.services.grpc_api import logs
from omnivox.services.grpc_api.auth import AuthInterceptor, bearer_token
from omnivox.services.metrics import Metrics


class CallGate:
    def __init__(self, auth: AuthInterceptor | None, metrics: Metrics) -> None:
        self.auth, self.metrics = auth, metrics

    def admit(self, headers: Iterable[tuple[str, str]], record: call_record.CallRecord) -> str | None:
        """The caller (its quota taken) when the server has keys or quotas; None when it has neither.
        UNAUTHENTICATED for a missing or unknown key, RESOURCE_EXHAUSTED past the caller's quota."""
        if self.auth is None:
            return None
        caller = ""
        if self.auth.api_keys:
            key = bearer_token(headers)  # the gRPC chain's parsing (starlette lower-cases names)
            key_id = self.auth.caller_of_key(key)
            if key_id is None:
                message = "invalid API key" if key else "missing API key"
                raise ServiceError(Code.UNAUTHENTICATED, f"{message}: send 'Authorization: Bearer KEY'")
            caller = key_id
        record.caller = caller
        self.auth.quotas.take(caller)
        return caller

    def end(self, record: call_record.CallRecord, code: Code, taken: str | None) -> None:
        """The call is over: the caller's quota back (`taken`, what `admit` returned), the status counted, one log line."""
        if taken is not None and self.auth is not None:
            self.auth.quotas.give_back(taken)
        self.metrics.grpc_status.labels(f"http:{record.method}", code.name).inc()
        line = {"event": "http", "method": record.method, "caller": record.caller, **record.fields}
        line.update(status=code.name, total_s=round(time.monotonic() - record.started, 6))
        logs.request_log.info(json.dumps(line, sort_keys=False))
