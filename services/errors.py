"""Service errors with google.rpc details: every failure a request's processing reports goes through ServiceError.

Request and output processing raise ServiceError anywhere below a front; it carries a `Code` (gRPC's status codes by
name and number, defined here so that processing imports nothing of grpc and an HTTP or WebSocket front can map the
same error to its own status). The gRPC face turns it into the call's final status (services/grpc_api/rpc_errors.py), the
HTTP front into OpenAI's error JSON (services/openai_api/http_front.py).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2

log = logging.getLogger(__name__)

DOMAIN = "omnivox"


class ModelLoadError(Exception):
    """A model that cannot be served, with a one-line reason for the person who asked for it."""


@dataclass(frozen=True)
class FieldViolation:
    """One rejected request value. `field` is a path into the request message, e.g. ``contents[0].role``."""

    field: str
    description: str


class Code(enum.IntEnum):
    """A status code: gRPC's (google.rpc.Code) names and numbers, so every front reads the same one."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ServiceError(Exception):
    """A status code, a message, and google.rpc detail messages."""

    def __init__(self, code: Code, message: str, details: Sequence[Message] = ()) -> None:
        super().__init__(message)
        self.code = Code(code)
        self.message = message
        self.details = tuple(details)

    @property
    def field_violations(self) -> list[FieldViolation]:
        out = []
        for detail in self.details:
            if isinstance(detail, error_details_pb2.BadRequest):
                out.extend(FieldViolation(v.field, v.description) for v in detail.field_violations)
        return out


# A status travels in the trailing metadata, and a client drops trailers past 8 KiB (grpc's default soft limit; 16 KiB
# hard), answering RESOURCE_EXHAUSTED "Stream removed" instead of the status: a compile error echoing a 5,000-character
# regex made 30 KB. So at most this many violations, their descriptions cut to a share of this many UTF-8 bytes (the
# message is percent-encoded past ASCII, up to 3x; the details go base64, 4/3x): under 7 KiB in all.
_MAX_VIOLATIONS = 16
_DESCRIPTION_BYTES = 1500


def _cut(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    head = data[:limit].decode(errors="ignore")
    return f"{head}... ({len(text) - len(head)} more characters)"


def invalid_argument(violations: Sequence[FieldViolation]) -> ServiceError:
    assert violations, "invalid_argument needs at least one violation"
    more = len(violations) - _MAX_VIOLATIONS
    violations = violations[:_MAX_VIOLATIONS]
    limit = max(48, _DESCRIPTION_BYTES // len(violations))
    violations = [FieldViolation(_cut(v.field, 200), _cut(v.description, limit)) for v in violations]
    message = "; ".join(f"{v.field}: {v.description}" for v in violations)
    if more > 0:
        message += f"; and {more} more"
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description) for v in violations
        ]
    )
    return ServiceError(Code.INVALID_ARGUMENT, message, [bad_request])


def not_found(resource_type: str, name: str, message: str) -> ServiceError:
    """`name` and `message` echo what the client asked for: cut to fit the trailers (see _DESCRIPTION_BYTES)."""
    name, message = _cut(name, 200), _cut(message, _DESCRIPTION_BYTES)
    info = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=name, description=message)
    return ServiceError(Code.NOT_FOUND, message, [info])


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def resource_exhausted(message: str, retry_after_s: float) -> ServiceError:
    return ServiceError(Code.RESOURCE_EXHAUSTED, message, [_retry_info(retry_after_s)])


def unavailable(message: str, retry_after_s: float | None = None) -> ServiceError:
    details = [_retry_info(retry_after_s)] if retry_after_s is not None else []
    return ServiceError(Code.UNAVAILABLE, message, details)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(Code.FAILED_PRECONDITION, message)


def internal(message: str) -> ServiceError:
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN)
    return ServiceError(Code.INTERNAL, message, [info])
