"""`omnivox speak "Hello there" --voice tara -o hello.wav`: synthesize speech, streaming it to a file or stdout."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omnivox.services.cli._common import (
    CliError,
    add_cache_salt_arg,
    add_connection_args,
    connect,
    open_output,
    rpc_error_line,
)

ENCODINGS = ("wav", "linear16", "flac", "ogg_opus", "mulaw", "mp3")
_BY_SUFFIX = {".wav": "wav", ".flac": "flac", ".ogg": "ogg_opus", ".opus": "ogg_opus", ".raw": "linear16",
              ".pcm": "linear16", ".ulaw": "mulaw", ".mulaw": "mulaw", ".mp3": "mp3"}  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("speak", help="synthesize speech from text (SpeechService)")
    p.add_argument("text", nargs="?", help="what to say; - or nothing reads it from stdin")
    p.add_argument(
        "-o",
        "--output",
        default="-",
        help="output file, its suffix naming the encoding (.wav .flac .ogg/.opus .mp3 .raw/.pcm .ulaw/.mulaw; another "
        "needs --encoding), or - for stdout (default: -)",
    )
    p.add_argument("--voice", default="", help="voice name (default: the model's default voice)")
    p.add_argument("--language", default="", help="BCP-47 language code of the voice")
    p.add_argument("--model", default="", help="speech model (default: the server's speech model)")
    p.add_argument(
        "--encoding", choices=ENCODINGS, help="audio encoding (default: from the output file's suffix, else wav)"
    )
    p.add_argument("--sample-rate", type=int, default=0, help="sample rate in Hz (default: the model's own)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--speaking-rate", type=float, help="pace: 1 the voice's own, 2 twice as fast (voices only)")
    p.add_argument("--voice-from", type=Path, help="speak in the voice of this reference recording (with --transcript)")
    p.add_argument("--transcript", help="what the --voice-from recording says")
    p.add_argument("--list-voices", action="store_true", help="print the voices the server offers and exit")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary line on stderr")
    add_cache_salt_arg(p)
    add_connection_args(p)
    p.set_defaults(run=run)


def _encoding(args: argparse.Namespace) -> str:
    if args.encoding:
        return args.encoding
    suffix = Path(args.output).suffix.lower() if args.output != "-" else ""
    if suffix and suffix not in _BY_SUFFIX:  # "x.aac" got WAV bytes under an AAC name
        raise CliError(
            f"cannot tell an encoding from {args.output!r}: name the file {', '.join(sorted(_BY_SUFFIX))}, "
            f"or pass --encoding ({', '.join(ENCODINGS)})"
        )
    return _BY_SUFFIX.get(suffix, "wav")


def build_request(args: argparse.Namespace, text: str):
    from omnivox.v1 import content_pb2, sampling_pb2, speech_pb2

    sampling = sampling_pb2.SamplingConfig()
    for name in ("temperature", "top_p", "repetition_penalty", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return speech_pb2.SynthesizeSpeechRequest(
        model=args.model,
        text=text,
        voice=speech_pb2.VoiceSelection(name=args.voice, language_code=args.language),
        audio_config=speech_pb2.AudioConfig(
            encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{_encoding(args).upper()}"),
            sample_rate_hertz=args.sample_rate,
            speaking_rate=args.speaking_rate,
        ),
        sampling=sampling,
        cache_salt=args.cache_salt,
    )


def summary_line(summary) -> str:
    ttfa = summary.time_to_first_audio.ToNanoseconds() / 1e9
    return (
        f"{summary.audio_seconds:.2f} s of audio · {summary.audio_tokens} audio tokens · "
        f"first audio {ttfa * 1000:.0f} ms · real-time factor {summary.real_time_factor:.2f}"
    )


def _voice_from(stub, args: argparse.Namespace) -> str:
    """Create (or reuse) a voice named after the reference's content: the same recording and transcript give the same
    voice, so the server's prefix cache keeps serving its reference turn."""
    import hashlib

    import grpc

    from omnivox.services.cli.voices import create_request

    if not args.transcript:
        raise CliError("--voice-from needs --transcript (what the recording says)")
    request = create_request(args.model, "", args.voice_from, args.transcript)
    digest = hashlib.sha256(request.reference_audio.data + b"\0" + args.transcript.encode()).hexdigest()
    request.name = f"ref-{digest[:16]}"
    try:
        stub.CreateVoice(request, timeout=args.timeout)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise CliError(rpc_error_line(err, args.server)) from None
    return request.name


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:  # the player or `head` reading stdout went away: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0


def _run(args: argparse.Namespace) -> int:
    import grpc

    from omnivox.v1 import speech_pb2, speech_pb2_grpc

    with connect(args) as channel:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        if args.list_voices:
            try:
                response = stub.ListVoices(
                    speech_pb2.ListVoicesRequest(model=args.model, language_code=args.language), timeout=args.timeout
                )
            except grpc.RpcError as err:
                raise CliError(rpc_error_line(err, args.server)) from None
            for voice in response.voices:
                print(f"{voice.name}\t{','.join(voice.language_codes)}\t{voice.model}")
            return 0
        if args.voice_from is not None:
            args.voice = _voice_from(stub, args)
        text = sys.stdin.read() if args.text in (None, "-") else args.text
        request = build_request(args, text)
        out = sys.stdout.buffer if args.output == "-" else open_output(args.output, binary=True)
        try:
            for response in stub.SynthesizeSpeech(request, timeout=args.timeout):
                kind = response.WhichOneof("response")
                if kind == "audio":
                    out.write(response.audio.data)
                    out.flush()
                elif kind == "summary" and not args.quiet:
                    print(f"[{summary_line(response.summary)}]", file=sys.stderr)
        except grpc.RpcError as err:
            if out is not sys.stdout.buffer:  # no empty or cut-off audio file left behind as if it were the answer
                out.close()
                Path(args.output).unlink(missing_ok=True)
            raise CliError(rpc_error_line(err, args.server)) from None
        finally:
            if out is not sys.stdout.buffer:
                out.close()
    if args.output != "-":
        _fix_wav_sizes(Path(args.output))
    return 0


def _fix_wav_sizes(path: Path) -> None:
    """Write the real RIFF and data sizes into a streamed WAV file's header.

    The server streams WAV with "as long as the file" sizes (0xFFFFFFFF); soundfile copes, but Python's `wave` and
    other readers then report two billion frames. A file on disk is seekable, so it gets the sizes it has.
    """
    if not path.is_file():
        return
    size = path.stat().st_size
    with open(path, "r+b") as f:
        header = f.read(44)
        if size < 44 or header[:4] != b"RIFF" or header[8:12] != b"WAVE" or header[36:40] != b"data":
            return
        f.seek(4)
        f.write((size - 8).to_bytes(4, "little"))
        f.seek(40)
        f.write((size - 44).to_bytes(4, "little"))
