"""`omnivox ask --audio question.wav "What is said here?"`: one question about audio (or image) files, answer streamed.

The files go inline as parts of one user turn, before the question, in the order given. Containers (WAV, FLAC, Ogg,
MP3; PNG, JPEG, ...) are detected by the server from the bytes; headerless audio (`.raw`/`.pcm` LINEAR16,
`.ulaw`/`.mulaw` MULAW) needs `--sample-rate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnivox.services.cli._common import CliError, connect

RAW_AUDIO = {".raw": "LINEAR16", ".pcm": "LINEAR16", ".ulaw": "MULAW", ".mulaw": "MULAW"}


def register(subparsers: argparse._SubParsersAction) -> None:
    from omnivox.services.cli.generate import _add_request_args

    p = subparsers.add_parser("ask", help="ask about audio or image files (one turn: the files, then the question)")
    p.add_argument("question", help="the question; - reads it from stdin")
    p.add_argument("--audio", action="append", default=[], type=Path, help="an audio file (repeatable)")
    p.add_argument("--image", action="append", default=[], type=Path, help="an image file (repeatable)")
    p.add_argument("--sample-rate", type=int, default=0, help="sample rate of headerless audio (.raw/.pcm/.ulaw)")
    p.add_argument("--max-pixels", type=int, help="images: at most this many pixels go into the model (scaled down)")
    _add_request_args(p)
    p.set_defaults(run=run)


def read_file(path: Path) -> bytes:
    """The bytes of `path` (- is stdin), or CliError naming it."""
    if str(path) == "-":
        return sys.stdin.buffer.read()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None


def audio_part(path: Path, sample_rate: int):
    """An AudioPart for a file: containers as they are; headerless audio by its suffix, with the rate given."""
    from omnivox.v1 import content_pb2

    raw = RAW_AUDIO.get(path.suffix.lower())
    if raw and not sample_rate:
        raise CliError(f"{path} is headerless {raw} audio: give its rate with --sample-rate")
    encoding = content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{raw}") if raw else 0
    return content_pb2.AudioPart(data=read_file(path), encoding=encoding, sample_rate_hertz=sample_rate if raw else 0)


def run(args: argparse.Namespace) -> int:
    from omnivox.services.cli.generate import build_request, stream_answer
    from omnivox.v1 import content_pb2, generation_pb2_grpc

    if not args.audio and not args.image:
        raise CliError("give at least one --audio or --image file (for text alone use `omnivox generate`)")
    question = sys.stdin.read() if args.question == "-" else args.question
    media = [content_pb2.Part(audio=audio_part(p, args.sample_rate)) for p in args.audio]
    media += [
        content_pb2.Part(image=content_pb2.ImagePart(data=read_file(p), max_pixels=args.max_pixels)) for p in args.image
    ]
    request = build_request(args, [("user", question)])
    turn = request.contents[-1]
    parts = [*media, *turn.parts]  # the files first, then the question, as the processors' examples do
    del turn.parts[:]
    turn.parts.extend(parts)
    with connect(args) as channel:
        if args.image and not args.model:
            request.model = image_model(channel)
        stream_answer(generation_pb2_grpc.GenerationServiceStub(channel), request, args)
    return 0


def image_model(channel) -> str:
    """With --image and no --model: the default model if it reads images, else the first served model that does
    (with no --model, `omnivox serve` serves a text default and the embedded image model beside it); "" (the server's
    default, which then says what it cannot read) when none does."""
    import grpc

    from omnivox.v1 import model_pb2, model_pb2_grpc

    try:
        models = model_pb2_grpc.ModelServiceStub(channel).ListModels(model_pb2.ListModelsRequest(), timeout=10).models
    except grpc.RpcError:
        return ""  # Generate itself reports an unreachable server
    readers = [m for m in models if model_pb2.MODALITY_IMAGE in m.input_modalities]
    readers.sort(key=lambda m: not m.is_default)
    return readers[0].name if readers else ""
