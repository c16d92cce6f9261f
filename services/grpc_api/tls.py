"""Server TLS credentials that follow their files: certificates rotate without a restart.

cert-manager and similar renew a certificate weeks before it expires and write it over the mounted Secret; a server
that read its files once serves the old one until it expires and every handshake fails. gRPC asks
`certificate_configuration_fetcher` before each new connection's handshake; it answers a new configuration when the
certificate, key or client CA file changed (at most one stat() each per `RECHECK_S`), else None (keep the current
one). Connections already open keep the certificate they were made with. A pair read mid-rotation (the new key with
the old certificate) is replaced at the next check after the other file lands, so the files need no atomic swap.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class CertificateFiles:
    """The server's certificate chain, private key and (mTLS) client CA, re-read when one of them changes."""

    RECHECK_S = 1.0

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self.paths = [p for p in (cert, key, client_ca) if p is not None]
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._stamp = self._stat()
        self.initial = self._configuration()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev))
        return tuple(out)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        pair = [(self.key.read_bytes(), self.cert.read_bytes())]
        root = self.client_ca.read_bytes() if self.client_ca is not None else None
        return grpc.ssl_server_certificate_configuration(pair, root_certificates=root)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when a file changed since the last one, else None."""
        now = time.monotonic()
        if now - self._checked < self.RECHECK_S or not self._lock.acquire(blocking=False):
            return None
        try:
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            self._stamp = stamp  # taken before reading: a write after it is seen at the next check
            config = self._configuration()
        except OSError as err:  # a file gone mid-swap: keep serving the certificate before
            log.error("TLS certificate not reloaded (%s); serving the one before", err)
            return None
        finally:
            self._lock.release()
        log.info("TLS certificate files changed: new connections get the new certificate")
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.client_ca is not None
        )
