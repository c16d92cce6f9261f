"""Server limits, set deliberately: the gRPC channel options, and input sizes checked before any work.

gRPC options (one `GrpcLimits`, documented in docs/operations.md, "Limits"):
- max concurrent streams per HTTP/2 connection: one client cannot hold more than this many calls at once on one
  connection (further streams wait in its transport), so the queue bound is shared fairly between connections;
- metadata size: headers beyond this are refused by gRPC itself before a handler runs;
- keepalive enforcement: a client pinging more often than `min_ping_interval_s` without data gets a strike; after
  `max_ping_strikes` the connection is closed (GOAWAY ENHANCE_YOUR_CALM), so ping floods cost the server nothing;
- connection age: a connection is closed gracefully after `max_connection_age_s` (+ a grace for its running streams)
  so that clients behind a load balancer reconnect and rebalance.

Input limits (`check_generate_limits`): counted on the message as received, before tokenising or decoding, so that a
huge request costs one length check. Image and audio bytes, pixels and durations are limited by the image and audio
prompt builders (their `limits`), also before decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnivox.services.errors import FieldViolation
from omnivox.v1 import generation_pb2

MAX_TEXT_BYTES = 1 << 20  # all text parts of one request together (UTF-8): ~250k tokens, above any context we serve
MAX_CONTENTS = 1024  # turns
MAX_PARTS = 1024  # parts over all turns
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_SEQUENCE_BYTES = 256  # each
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class GrpcLimits:
    # Per connection. Above any --max-queue we ship (256): a burst opened at once on a fresh connection, before the
    # client has read this setting, gets RST_STREAM REFUSED_STREAM (UNAVAILABLE) beyond it — measured: 300 calls at
    # once against 128 refused 126 of them — so the queue bound, not this, is what answers an overload.
    max_concurrent_streams: int = 1024
    max_metadata_bytes: int = 16 << 10
    keepalive_time_s: float = 60.0  # the server pings an idle connection this often...
    keepalive_timeout_s: float = 20.0  # ...and closes it when no answer comes within this
    min_ping_interval_s: float = 10.0  # client pings closer than this (without data) earn a strike
    max_ping_strikes: int = 2
    max_connection_age_s: float = 1800.0  # then GOAWAY: clients reconnect (and rebalance)
    max_connection_age_grace_s: float = 300.0  # streams still running on an aged connection get this long

    def channel_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        return [
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
        ]


def check_generate_limits(request: generation_pb2.GenerateRequest) -> list[FieldViolation]:
    """Size limits of a GenerateRequest, on the message as received (no tokenising, no decoding)."""
    out: list[FieldViolation] = []
    if len(request.contents) > MAX_CONTENTS:
        out.append(FieldViolation("contents", f"{len(request.contents)} turns; at most {MAX_CONTENTS}"))
    num_parts = sum(len(c.parts) for c in request.contents)
    if num_parts > MAX_PARTS:
        out.append(FieldViolation("contents", f"{num_parts} parts; at most {MAX_PARTS}"))
    text_bytes = sum(len(p.text.encode()) for c in request.contents for p in c.parts if p.WhichOneof("kind") == "text")
    if text_bytes > MAX_TEXT_BYTES:
        out.append(FieldViolation("contents", f"{text_bytes} bytes of text; at most {MAX_TEXT_BYTES}"))
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        out.append(FieldViolation("stop_token_ids", f"{len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"))
    for i, stop in enumerate(request.stop_sequences):
        if len(stop.encode()) > MAX_STOP_SEQUENCE_BYTES:
            out.append(FieldViolation(f"stop_sequences[{i}]", f"longer than {MAX_STOP_SEQUENCE_BYTES} bytes"))
    n_bias = len(request.sampling.logit_bias)
    if n_bias > MAX_LOGIT_BIAS_ENTRIES:
        out.append(FieldViolation("sampling.logit_bias", f"{n_bias} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"))
    return out
