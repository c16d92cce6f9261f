"""What every RPC's summary is written with (output processing): durations and finish reasons on the wire."""

from __future__ import annotations

from google.protobuf import duration_pb2

from omnivox.v1 import generation_pb2

# The engine's finish reasons as the API spells them (generation.proto FinishReason).
FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def finish_reason(reason: str | None) -> int:
    """The wire value of an engine finish reason; UNSPECIFIED for one the API has no name for."""
    return FINISH_REASONS.get(reason or "", generation_pb2.FINISH_REASON_UNSPECIFIED)


def seconds_to_duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d
