"""`omnivox transcribe speech.wav`: the transcript on stdout as it is produced; `--format srt|vtt|json` for timed
output (the segments' offsets, written once the summary arrives)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnivox.services.cli._common import (
    CliError,
    add_cache_salt_arg,
    add_connection_args,
    connect,
    open_output,
    rpc_error_line,
    subtitle_clock,
)

FORMATS = ("text", "srt", "vtt", "json")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transcribe", help="speech to text (TranscriptionService)")
    p.add_argument(
        "audio", type=Path, help="an audio file (WAV, FLAC, Ogg, MP3; .raw/.pcm with --sample-rate); - = stdin"
    )
    p.add_argument("--language", default="", help="BCP-47 code of the speech, e.g. en (default: detect)")
    p.add_argument("--prompt", default="", help="context: names, terms, the topic")
    p.add_argument(
        "--task", choices=("transcribe", "translate"), default="transcribe", help="translate: into English (Whisper)"
    )
    p.add_argument(
        "--temperature", type=float, default=None,
        help="Whisper: decode at this temperature only (0: greedy; default: greedy with the fallback)",
    )  # fmt: skip
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    p.add_argument("-o", "--output", default="-", help="output file, or - for stdout (default: -)")
    p.add_argument("--model", default="", help="model (default: the first served model that takes audio)")
    p.add_argument("--sample-rate", type=int, default=0, help="sample rate of headerless audio (.raw/.pcm/.ulaw)")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary line on stderr")
    p.add_argument(
        "--stream", action="store_true", help="live: StreamingTranscribe, a line per utterance (Whisper models)"
    )
    p.add_argument("--interim", action="store_true", help="--stream: show interim text on stderr (a terminal)")
    p.add_argument("--pace", type=float, default=1.0, help="--stream of a file: times real time (0: flat out)")
    add_cache_salt_arg(p)
    add_connection_args(p)
    p.set_defaults(run=run)


def _segments(summary) -> list[tuple[float, float, str]]:
    return [
        (s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9, s.text) for s in summary.segments
    ]


def render(summary, fmt: str) -> str:
    """The summary as SRT, WebVTT or JSON."""
    segments = _segments(summary)
    if fmt == "json":
        return json.dumps({
            "text": summary.text,
            "language": summary.language,
            "audio_seconds": round(summary.audio_seconds, 3),
            "real_time_factor": round(summary.real_time_factor, 4),
            "segments": [{"start": round(a, 3), "end": round(b, 3), "text": t} for a, b, t in segments],
        }, ensure_ascii=False, indent=2) + "\n"  # fmt: skip
    if not segments:
        raise CliError(f"the model gave no timestamps: use --format text (asked for {fmt})")
    cues = [(a, b, t) for a, b, t in segments if t]
    if fmt == "srt":
        return "".join(
            f"{i}\n{subtitle_clock(a, ',')} --> {subtitle_clock(b, ',')}\n{t}\n\n"
            for i, (a, b, t) in enumerate(cues, 1)
        )
    return "WEBVTT\n\n" + "".join(f"{subtitle_clock(a, '.')} --> {subtitle_clock(b, '.')}\n{t}\n\n" for a, b, t in cues)


def summary_line(summary) -> str:
    language = f" · language {summary.language}" if summary.language else ""
    return (
        f"{summary.audio_seconds:.2f} s of audio{language} · {len(summary.segments)} segment(s) · "
        f"{summary.output_tokens} tokens · real-time factor {summary.real_time_factor:.2f}"
    )


def run(args: argparse.Namespace) -> int:
    if args.stream:
        from omnivox.services.cli.transcribe_stream import run_stream

        return run_stream(args)
    import grpc

    from omnivox.services.cli.ask import audio_part
    from omnivox.v1 import transcription_pb2, transcription_pb2_grpc

    request = transcription_pb2.TranscribeRequest(
        model=args.model,
        audio=audio_part(args.audio, args.sample_rate),
        language=args.language,
        prompt=args.prompt,
        timestamps=args.format != "text",
        task=args.task,
        cache_salt=args.cache_salt,
        temperature=args.temperature,
    )
    out = sys.stdout if args.output == "-" else open_output(args.output)
    summary = None
    try:
        with connect(args) as channel:
            stub = transcription_pb2_grpc.TranscriptionServiceStub(channel)
            try:
                for response in stub.Transcribe(request, timeout=args.timeout):
                    if response.HasField("delta"):
                        if args.format == "text":
                            out.write(response.delta.text)
                            out.flush()
                    else:
                        summary = response.summary
            except grpc.RpcError as err:
                raise CliError(rpc_error_line(err, args.server)) from None
        assert summary is not None, "the stream ended without a summary"
        out.write("\n" if args.format == "text" else render(summary, args.format))
    finally:
        if out is not sys.stdout:
            out.close()
    if not args.quiet:
        print(f"[{summary_line(summary)}]", file=sys.stderr)
    return 0
