"""What client commands share: the error type, server connection flags, and turning RPC errors into one line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

DEFAULT_SERVER = "localhost:50051"


class CliError(Exception):
    """A failure the user can act on; printed as one line, no traceback."""


def open_output(path: str, binary: bool = False):
    """The -o file, opened for writing; one that cannot be (no such folder, no permission) is a one-line CliError,
    not a traceback."""
    try:
        return open(path, "wb") if binary else open(path, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as err:
        raise CliError(f"cannot write {path}: {err.strerror or err}") from None


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get("OMNIVOX_SERVER", DEFAULT_SERVER),
        help="host:port of the omnivox server (default: $OMNIVOX_SERVER or %(default)s)",
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--ca-cert", type=Path, help="PEM root certificate to trust (implies --tls)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OMNIVOX_API_KEY"),
        help="sent as `authorization: Bearer KEY` (default: $OMNIVOX_API_KEY)",
    )
    parser.add_argument("--client-cert", type=Path, help="PEM client certificate for mTLS (with --client-key)")
    parser.add_argument("--client-key", type=Path, help="PEM private key of --client-cert")
    parser.add_argument("--timeout", type=float, default=None, help="deadline for the call, in seconds")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for the server")


def add_cache_salt_arg(parser: argparse.ArgumentParser) -> None:
    """--cache-salt, for the commands whose requests take `cache_salt` (services/processing/cache_salt.py)."""
    parser.add_argument(
        "--cache-salt",
        default="",
        help="share cached work (prefix KV, encoded media, grammars) only with requests of the same caller and salt",
    )


def connect(args: argparse.Namespace) -> grpc.Channel:
    """A channel to args.server that is connected, or CliError saying the server cannot be reached."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    client_cert, client_key = getattr(args, "client_cert", None), getattr(args, "client_key", None)
    if args.tls or args.ca_cert or client_cert:
        root = args.ca_cert.read_bytes() if args.ca_cert else None
        chain = (client_key.read_bytes(), client_cert.read_bytes()) if client_cert and client_key else (None, None)
        credentials = grpc.ssl_channel_credentials(root, *chain)
        channel = grpc.secure_channel(args.server, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.server, options=options)
    try:
        grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise CliError(
            f"cannot reach an omnivox server at {args.server} (is `omnivox serve` running? see --server)"
        ) from None
    if getattr(args, "api_key", None):
        from omnivox.services.cli.bearer import BearerKey

        return grpc.intercept_channel(channel, BearerKey(args.api_key))
    return channel


def rpc_error_line(err: grpc.RpcError, server: str) -> str:
    """One line for a failed call, with every field violation the server named."""
    from omnivox.services.grpc_api.rpc_errors import status_details

    code = err.code()
    text = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and not text.startswith(("model", "the server")):
        return f"cannot reach an omnivox server at {server} ({text})"
    line = f"{code.name}: {text}" if text else code.name
    try:
        details = status_details(err)
    except ValueError:
        details = []
    for detail in details:
        if detail.DESCRIPTOR.name == "RetryInfo":
            line += f" (retry in {detail.retry_delay.ToTimedelta().total_seconds():g} s)"
    return line


def subtitle_clock(seconds: float, separator: str) -> str:
    """HH:MM:SS<separator>mmm, as SRT (',') and WebVTT ('.') cues write a time."""
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"
