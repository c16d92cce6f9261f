"""`omnivox serve`: run the gRPC service (the embedded default model unless --model is given)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omnivox.services.cli._common import CliError
from omnivox.services.cli._node_flags import add_node_arguments, node_group, run_worker_node
from omnivox.services.cli._realtime_flags import add_realtime_arguments, realtime_limits
from omnivox.services.cli._serve_flags import add_serve_arguments, check_flag_values, model_specs

if TYPE_CHECKING:
    from omnivox.services.grpc_api.server import OmnivoxServer
    from omnivox.v1 import generation_pb2

DEMO_PROMPT = "In one sentence, what is a gRPC server?"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve models over gRPC. Without --model, serves the embedded default (fetched on first use).",
    )
    add_serve_arguments(p)
    add_node_arguments(p)
    add_realtime_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from omnivox.services.parts.loading import EngineOptions, ModelLoadError, check_model_path

    try:  # before importing the server (and torch): a wrong path fails in a blink
        for path in args.models:
            check_model_path(path)
    except ModelLoadError as err:
        raise CliError(str(err)) from None
    check_flag_values(args)
    check_tensor_parallel(args)
    nodes = node_group(args)  # LeaderWorkerSet's variables, or the flags
    if nodes is not None and nodes.node_rank > 0:  # a worker pod: its ranks only, no gRPC
        return run_worker_node(args, nodes)
    # Before the server's imports (transformers, grpc: seconds): a wrong --sampling-default or --quantization
    # fails in a blink, as a wrong path does.
    specs = model_specs(
        args.models, args.names, args.sampling_defaults, args.quantization, args.speculative, args.activation_bits
    )
    from omnivox.codecs.streaming import StreamingOptions
    from omnivox.services.grpc_api import server
    from omnivox.services.grpc_api.auth import Quota
    from omnivox.services.limits import GrpcLimits

    check_server_flags(args)
    import torch

    torch.set_num_threads(args.threads or max(1, ((os.cpu_count() or 2) - 1) // args.tensor_parallel))
    options = server.ServerOptions(
        host=args.host,
        port=args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_receive_message_bytes=args.max_message_mib << 20,
        max_queue=args.max_queue,
        grace_period_s=args.grace_period,
        stream_idle_timeout_s=args.stream_idle_timeout,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        http_port=args.http_port,
        api_keys=args.api_keys,
        tls_client_ca=args.tls_client_ca,
        quota=Quota(max_concurrent=args.max_streams_per_key, max_per_minute=args.max_rpm_per_key),
        trace_exporter=trace_exporter(args),
        limits=GrpcLimits(max_connection_age_s=args.max_connection_age),
        data_dir=args.data_dir,
        asr_model=None if args.asr_model == "none" else args.asr_model,
        audio_first_margin_s=args.audio_first_margin,
        realtime_limits=realtime_limits(args),
    )
    engine_options = EngineOptions(
        device=args.device,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_batched_tokens,
        max_step_tokens=args.max_step_tokens,
        max_step_ms=args.max_step_ms,
        image_cache_mib=args.image_cache_mib,
        whisper_short_window_s=args.whisper_short_window,
        whisper_short_window_int8=args.whisper_int8_short_window,
        max_request_megapixels=args.max_request_megapixels,
        quantize_lm_head=args.quantize_lm_head,
        num_speculative_tokens=args.num_speculative_tokens,
        tensor_parallel=args.tensor_parallel,
        node_group=nodes,
        progress=True,
        speech_streaming=None
        if args.speech_first_hop is None
        else StreamingOptions(first_hop_frames=args.speech_first_hop),
    )
    try:
        return asyncio.run(server.run(specs, options, engine_options, on_ready=demo if args.demo else None))
    except (ModelLoadError, OSError) as err:
        raise CliError(str(err)) from None


def check_server_flags(args: argparse.Namespace) -> None:
    """A one-line CliError for a flag value the server would take badly (before the server's imports)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key, args.api_keys, args.tls_client_ca):
        if path is not None and not path.is_file():
            raise CliError(f"no such file: {path}")
    for flag, port in (
        ("--port", args.port),
        ("--metrics-port", args.metrics_port),
        ("--health-port", args.health_port),
        ("--http-port", args.http_port),
    ):
        if port is not None and not 0 <= port <= 65535:  # gRPC bound --port 99999 as 34463, saying so only in a log
            raise CliError(f"{flag} must be in [0, 65535], got {port}")
    if args.max_message_mib < 1 or args.grace_period < 0 or args.stream_idle_timeout < 0:
        raise CliError("--max-message-mib must be at least 1, --grace-period and --stream-idle-timeout at least 0")
    if args.speech_first_hop is not None and args.speech_first_hop < 1:  # else only a speech model's load failed
        raise CliError("--speech-first-hop must be at least 1")
    if args.audio_first_margin < 0:
        raise CliError("--audio-first-margin must be at least 0")
    if args.max_queue < 1:
        raise CliError("--max-queue must be at least 1")
    if args.whisper_short_window is not None and not 4.0 <= args.whisper_short_window < 30.0:
        raise CliError("--whisper-short-window must be in [4, 30) seconds (it keeps a 3.5 s margin after the clip)")
    if args.max_batched_tokens is not None and args.max_batched_tokens < 1:
        raise CliError("--max-batched-tokens must be at least 1")
    if (args.max_step_tokens is not None and args.max_step_tokens < 1) or (
        args.max_step_ms is not None and args.max_step_ms <= 0
    ):
        raise CliError("--max-step-tokens must be at least 1 and --max-step-ms positive")
    if args.num_speculative_tokens < 1:
        raise CliError("--num-speculative-tokens must be at least 1")
    if args.max_connection_age <= 0:
        raise CliError("--max-connection-age must be positive")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1")


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """--tensor-parallel N: one model, N dividing its head counts, N devices: a one-line error otherwise."""
    n = args.tensor_parallel
    if n < 1:
        raise CliError("--tensor-parallel must be at least 1")
    if n == 1:
        return
    if len(args.models) != 1:
        raise CliError("--tensor-parallel serves exactly one --model (one process group per server)")
    import torch

    from omnivox.models.tensor_parallel import check_world  # not the engine package: a refusal in a blink

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        check_world(args.models[0].expanduser(), n, device, args.max_model_len)
    except ValueError as err:
        raise CliError(str(err)) from None


def trace_exporter(args: argparse.Namespace):
    if not (args.trace_console or args.otlp_endpoint):
        return None
    from omnivox.services.grpc_api.tracing import exporter_for

    try:
        return exporter_for(args.trace_console, args.otlp_endpoint)
    except (ImportError, ValueError) as err:
        raise CliError(f"tracing: {err} (pip install 'omnivox[tracing]')") from None


def demo_metadata(api_keys: Path | None) -> tuple[tuple[str, str], ...]:
    """The demo request's key: the first in --api-keys (the server asks its own callers for one too)."""
    for line in api_keys.read_text(encoding="utf-8-sig").splitlines() if api_keys else ():
        if line.strip() and not line.strip().startswith("#"):
            key_id, sep, key = line.strip().partition(":")
            return (("authorization", f"Bearer {(key if sep else key_id).strip()}"),)
    return ()


async def demo(srv: OmnivoxServer) -> None:
    """Send one chat request through the real gRPC API to this server and print the answer as it streams."""
    import grpc

    from omnivox.services.cli._common import rpc_error_line
    from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

    out = sys.stdout
    if srv.options.tls_cert is not None:
        creds = grpc.ssl_channel_credentials(srv.options.tls_cert.read_bytes())
        channel = grpc.aio.secure_channel(srv.address, creds)
    else:
        channel = grpc.aio.insecure_channel(srv.address)
    request = generation_pb2.GenerateRequest(
        contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text=DEMO_PROMPT)])],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=64,
    )
    print(f"\n--- demo: GenerationService/Generate on {srv.address} ---", file=out)
    print(f"user> {DEMO_PROMPT}", file=out)
    print("assistant> ", end="", file=out, flush=True)
    async with channel:
        try:
            calls = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=300, metadata=demo_metadata(srv.options.api_keys)
            )
            async for response in calls:
                if response.HasField("delta"):
                    print(response.delta.text, end="", file=out, flush=True)
                else:
                    s = response.summary
                    print(f"\n[{summary_line(s)}]", file=out)
        except grpc.aio.AioRpcError as err:
            print(f"\ndemo request failed: {rpc_error_line(err, srv.address)}", file=out)
            return
    print(
        f"--- still serving on {srv.address}: try `omnivox chat --server {srv.address}`, or\n"
        f'    grpcurl -plaintext -d \'{{"contents":[{{"parts":[{{"text":"Hi!"}}]}}]}}\' '
        f"{srv.address} omnivox.v1.GenerationService/Generate\n"
        "    Ctrl-C stops. ---",
        file=out,
        flush=True,
    )


def summary_line(summary: generation_pb2.GenerateSummary) -> str:
    """finish reason, token counts, time to first token and decode speed, for people."""
    from omnivox.v1 import generation_pb2

    reason = generation_pb2.FinishReason.Name(summary.finish_reason).removeprefix("FINISH_REASON_").lower()
    usage, timing = summary.usage, summary.timing
    ttft = timing.time_to_first_token.ToNanoseconds() / 1e9
    total = timing.total.ToNanoseconds() / 1e9
    decode_s = total - ttft
    speed = (usage.output_tokens - 1) / decode_s if usage.output_tokens > 1 and decode_s > 0 else 0.0
    return (
        f"{reason} · {usage.prompt_tokens} prompt + {usage.output_tokens} output tokens"
        f" ({usage.cached_prompt_tokens} cached) · first token {ttft * 1000:.0f} ms · {speed:.1f} tokens/s"
    )
