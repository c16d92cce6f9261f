"""`omnivox serve`'s flags: their definitions, and the values of those that name models, turned into ModelSpecs."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from omnivox.services.cli._common import CliError
from omnivox.services.cli._engine_flags import add_engine_arguments

if TYPE_CHECKING:
    from omnivox.services.parts.loading import ModelSpec


class _NameAction(argparse.Action):
    """--name, appended as `append` does, also noting how many --model came before it (args.models_before_names)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        before = list(getattr(namespace, "models_before_names", None) or [])
        namespace.models_before_names = [*before, len(getattr(namespace, "models", None) or [])]


def check_name_order(args: argparse.Namespace) -> None:
    """Names pair with --model in order, so with fewer names than models, `--model A --model B --name b` named A
    'b' and left B under its folder name: requests for 'b' silently went to the other model. Refused instead when a
    --name comes after a later --model than the one it names (given before it or right after it: as meant)."""
    after = getattr(args, "models_before_names", None) or []
    if len(args.names) >= len(args.models):
        return
    for i, (name, before) in enumerate(zip(args.names, after, strict=True)):
        if before > i + 1:
            raise CliError(
                f"--name {name!r} follows --model #{before} but names --model #{i + 1} ({args.models[i]}): names "
                "pair with --model in order; put each --name right after its --model, or give one for every --model"
            )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every `omnivox serve` flag (checked in serve.run and model_specs)."""
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
        action=_NameAction,
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
        default="auto",
        help="a served Whisper model (e.g. whisper-base) that transcribes the audio parts of Generate requests to "
        "text-only models first: a cascade (audio-LLMs read audio themselves). Default auto: the first served Whisper "
        "model when other models are served beside it (the embedded defaults answer spoken questions); none: off",
    )
    _add_server_arguments(p)  # --host ... --otlp-endpoint: listening, limits, health, metrics, auth, tracing
    add_engine_arguments(p)  # --kv-cache-gib ... --dtype (services/cli/_engine_flags.py)
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
        "--audio-first-margin",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="while a speech stream's client would run dry within this many seconds (or its first audio is due), "
        "the other models' engines wait before their steps, at most 0.1 s each (0 = off)",
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


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Where and how the server listens, its limits, health and metrics ports, auth and tracing."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (0 = any free port)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain; with --tls-key, serve TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--max-queue", type=int, default=256, help="requests admitted at once per model, waiting + running")
    p.add_argument("--max-message-mib", type=int, default=64, help="largest request accepted (images, audio)")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight streams get after SIGTERM")
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=30.0,
        help="seconds a StreamingTranscribe / StreamingSynthesizeSpeech call may receive nothing while none of its "
        "work is left before it ends OUT_OF_RANGE, freeing its --max-queue slot (0: never)",
    )
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=1800.0,
        help="seconds before a client connection is closed gracefully (GOAWAY), so clients rebalance onto new replicas",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.add_argument(
        "--health-port",
        type=int,
        help="also serve grpc.health.v1 alone, in plaintext, on this port: for probes that cannot speak TLS or "
        "mTLS (Kubernetes' gRPC probes, Docker's HEALTHCHECK) when --tls-cert is set",
    )
    p.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/audio/speech, "
        "/v1/audio/voices, /v1/models, "
        "/health) on this port, with the same models, keys and limits (off without)",
    )
    p.add_argument("--api-keys", type=Path, help="file of API keys (one per line, or id:key); RPCs then need one")
    p.add_argument("--tls-client-ca", type=Path, help="PEM CA: require client certificates it signed (mTLS)")
    p.add_argument("--max-streams-per-key", type=int, default=0, help="concurrent calls per caller (0: no limit)")
    p.add_argument("--max-rpm-per-key", type=int, default=0, help="calls per minute per caller (0: no limit)")
    p.add_argument("--trace-console", action="store_true", help="OpenTelemetry spans to stdout (omnivox[tracing])")
    p.add_argument("--otlp-endpoint", help="OpenTelemetry spans to this OTLP/gRPC collector (tracing is off without)")


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
ACTIVATION_BITS = ("8", "16")


def engine_overrides(
    served: list[str], quantization: list[str], speculative: list[str], activation_bits: list[str] = ()
) -> list[tuple[dict[str, str | int], frozenset[str]]]:
    """Per served model, the EngineOptions fields `--quantization` / `--speculative` / `--activation-bits`
    ([NAME=]VALUE) set for it, and those of them an unnamed flag set while several models are served (lenient:
    loading drops them with a warning where the model cannot take them, as int8 weights for float-only Whisper; a
    NAME= flag, or any flag with one model served, is strict). The later flag wins."""
    out: list[dict[str, str | int]] = [{} for _ in served]
    lenient: list[set[str]] = [set() for _ in served]
    for flag, field, values in (
        ("--quantization", "quantization", quantization),
        ("--speculative", "speculative", speculative),
        ("--activation-bits", "activation_bits", activation_bits),
    ):
        for text in values:
            name, sep, value = text.rpartition("=") if "=" in text else ("", "", text)
            if field == "quantization" and value not in QUANTIZATION_MODES:
                raise CliError(f"{flag} {text!r}: the mode must be one of {', '.join(QUANTIZATION_MODES)}")
            if field == "speculative" and value != "ngram" and not (value.startswith("draft:") and len(value) > 6):
                raise CliError(f"{flag} {text!r}: expected ngram or draft:PATH")
            if field == "activation_bits" and value.strip() not in ACTIVATION_BITS:
                raise CliError(f"{flag} {text!r}: the bits must be 8 or 16")
            if name and name not in served:
                raise CliError(f"{flag} {text!r}: no model is served as {name!r} (served: {', '.join(served)})")
            for i, model in enumerate(served):
                if not name or name == model:
                    out[i][field] = int(value) if field == "activation_bits" else value
                    (lenient[i].add if not name and len(served) > 1 else lenient[i].discard)(field)
    for model, fields, loose in zip(served, out, lenient, strict=True):
        bits_named_or_both_unnamed = "activation_bits" not in loose or "quantization" in loose
        if fields.get("activation_bits") == 8 and fields.get("quantization") == "none" and bits_named_or_both_unnamed:
            raise CliError(f"--activation-bits 8 needs quantised weights; {model!r} is served with --quantization none")
    return [(fields, frozenset(loose)) for fields, loose in zip(out, lenient, strict=True)]


def model_specs(
    models: list[Path],
    names: list[str],
    sampling_defaults: list[str] = (),
    quantization: list[str] = (),
    speculative: list[str] = (),
    activation_bits: list[str] = (),
) -> list[ModelSpec]:
    """One ModelSpec per --model (the embedded defaults without any), each with its --sampling-default overrides."""
    from omnivox.services.parts.defaults import (
        DEFAULT_ASR_MODEL_NAME,
        DEFAULT_MODEL_NAME,
        DEFAULT_SPEECH_MODEL_NAME,
        DEFAULT_VOICE_MODEL_NAME,
    )
    from omnivox.services.parts.loading import ModelSpec, model_name_for
    from omnivox.services.parts.vision_defaults import DEFAULT_IMAGE_MODEL_NAME

    if len(names) > max(len(models), 1):
        raise CliError(f"{len(names)} --name given for {len(models)} --model")
    if not models:  # the embedded defaults: the text model, the hibari voice (the first speech model: the default
        # speech model), the random Orpheus-layout model, whisper-base, the image model
        specs = [ModelSpec(path=None, name=names[0] if names else None), ModelSpec(path=None, voice=True)]
        specs += [ModelSpec(path=None, speech=True), ModelSpec(path=None, asr=True), ModelSpec(path=None, image=True)]
        served = [specs[0].name or DEFAULT_MODEL_NAME, DEFAULT_VOICE_MODEL_NAME, DEFAULT_SPEECH_MODEL_NAME]
        served += [DEFAULT_ASR_MODEL_NAME, DEFAULT_IMAGE_MODEL_NAME]
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
    engine = engine_overrides(served, list(quantization), list(speculative), list(activation_bits))
    return [
        ModelSpec(
            s.path,
            s.name,
            s.speech,
            s.asr,
            s.voice,
            s.image,
            sampling_overrides=o,
            engine_overrides=e,
            lenient_fields=loose,
        )  # fmt: skip
        for s, o, (e, loose) in zip(specs, overrides, engine, strict=True)
    ]


MAX_MESSAGE_MIB = 2047  # gRPC takes the message limit as a C int (bytes): 2048 MiB overflows it
MAX_SECONDS_AS_MS = 2**31 // 1000 - 1  # gRPC channel options in ms are C ints too: ~24.8 days


def check_flag_values(args: argparse.Namespace) -> None:
    """One-line CliError naming the flag for a value out of its range, before anything is loaded or bound: NaN and
    infinities too (float flags take 'nan' and 'inf'; they failed later as a traceback or a message without the flag,
    or were taken: --grace-period nan meant no grace at all), and negative quotas (-1 refused every call)."""
    import math

    def finite(flag: str, value: float | None, low: float, high: float = math.inf, open_low: bool = False) -> None:
        if value is None:
            return
        bad = not math.isfinite(value) or value < low or (open_low and value == low) or value > high
        if bad:
            bound = f"greater than {low:.12g}" if open_low else f"at least {low:.12g}"
            if high != math.inf:
                bound += f" and at most {high:.12g}"
            raise CliError(f"{flag} must be a number {bound}, got {value:g}")

    finite("--kv-cache-gib", args.kv_cache_gib, 0.0, open_low=True)
    finite("--grace-period", args.grace_period, 0.0)
    finite("--stream-idle-timeout", args.stream_idle_timeout, 0.0, MAX_SECONDS_AS_MS)
    finite("--max-connection-age", args.max_connection_age, 0.0, MAX_SECONDS_AS_MS, open_low=True)
    finite("--max-message-mib", args.max_message_mib, 1, MAX_MESSAGE_MIB)
    finite("--image-cache-mib", args.image_cache_mib, 1)  # 0 refused every image as larger than the cache
    finite("--max-request-megapixels", args.max_request_megapixels, 0.0, open_low=True)
    finite("--max-streams-per-key", args.max_streams_per_key, 0)
    finite("--max-rpm-per-key", args.max_rpm_per_key, 0)
    finite("--max-model-len", args.max_model_len, 1)
    for flag, port in (
        ("--metrics-port", args.metrics_port),
        ("--health-port", args.health_port),
        ("--http-port", args.http_port),
    ):
        if port and port == args.port:
            raise CliError(f"{flag} and --port are both {args.port}: it needs a port of its own")
    if args.http_port and args.http_port in (args.metrics_port, args.health_port):
        raise CliError(f"--http-port {args.http_port} is also --metrics-port or --health-port: each needs its own")
    if args.health_port and args.health_port == args.metrics_port:
        raise CliError(f"--health-port and --metrics-port are both {args.health_port}: each needs a port of its own")
    check_name_order(args)
    for name in args.names:
        if not name.strip() or name != name.strip():
            raise CliError(f"--name {name!r}: a model name is not empty and has no surrounding spaces")
    if args.data_dir is not None and args.data_dir.exists() and not args.data_dir.is_dir():
        raise CliError(f"--data-dir {args.data_dir} is not a folder")
    if args.device is not None:
        check_device(args.device)
    check_tls_files(args)
    if args.api_keys is not None and args.api_keys.is_file():  # a missing file is named by serve.run
        from omnivox.services.grpc_api.auth import load_api_keys

        try:  # else the server's start raised it: a traceback
            load_api_keys(args.api_keys)
        except ValueError as err:
            raise CliError(f"--api-keys: {err}") from None


def check_device(text: str) -> None:
    """--device: a torch device string whose device exists here (a one-line error, not torch's long one at load)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise CliError(f"--device {text!r} is not a device: cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if not count:
            raise CliError(f"--device {text}: no CUDA device is available here")
        if device.index is not None and device.index >= count:
            raise CliError(f"--device {text}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})")


def check_tls_files(args: argparse.Namespace) -> None:
    """--tls-cert / --tls-key / --tls-client-ca: PEM files that load, and a key that matches its certificate (gRPC
    said only 'cannot listen on HOST:PORT: Failed to bind' for any of these). Missing files are serve.run's to name."""
    cert, key, client_ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None or key is None or not (cert.is_file() and key.is_file()):
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as err:
        why = _ssl_reason(err, "no PEM certificate or key could be read")
        raise CliError(f"--tls-cert {cert} / --tls-key {key}: {why}") from None
    if client_ca is not None and client_ca.is_file():
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as err:
            why = _ssl_reason(err, "no PEM certificate could be read")
            raise CliError(f"--tls-client-ca {client_ca}: {why}") from None


def _ssl_reason(err: ssl.SSLError, default: str) -> str:
    if err.reason == "KEY_VALUES_MISMATCH":
        return "the key is not the certificate's"
    return err.reason.lower().replace("_", " ") if err.reason else default
