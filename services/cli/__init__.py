"""The `omnivox` command. Each subcommand is a module in this package that defines `register(subparsers)`.

`register` adds its parser and sets `run=<function(args) -> int>` as a default; modules whose name starts with an
underscore are helpers, not commands. A new command (e.g. `speak`, `bench`) is one new module here, no other edit.
Command modules import heavy dependencies (torch, the engine) inside `run`, so that `omnivox --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Iterator
from types import ModuleType

from omnivox import __version__
from omnivox.services.cli._common import CliError

# Commands listed first in --help, in this order; any others follow alphabetically.
_PREFERRED_ORDER = ("serve", "chat", "generate", "ask", "transcribe", "speak", "models", "bench")


def command_modules() -> Iterator[ModuleType]:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    names.sort(key=lambda n: (_PREFERRED_ORDER.index(n) if n in _PREFERRED_ORDER else len(_PREFERRED_ORDER), n))
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "register"):
            yield module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnivox", description="Multimodal generation service: serve models over gRPC and talk to them."
    )
    parser.add_argument("--version", action="version", version=f"omnivox {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in command_modules():
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.run(args) or 0)
    except CliError as err:
        print(f"omnivox: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `omnivox ... | head`: the reader left; no traceback, and none at exit's flush either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it


if __name__ == "__main__":
    sys.exit(main())
