"""`omnivox voices create NAME --audio ref.wav --transcript "..."`, `omnivox voices list`, `omnivox voices delete NAME`:
voices created from reference audio (SpeechService CreateVoice / ListVoices / DeleteVoice)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omnivox.services.cli._common import CliError, add_connection_args, connect, rpc_error_line

KINDS = {0: "unspecified", 1: "built-in", 2: "created"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("voices", help="create, list and delete speech voices (SpeechService)")
    sub = p.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="a voice from a short reference recording and its transcript")
    create.add_argument("name")
    create.add_argument("--audio", type=Path, required=True, help="reference recording (WAV, FLAC, OGG), <= 20 s")
    create.add_argument("--transcript", required=True, help="what the reference says")
    create.add_argument("--description", default="")
    listing = sub.add_parser("list", help="built-in and created voices")
    delete = sub.add_parser("delete", help="delete a created voice")
    delete.add_argument("name")
    for q in (create, listing, delete):
        q.add_argument("--model", default="", help="speech model (default: the server's speech model)")
        add_connection_args(q)
        q.set_defaults(run=run)


def create_request(model: str, name: str, audio: Path, transcript: str, description: str = ""):
    from omnivox.v1 import content_pb2, speech_pb2

    try:
        data = audio.read_bytes()
    except OSError as err:
        raise CliError(f"cannot read {audio}: {err.strerror}") from None
    return speech_pb2.CreateVoiceRequest(
        model=model,
        name=name,
        reference_audio=content_pb2.AudioPart(data=data),
        transcript=transcript,
        description=description,
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    from omnivox.v1 import speech_pb2, speech_pb2_grpc

    with connect(args) as channel:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        try:
            if args.action == "create":
                request = create_request(args.model, args.name, args.audio, args.transcript, args.description)
                voice = stub.CreateVoice(request, timeout=args.timeout).voice
                print(f"{voice.name}\t{KINDS.get(voice.kind)}\t{voice.reference_seconds:.2f} s\t{voice.model}")
            elif args.action == "list":
                response = stub.ListVoices(speech_pb2.ListVoicesRequest(model=args.model), timeout=args.timeout)
                for v in response.voices:
                    print(f"{v.name}\t{KINDS.get(v.kind)}\t{','.join(v.language_codes)}\t{v.model}\t{v.description}")
            else:
                stub.DeleteVoice(speech_pb2.DeleteVoiceRequest(model=args.model, name=args.name), timeout=args.timeout)
        except grpc.RpcError as err:
            raise CliError(rpc_error_line(err, args.server)) from None
    return 0
