"""`omnivox bench`: benchmark omnivox's gRPC server against its peers (see omnivox.benchmarks and BENCHMARKS.md)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from omnivox.benchmarks.main import add_arguments

    p = subparsers.add_parser(
        "bench",
        help="benchmark the server against transformers and llama.cpp",
        description="Benchmark omnivox's gRPC server against its peers on one model, in one run.",
    )
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from omnivox.benchmarks.main import run_and_report

    return run_and_report(args)
