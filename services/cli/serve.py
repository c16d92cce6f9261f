"""`omnivox serve`: run the gRPC service (the embedded default model unless --model is given)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omnivox.services.cli._common import CliError

if TYPE_CHECKING:
    from omnivox.services.loading import ModelSpec
    from omnivox.services.server import OmnivoxServer
    from omnivox.v1 import generation_pb2

DEMO_PROMPT = "In one sentence, what is a gRPC server?"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve models over gRPC. Without --model, serves the embedded default (fetched on first use).",
    )
    p.add_argument(
        "--model",
        dest="models",
        metavar="PATH",
        type=Path,
        action="append",
        default=[],
        help="a Hugging Face checkpoint folder or a .gguf file; repeat to serve several (the first is the default)",
    )
    p.add_argument(
        "--name",
        dest="names",
        metavar="NAME",
        action="append",
        default=[],
        help="the name requests use for the matching --model (in order); default: the folder or file name",
    )
    p.add_argument(
        "--sampling-default",
        dest="sampling_defaults",
        metavar="[NAME:]KEY=VALUE",
        action="append",
        default=[],
        help="replace a model's own sampling default (its generation_config.json); repeatable. KEY is one of "
        f"{', '.join(SAMPLING_DEFAULT_KEYS)}. With NAME: for the model served under that name; without: for the "
        "default model (the first --model, or the embedded default). Requests that set the field still win",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        help="where created voices are kept (default: $OMNIVOX_DATA_DIR or ~/.local/share/omnivox)",
    )
    p.add_argument(
        "--asr-model",
        metavar="NAME",
        help="a served Whisper model (e.g. whisper-base) that transcribes the audio parts of Generate requests to "
        "text-only models first: a cascade (audio-LLMs read audio themselves)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (0 = any free port)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain; with --tls-key, serve TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--max-queue", type=int, default=256, help="requests admitted at once per model, waiting + running")
    p.add_argument("--max-message-mib", type=int, default=64, help="largest request accepted (images, audio)")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight streams get after SIGTERM")
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=1800.0,
        help="seconds before a client connection is closed gracefully (GOAWAY), so clients rebalance onto new replicas",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.add_argument("--api-keys", type=Path, help="file of API keys (one per line, or id:key); RPCs then need one")
    p.add_argument("--tls-client-ca", type=Path, help="PEM CA: require client certificates it signed (mTLS)")
    p.add_argument("--max-streams-per-key", type=int, default=0, help="concurrent calls per caller (0: no limit)")
    p.add_argument("--max-rpm-per-key", type=int, default=0, help="calls per minute per caller (0: no limit)")
    p.add_argument("--trace-console", action="store_true", help="OpenTelemetry spans to stdout (omnivox[tracing])")
    p.add_argument("--otlp-endpoint", help="OpenTelemetry spans to this OTLP/gRPC collector (tracing is off without)")
    p.add_argument("--kv-cache-gib", type=float, help="KV cache size per model (default: the engine decides)")
    p.add_argument("--max-model-len", type=int, help="cap the context length")
    p.add_argument(
        "--image-cache-mib",
        type=int,
        default=256,
        help="encoded images each vision model keeps for reuse; a single image whose features exceed it is refused",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        help="tokens one engine step may compute (decodes + prefill chunks): lower bounds inter-token latency, "
        "higher gives faster time to first token (default: 128 on CPU, 2048 on CUDA)",
    )
    p.add_argument(
        "--quantization",
        metavar="[NAME=]MODE",
        action="append",
        default=[],
        help="weights: auto (default: what the checkpoint carries: a GGUF at its own bit widths on CPU, several "
        "times faster batch-1 steps at float quality; float elsewhere), none (float), int8 or int4 (linear layers "
        "quantised at load); with NAME= for one model, else for every model",
    )
    p.add_argument(
        "--quantize-lm-head", action="store_true", default=None, help="also quantise the output projection (int8)"
    )
    p.add_argument(
        "--speculative",
        metavar="[NAME=]KIND",
        action="append",
        default=[],
        help="speculative decoding: ngram (prompt lookup) or draft:PATH (a small checkpoint with the same "
        "tokenizer); with NAME= for one model, else for every model",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed per step (default 4)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when present)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights and activations dtype")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for model compute (default: all cores but one, which serves gRPC; measured: on 2 busy "
        "cores, 2 compute threads stall each other and the server for up to 10x slower steps); with "
        "--tensor-parallel, per rank (default: those cores shared out between the ranks)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model's decoder over N processes (attention heads, KV heads and MLP per rank; NCCL on CUDA, "
        "one GPU per rank; gloo on the CPU); N must divide the head counts. Encoders and the codec stay on rank 0",
    )
    p.add_argument(
        "--speech-first-hop",
        type=int,
        metavar="FRAMES",
        help="speech: frames in a stream's first audio chunk, hops doubling from it (default: first chunk and hop "
        "growth sized from the measured engine and codec rates, so playback started on the first chunk does not run "
        "dry; 1 = the earliest first audio)",
    )
    p.add_argument("--demo", action="store_true", help="once loaded, send one chat request to itself and print it")
    p.set_defaults(run=run)


# SamplingParams fields `--sampling-default` may set (a default seed would make every unseeded request the same).
SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def parse_sampling_default(text: str) -> tuple[str | None, str, float | int]:
    """`[NAME:]KEY=VALUE` -> (NAME or None, KEY, VALUE), the value checked with the engine's own table."""
    from omnivox.engine import SamplingParams

    target, sep, assignment = text.rpartition(":")
    key, eq, raw = assignment.partition("=")
    key = key.strip()
    if not eq or key not in SAMPLING_DEFAULT_KEYS:
        raise CliError(
            f"--sampling-default {text!r}: expected [NAME:]KEY=VALUE with KEY one of {', '.join(SAMPLING_DEFAULT_KEYS)}"
        )
    try:
        value: float | int = int(raw) if key == "top_k" else float(raw)
    except ValueError:
        raise CliError(f"--sampling-default {text!r}: {raw!r} is not a number") from None
    for problem in SamplingParams(**{key: value}).violations(vocab_size=1):  # type: ignore[arg-type]
        raise CliError(f"--sampling-default {text!r}: {problem.field} {problem.description}")
    return (target.strip() or None) if sep else None, key, value


QUANTIZATION_MODES = ("auto", "none", "int8", "int4")


def engine_overrides(served: list[str], quantization: list[str], speculative: list[str]) -> list[dict[str, str]]:
    """Per served model, the EngineOptions fields `--quantization` / `--speculative` ([NAME=]VALUE) set for it."""
    out: list[dict[str, str]] = [{} for _ in served]
    for flag, field, values in (
        ("--quantization", "quantization", quantization),
        ("--speculative", "speculative", speculative),
    ):
        for text in values:
            name, sep, value = text.rpartition("=") if "=" in text else ("", "", text)
            if field == "quantization" and value not in QUANTIZATION_MODES:
                raise CliError(f"{flag} {text!r}: the mode must be one of {', '.join(QUANTIZATION_MODES)}")
            if field == "speculative" and value != "ngram" and not (value.startswith("draft:") and len(value) > 6):
                raise CliError(f"{flag} {text!r}: expected ngram or draft:PATH")
            if name and name not in served:
                raise CliError(f"{flag} {text!r}: no model is served as {name!r} (served: {', '.join(served)})")
            for i, model in enumerate(served):
                if not name or name == model:
                    out[i][field] = value
    return out


def model_specs(
    models: list[Path],
    names: list[str],
    sampling_defaults: list[str] = (),
    quantization: list[str] = (),
    speculative: list[str] = (),
) -> list[ModelSpec]:
    """One ModelSpec per --model (the embedded defaults without any), each with its --sampling-default overrides."""
    from omnivox.services.defaults import DEFAULT_ASR_MODEL_NAME, DEFAULT_MODEL_NAME, DEFAULT_SPEECH_MODEL_NAME
    from omnivox.services.loading import ModelSpec, model_name_for

    if len(names) > max(len(models), 1):
        raise CliError(f"{len(names)} --name given for {len(models)} --model")
    if not models:  # the embedded defaults: the text model, the random speech model, whisper-base
        specs = [ModelSpec(path=None, name=names[0] if names else None), ModelSpec(path=None, speech=True)]
        specs.append(ModelSpec(path=None, asr=True))
        served = [specs[0].name or DEFAULT_MODEL_NAME, DEFAULT_SPEECH_MODEL_NAME, DEFAULT_ASR_MODEL_NAME]
    else:
        specs = [ModelSpec(path=path, name=names[i] if i < len(names) else None) for i, path in enumerate(models)]
        served = [spec.name or model_name_for(path.expanduser()) for spec, path in zip(specs, models, strict=True)]
    overrides: list[dict[str, float | int]] = [{} for _ in specs]
    for text in sampling_defaults:
        target, key, value = parse_sampling_default(text)
        if target is not None and target not in served:
            raise CliError(
                f"--sampling-default {text!r}: no model is served as {target!r} (served: {', '.join(served)})"
            )
        overrides[served.index(target) if target is not None else 0][key] = value
    engine = engine_overrides(served, list(quantization), list(speculative))
    return [
        ModelSpec(path=s.path, name=s.name, speech=s.speech, asr=s.asr, sampling_overrides=o, engine_overrides=e)
        for s, o, e in zip(specs, overrides, engine, strict=True)
    ]


def run(args: argparse.Namespace) -> int:
    from omnivox.services.loading import EngineOptions, ModelLoadError, check_model_path

    try:  # before importing the server (and torch): a wrong path fails in a blink
        for path in args.models:
            check_model_path(path)
    except ModelLoadError as err:
        raise CliError(str(err)) from None
    check_tensor_parallel(args)
    from omnivox.codecs.streaming import StreamingOptions
    from omnivox.services import server
    from omnivox.services.auth import Quota
    from omnivox.services.limits import GrpcLimits

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key, args.api_keys, args.tls_client_ca):
        if path is not None and not path.is_file():
            raise CliError(f"no such file: {path}")
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 <= port <= 65535:  # gRPC bound --port 99999 as 34463, saying so only in a log
            raise CliError(f"{flag} must be in [0, 65535], got {port}")
    if args.max_message_mib < 1 or args.grace_period < 0:
        raise CliError("--max-message-mib must be at least 1 and --grace-period at least 0")
    if args.speech_first_hop is not None and args.speech_first_hop < 1:  # else only a speech model's load failed
        raise CliError("--speech-first-hop must be at least 1")
    if args.max_queue < 1:
        raise CliError("--max-queue must be at least 1")
    if args.max_batched_tokens is not None and args.max_batched_tokens < 1:
        raise CliError("--max-batched-tokens must be at least 1")
    if args.num_speculative_tokens < 1:
        raise CliError("--num-speculative-tokens must be at least 1")
    if args.max_connection_age <= 0:
        raise CliError("--max-connection-age must be positive")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1")
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
        metrics_port=args.metrics_port,
        api_keys=args.api_keys,
        tls_client_ca=args.tls_client_ca,
        quota=Quota(max_concurrent=args.max_streams_per_key, max_per_minute=args.max_rpm_per_key),
        trace_exporter=trace_exporter(args),
        limits=GrpcLimits(max_connection_age_s=args.max_connection_age),
        data_dir=args.data_dir,
        asr_model=args.asr_model,
    )
    engine_options = EngineOptions(
        device=args.device,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_batched_tokens,
        image_cache_mib=args.image_cache_mib,
        quantize_lm_head=args.quantize_lm_head,
        num_speculative_tokens=args.num_speculative_tokens,
        tensor_parallel=args.tensor_parallel,
        progress=True,
        speech_streaming=None
        if args.speech_first_hop is None
        else StreamingOptions(first_hop_frames=args.speech_first_hop),
    )
    try:
        specs = model_specs(args.models, args.names, args.sampling_defaults, args.quantization, args.speculative)
        return asyncio.run(server.run(specs, options, engine_options, on_ready=demo if args.demo else None))
    except (ModelLoadError, OSError) as err:
        raise CliError(str(err)) from None


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
    from omnivox.services.tracing import exporter_for

    try:
        return exporter_for(args.trace_console, args.otlp_endpoint)
    except (ImportError, ValueError) as err:
        raise CliError(f"tracing: {err} (pip install 'omnivox[tracing]')") from None


def demo_metadata(api_keys: Path | None) -> tuple[tuple[str, str], ...]:
    """The demo request's key: the first in --api-keys (the server asks its own callers for one too)."""
    for line in api_keys.read_text().splitlines() if api_keys else ():
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
