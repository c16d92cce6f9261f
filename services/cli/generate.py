"""`omnivox generate` (one prompt) and `omnivox chat` (a conversation): stream tokens as they arrive."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from omnivox.services.cli._common import CliError, add_cache_salt_arg, add_connection_args, connect, rpc_error_line

if TYPE_CHECKING:
    from omnivox.v1 import generation_pb2, generation_pb2_grpc


def _add_request_args(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.add_argument("--model", default="", help="model name (default: the server's default)")
    p.add_argument("--system", help="a system instruction")
    p.add_argument("--max-tokens", type=int, help="stop after this many output tokens")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument(
        "--no-thinking", action="store_true", help="a reasoning model (Qwen3) answers without thinking first"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no summary line on stderr")
    add_cache_salt_arg(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser("generate", help="send one prompt and stream the answer")
    g.add_argument("prompt", help="the prompt; - reads it from stdin")
    _add_request_args(g)
    fmt = g.add_mutually_exclusive_group()  # structured output: the answer is constrained to one of these
    fmt.add_argument("--json-schema", metavar="FILE", help="answer with JSON valid under this JSON Schema file")
    fmt.add_argument("--regex", help="answer with text matching this regular expression")
    fmt.add_argument("--grammar", metavar="FILE", help="answer with text matching this Lark grammar file")
    fmt.add_argument("--choice", help="answer with exactly one of these comma-separated strings")
    g.set_defaults(run=run_generate)

    c = subparsers.add_parser("chat", help="a conversation: one user turn per line of input, answers streamed")
    c.add_argument("prompt", nargs="?", help="a first message (then reads more from stdin unless --once)")
    c.add_argument("--once", action="store_true", help="answer the first message and exit")
    _add_request_args(c)
    c.set_defaults(run=run_chat)


def build_request(args: argparse.Namespace, turns: list[tuple[str, str]]) -> generation_pb2.GenerateRequest:
    from omnivox.v1 import content_pb2, generation_pb2, sampling_pb2

    contents = []
    if args.system:
        contents.append(content_pb2.Content(role="system", parts=[content_pb2.Part(text=args.system)]))
    contents += [content_pb2.Content(role=role, parts=[content_pb2.Part(text=text)]) for role, text in turns]
    sampling = sampling_pb2.SamplingConfig()
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = generation_pb2.GenerateRequest(
        model=args.model, contents=contents, sampling=sampling, stop_sequences=args.stop, cache_salt=args.cache_salt
    )
    if args.max_tokens is not None:
        request.max_output_tokens = args.max_tokens
    if getattr(args, "no_thinking", False):
        request.enable_thinking = False
    _set_response_format(request, args)
    return request


def _set_response_format(request: generation_pb2.GenerateRequest, args: argparse.Namespace) -> None:
    """--json-schema / --grammar (files), --regex, --choice (generate only) as the request's response_format."""
    from omnivox.v1 import generation_pb2

    rf = request.response_format
    for flag, field in (("json_schema", "json_schema"), ("grammar", "lark_grammar")):
        path = getattr(args, flag, None)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    setattr(rf, field, f.read())
            except OSError as exc:
                raise CliError(f"--{flag.replace('_', '-')}: cannot read {path}: {exc.strerror}") from None
    if getattr(args, "regex", None) is not None:
        rf.regex = args.regex
    if getattr(args, "choice", None) is not None:
        rf.choices.CopyFrom(generation_pb2.Choices(values=[c for c in args.choice.split(",") if c]))


def stream_answer(
    stub: generation_pb2_grpc.GenerationServiceStub, request: generation_pb2.GenerateRequest, args: argparse.Namespace
) -> str:
    """Print deltas to stdout as they arrive, a reasoning model's thinking and the summary to stderr; return the
    answer's text."""
    import grpc

    from omnivox.services.cli.serve import summary_line

    pieces = []
    try:
        for response in stub.Generate(request, timeout=args.timeout):
            if response.HasField("delta"):
                if response.delta.reasoning_text and not args.quiet:  # stdout stays the answer (pipes, chat turns)
                    sys.stderr.write(response.delta.reasoning_text)
                    sys.stderr.flush()
                pieces.append(response.delta.text)
                sys.stdout.write(response.delta.text)
                sys.stdout.flush()
            elif not args.quiet:
                sys.stdout.write("\n")
                print(f"[{summary_line(response.summary)}]", file=sys.stderr)
    except grpc.RpcError as err:
        if pieces:
            sys.stdout.write("\n")
        raise CliError(rpc_error_line(err, args.server)) from None
    if args.quiet:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def run_generate(args: argparse.Namespace) -> int:
    from omnivox.v1 import generation_pb2_grpc

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with connect(args) as channel:
        stream_answer(generation_pb2_grpc.GenerationServiceStub(channel), build_request(args, [("user", prompt)]), args)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from omnivox.v1 import generation_pb2_grpc

    interactive = sys.stdin.isatty()
    turns: list[tuple[str, str]] = []
    with connect(args) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        pending = [args.prompt] if args.prompt else []
        while True:
            if pending:
                message = pending.pop()
            elif args.once and turns:
                return 0
            else:
                if interactive:
                    print("you> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line:
                    return 0
                message = line.rstrip("\n")
                if not message.strip():
                    continue
            turns.append(("user", message))
            answer = stream_answer(stub, build_request(args, turns), args)
            turns.append(("assistant", answer))
