"""What an INVALID_ARGUMENT carries: its `google.rpc.BadRequest` field violations, read from the status details."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status.rpc_status import from_call

FieldViolation = error_details_pb2.BadRequest.FieldViolation


def field_violations(err: grpc.RpcError) -> list[FieldViolation]:
    """Every field violation of an INVALID_ARGUMENT, in the order the server wrote them."""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    status = from_call(err)
    assert status is not None, f"INVALID_ARGUMENT without google.rpc details: {err.details()}"
    out = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.extend(bad.field_violations)
    return out


def violated_fields(err: grpc.RpcError) -> list[str]:
    """The request fields an INVALID_ARGUMENT names, in order."""
    return [v.field for v in field_violations(err)]


def violation_descriptions(err: grpc.RpcError) -> dict[str, str]:
    """field -> description, for each field an INVALID_ARGUMENT names."""
    return {v.field: v.description for v in field_violations(err)}
