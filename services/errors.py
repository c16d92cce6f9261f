"""gRPC errors with google.rpc details: every failure a servicer reports goes through ServiceError.

A servicer raises ServiceError anywhere below its handler; `rpc_method` turns it into the call's final status, with the
details packed as `google.rpc.Status` in the trailing metadata (grpcio-status), which `grpcurl` and every gRPC client
library know how to read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

DOMAIN = "omnivox"


class ModelLoadError(Exception):
    """A model that cannot be served, with a one-line reason for the person who asked for it."""


@dataclass(frozen=True)
class FieldViolation:
    """One rejected request value. `field` is a path into the request message, e.g. ``contents[0].role``."""

    field: str
    description: str


class ServiceError(Exception):
    """A gRPC status code, a message, and google.rpc detail messages."""

    def __init__(self, code: grpc.StatusCode, message: str, details: Sequence[Message] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = tuple(details)

    def to_status(self) -> grpc.Status:
        packed = []
        for detail in self.details:
            any_msg = any_pb2.Any()
            any_msg.Pack(detail)
            packed.append(any_msg)
        proto = status_pb2.Status(code=_CODE_NUMBERS[self.code], message=self.message, details=packed)
        return rpc_status.to_status(proto)

    @property
    def field_violations(self) -> list[FieldViolation]:
        out = []
        for detail in self.details:
            if isinstance(detail, error_details_pb2.BadRequest):
                out.extend(FieldViolation(v.field, v.description) for v in detail.field_violations)
        return out


_CODE_NUMBERS = {code: code.value[0] for code in grpc.StatusCode}


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
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, [bad_request])


def not_found(resource_type: str, name: str, message: str) -> ServiceError:
    """`name` and `message` echo what the client asked for: cut to fit the trailers (see _DESCRIPTION_BYTES)."""
    name, message = _cut(name, 200), _cut(message, _DESCRIPTION_BYTES)
    info = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=name, description=message)
    return ServiceError(grpc.StatusCode.NOT_FOUND, message, [info])


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def resource_exhausted(message: str, retry_after_s: float) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, [_retry_info(retry_after_s)])


def unavailable(message: str, retry_after_s: float | None = None) -> ServiceError:
    details = [_retry_info(retry_after_s)] if retry_after_s is not None else []
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, details)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def internal(message: str) -> ServiceError:
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN)
    return ServiceError(grpc.StatusCode.INTERNAL, message, [info])


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def rpc_method(handler: F) -> F:
    """Decorate an async servicer method (unary, or streaming through `context.write`).

    ServiceError becomes the final status with its details; any other exception becomes INTERNAL (logged with its
    traceback, reported as one line). Cancellation passes through untouched so that `finally` blocks below run.

    A send that grpc core refuses (grpc.aio.InternalError, i.e. ExecuteBatchError from `context.write`) means the
    call is already over underneath us: the client cancelled or its deadline passed, and core finished the call a
    moment before grpc cancels this task (a race that shows under load). Nobody is left to answer, and answering
    would fail too (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), so it ends the handler as the cancellation it is: no
    traceback, and the call is counted CANCELLED / DEADLINE_EXCEEDED instead of INTERNAL.
    """

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except ServiceError as err:
            await context.abort_with_status(err.to_status())
        except grpc.aio.AbortError:
            raise
        except grpc.aio.InternalError as exc:
            log.debug("%s: the call ended under it (%s); treated as cancelled", handler.__qualname__, exc)
            raise asyncio.CancelledError(f"the call ended: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the last line of defence: report, do not crash the server
            log.exception("%s failed", handler.__qualname__)
            await context.abort_with_status(internal(f"{type(exc).__name__}: {exc}").to_status())

    return wrapper  # type: ignore[return-value]


# Client side: reading the details back.


def status_details(err: grpc.RpcError) -> list[Message]:
    """The google.rpc detail messages of a failed call (BadRequest, RetryInfo, ResourceInfo, ErrorInfo)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return []
    out: list[Message] = []
    for any_msg in status.details:
        for cls in (
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
            error_details_pb2.ResourceInfo,
            error_details_pb2.ErrorInfo,
        ):
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                out.append(msg)
    return out
