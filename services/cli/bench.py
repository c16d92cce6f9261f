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
    p.add_argument(
        "--workload",
        choices=("text", "images"),
        default="text",
        help="images: image questions against a vision-language --model (default: a random Qwen2.5-VL shape), with "
        "TTFT, encoder time and the text ITL while images arrive (omnivox.benchmarks.images; other flags but --model, "
        "--server-arg and --out are the text workload's)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.workload == "images":
        from omnivox.benchmarks import images

        argv = ["--out", str(args.out / "images.json"), *(["--model", args.model] if args.model else [])]
        return images.main(argv + [f"--server-arg={a}" for a in args.server_arg])

    from omnivox.benchmarks.main import run_and_report

    return run_and_report(args)
