"""ServiceError on the gRPC face: the call's final status, with the details packed as `google.rpc.Status` in the
trailing metadata (grpcio-status), which `grpcurl` and every gRPC client library know how to read; and, client side,
the details read back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from omnivox.services.errors import Code, ServiceError, internal

log = logging.getLogger(__name__)


def grpc_code(code: Code) -> grpc.StatusCode:
    return _GRPC_CODES[code]


_GRPC_CODES = {Code(c.value[0]): c for c in grpc.StatusCode}


def to_status(err: ServiceError) -> grpc.Status:
    packed = []
    for detail in err.details:
        any_msg = any_pb2.Any()
        any_msg.Pack(detail)
        packed.append(any_msg)
    proto = status_pb2.Status(code=int(err.code), message=err.message, details=packed)
    return rpc_status.to_status(proto)


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
            await context.abort_with_status(to_status(err))
        except grpc.aio.AbortError:
            raise
        except grpc.aio.InternalError as exc:
            log.debug("%s: the call ended under it (%s); treated as cancelled", handler.__qualname__, exc)
            raise asyncio.CancelledError(f"the call ended: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the last line of defence: report, do not crash the server
            log.exception("%s failed", handler.__qualname__)
            await context.abort_with_status(to_status(internal(f"{type(exc).__name__}: {exc}")))

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
