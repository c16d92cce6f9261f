"""The wire checks every RPC shares (request processing): one bound on client request ids, checked one way."""

from __future__ import annotations

from omnivox.services.errors import FieldViolation

MAX_REQUEST_ID_CHARS = 256  # a client's request_id: echoed in summaries and logs, so bounded


def request_id_violation(request_id: str, field: str = "request_id") -> FieldViolation | None:
    """A violation naming `field` when the client's request id is too long; None when it is fine."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return FieldViolation(field, f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    return None
