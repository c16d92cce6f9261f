"""Who may call: API keys (`--api-keys FILE`), client certificates (`--tls-client-ca`), and per-caller quotas.

Every omnivox.v1 RPC (unary and streaming) must carry `authorization: Bearer KEY` when the server has keys; health
and reflection stay open, so probes and grpcurl's `list` need none. Keys are kept only as SHA-256 digests and
compared with `hmac.compare_digest` against every stored digest (no early exit: the time taken says nothing about
which key, or how much of one, matched). With mTLS the caller's identity is its certificate's common name, checked by
the TLS handshake itself (gRPC rejects a connection without a valid client certificate before any RPC).

Quotas per caller: concurrent calls and calls per minute (sliding 60 s window); an excess call gets
RESOURCE_EXHAUSTED with a RetryInfo saying when to come back.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from omnivox.services import errors
from omnivox.services.call_record import current_call
from omnivox.services.grpc_api.logs import OMNIVOX_PREFIX, Behavior, around_call, wrap_handler
from omnivox.services.grpc_api.rpc_errors import to_status

log = logging.getLogger(__name__)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_api_keys(path: Path) -> dict[bytes, str]:
    """Digest -> key id from a file of one key per line, or `id:key`; blank lines and `#` comments skipped.
    A key without an id is named by the first 8 hex digits of its digest (never by the key itself). UTF-8, with or
    without the byte order mark Windows editors write (with it kept, the first key never matched); ValueError for
    anything else, with a message that holds no key material."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (saved as UTF-16? write it as UTF-8)") from None
    keys: dict[bytes, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key_id, sep, key = line.partition(":")
        if not sep:
            key_id, key = "", line
        key = key.strip()
        if len(key) < 8:
            raise ValueError(f"{path}:{n}: an API key must be at least 8 characters")
        d = digest(key)
        keys[d] = key_id.strip() or d.hex()[:8]
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


class KeyFile:
    """The `--api-keys` file, re-read when it changes, so keys rotate without a restart: write the new file (or let
    Kubernetes update the mounted Secret, which it swaps in place) and calls see it within `RECHECK_S`. Checked on
    the call path, at most one stat() per `RECHECK_S`; a file that no longer parses (or is gone, mid-swap) is logged
    and the keys read before stay in force."""

    RECHECK_S = 1.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = self._stat()
        self.keys = load_api_keys(path)  # ValueError / OSError at start: the server does not start
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> tuple[int, ...]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def current(self) -> dict[bytes, str]:
        now = time.monotonic()
        if now - self._checked >= self.RECHECK_S and self._lock.acquire(blocking=False):
            try:
                self._checked = now
                self._reload_if_changed()
            finally:
                self._lock.release()
        return self.keys

    def _reload_if_changed(self) -> None:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._stamp = stamp  # taken before reading: a write after it is seen at the next check
            keys = load_api_keys(self.path)
        except (OSError, ValueError) as err:
            log.error("API keys not reloaded (%s); the %d keys read before stay in force", err, len(self.keys))
            return
        self.keys = keys
        log.info("API keys reloaded from %s: %d keys", self.path, len(keys))


@dataclass(frozen=True)
class Quota:
    max_concurrent: int = 0  # calls in flight per caller; 0 = no limit
    max_per_minute: int = 0  # calls started per caller in any 60 s; 0 = no limit


@dataclass
class _Usage:
    in_flight: int = 0
    started: collections.deque[float] = field(default_factory=collections.deque)


class QuotaBook:
    """Per-caller usage; thread-safe. `take` admits a call or raises RESOURCE_EXHAUSTED; `give_back` ends it."""

    WINDOW_S = 60.0

    def __init__(self, quota: Quota) -> None:
        self.quota = quota
        self._usage: dict[str, _Usage] = collections.defaultdict(_Usage)
        self._lock = threading.Lock()

    def take(self, caller: str, now: float | None = None) -> None:
        q = self.quota
        now = time.monotonic() if now is None else now
        with self._lock:
            u = self._usage[caller]
            while u.started and u.started[0] <= now - self.WINDOW_S:
                u.started.popleft()
            # Without keys or client certificates every call is the one anonymous caller: the quota is the server's
            who = (
                f"caller {caller!r}" if caller else "all callers together (no API key or certificate tells them apart)"
            )
            if q.max_concurrent and u.in_flight >= q.max_concurrent:
                raise errors.resource_exhausted(
                    f"{who}: {u.in_flight} calls in flight (the limit is {q.max_concurrent})", retry_after_s=1.0
                )
            if q.max_per_minute and len(u.started) >= q.max_per_minute:
                wait = max(u.started[0] + self.WINDOW_S - now, 0.001)
                raise errors.resource_exhausted(
                    f"{who}: {len(u.started)} calls started in the last minute (the limit is {q.max_per_minute})",
                    retry_after_s=wait,
                )
            u.in_flight += 1
            if q.max_per_minute:  # kept only when a rate is enforced (at most max_per_minute entries per caller)
                u.started.append(now)

    def give_back(self, caller: str) -> None:
        with self._lock:
            u = self._usage[caller]
            u.in_flight -= 1
            if not u.in_flight and not u.started:
                del self._usage[caller]


def bearer_token(metadata: Any) -> str | None:
    """The KEY of `authorization: Bearer KEY`; the scheme is case-insensitive (RFC 7235: clients send `bearer`)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _no_key_message(metadata: Any) -> str:
    if any(key == "authorization" for key, _ in metadata or ()):
        return "the authorization header is not 'Bearer KEY'"
    return "missing API key"


def certificate_name(context: Any) -> str | None:
    """The client certificate's common name (or its first SAN) from the TLS handshake; None without one."""
    auth = context.auth_context() or {}
    for prop in ("x509_common_name", "x509_subject_alternative_name"):
        values = auth.get(prop)
        if values:
            return values[0].decode(errors="replace")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """API keys and/or client certificates, then quotas, on every omnivox.v1 method."""

    def __init__(
        self, api_keys: dict[bytes, str] | KeyFile | None = None, mtls: bool = False, quota: Quota = Quota()
    ) -> None:
        self.api_keys = api_keys or {}  # a KeyFile is re-read when it changes
        self.mtls = mtls
        self.quotas = QuotaBook(quota)

    def caller_of_key(self, key: str | None) -> str | None:
        """The key's id, or None; every stored digest is compared (constant time in the number of keys)."""
        if key is None:
            return None
        d = digest(key)
        found = None
        keys = self.api_keys.current() if isinstance(self.api_keys, KeyFile) else self.api_keys
        for stored, key_id in keys.items():
            if hmac.compare_digest(stored, d):
                found = key_id
        return found

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if not (details.method or "").startswith(OMNIVOX_PREFIX):
            return handler  # health and reflection stay open
        key = bearer_token(details.invocation_metadata)

        def around(behavior: Behavior) -> Behavior:
            taken: list[str] = []

            async def before(context: Any) -> None:
                caller = ""
                if self.mtls:
                    caller = certificate_name(context) or ""
                    if not caller:
                        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a client certificate is required")
                if self.api_keys:
                    key_id = self.caller_of_key(key)
                    if key_id is None:
                        message = _no_key_message(details.invocation_metadata) if key is None else "invalid API key"
                        await context.abort(
                            grpc.StatusCode.UNAUTHENTICATED, f"{message}: send 'authorization: Bearer KEY'"
                        )
                    caller = key_id if not caller else f"{caller}/{key_id}"
                current_call().caller = caller
                try:
                    self.quotas.take(caller)
                except errors.ServiceError as err:
                    await context.abort_with_status(to_status(err))
                taken.append(caller)

            def after(context: Any, code: grpc.StatusCode) -> None:
                if taken:
                    self.quotas.give_back(taken.pop())

            return around_call(behavior, before, after)

        return wrap_handler(handler, around)
