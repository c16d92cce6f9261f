"""Speech benchmark: time to first audio, real-time factor, and how many concurrent streams stay faster than real time.

    python -m omnivox.benchmarks.speech [--model SPEECH_FOLDER | --address HOST:PORT] [--concurrency 1,2,4,8]

Without --address it starts `omnivox serve` on --model (default: the embedded random speech model). At each
concurrency level, that many clients each ask for the same text (LINEAR16, 24 kHz) at once.

Per stream: time to first audio (client side, from sending the request), real-time factor (wall time of the whole
stream / audio seconds) and lateness. A stream *stays faster than real time* when playback that starts with its first
chunk never runs dry: every chunk arrives before the audio received ahead of it has finished playing (lateness <= 0).
The headline number is the highest level at which every stream stayed faster than real time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

DEFAULT_TEXT = "Hello there! This is a quick test of streaming speech synthesis. How does it sound?"
BYTES_PER_SECOND = 24000 * 2  # LINEAR16 at 24 kHz


@dataclass
class StreamResult:
    ttfa_s: float  # request sent -> first audio bytes received
    wall_s: float  # request sent -> summary received
    audio_s: float
    rtf: float  # wall_s / audio_s
    server_rtf: float  # the summary's real-time factor
    lateness_s: float  # worst (chunk arrival - when playback started at the first chunk would need it); <= 0 is good

    @property
    def realtime(self) -> bool:
        return self.lateness_s <= 0.0


def synthesize_one(address: str, text: str, voice: str, model: str, timeout_s: float) -> StreamResult:
    from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

    request = speech_pb2.SynthesizeSpeechRequest(
        model=model,
        text=text,
        voice=speech_pb2.VoiceSelection(name=voice),
        audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=24000),
    )
    with grpc.insecure_channel(address) as channel:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        start = time.monotonic()
        first: float | None = None
        received_s = 0.0  # audio seconds received before the current chunk
        lateness = float("-inf")
        summary = None
        for response in stub.SynthesizeSpeech(request, timeout=timeout_s):
            now = time.monotonic()
            kind = response.WhichOneof("response")
            if kind == "audio" and response.audio.data:
                if first is None:
                    first = now
                lateness = max(lateness, (now - first) - received_s)
                received_s += len(response.audio.data) / BYTES_PER_SECOND
            elif kind == "summary":
                summary = response.summary
        wall = time.monotonic() - start
    if summary is None or first is None:
        raise RuntimeError("the stream ended without audio or summary")
    audio_s = summary.audio_seconds
    return StreamResult(
        ttfa_s=first - start,
        wall_s=wall,
        audio_s=audio_s,
        rtf=wall / audio_s if audio_s else float("inf"),
        server_rtf=summary.real_time_factor,
        lateness_s=lateness,
    )


def run_levels(
    address: str, levels: list[int], text: str = DEFAULT_TEXT, voice: str = "", model: str = "", timeout_s: float = 600
) -> dict:
    """Every level in turn; returns {"levels": [...], "max_realtime_streams": N}."""
    out = []
    for n in levels:
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda _: synthesize_one(address, text, voice, model, timeout_s), range(n)))
        ttfa = sorted(r.ttfa_s for r in results)
        out.append(
            {
                "concurrency": n,
                "ttfa_p50_s": statistics.median(ttfa),
                "ttfa_max_s": ttfa[-1],
                "rtf_p50": statistics.median(r.rtf for r in results),
                "rtf_max": max(r.rtf for r in results),
                "audio_s": statistics.mean(r.audio_s for r in results),
                "worst_lateness_s": max(r.lateness_s for r in results),
                "all_realtime": all(r.realtime for r in results),
                "streams": [asdict(r) | {"realtime": r.realtime} for r in results],
            }
        )
    realtime_levels = [level["concurrency"] for level in out if level["all_realtime"]]
    return {"levels": out, "max_realtime_streams": max(realtime_levels, default=0)}


def format_table(result: dict) -> str:
    lines = [
        "| streams | first audio p50 / max (ms) | RTF p50 / max | worst lateness (ms) | all faster than real time |",
        "|---:|---:|---:|---:|:---:|",
    ]
    for level in result["levels"]:
        lines.append(
            f"| {level['concurrency']} | {level['ttfa_p50_s'] * 1e3:.0f} / {level['ttfa_max_s'] * 1e3:.0f} | "
            f"{level['rtf_p50']:.2f} / {level['rtf_max']:.2f} | {max(level['worst_lateness_s'], 0) * 1e3:.0f} | "
            f"{'yes' if level['all_realtime'] else 'no'} |"
        )
    lines.append(f"\nconcurrent streams that all stay faster than real time: {result['max_realtime_streams']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.speech", description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="an omnivox server already running (else one is started on --model)")
    ap.add_argument("--model", help="speech model folder (default: the embedded random speech model)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="levels, e.g. 1,2,4,8")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--voice", default="")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `omnivox serve` (repeat)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.concurrency.split(",") if v.strip()]
    from omnivox.benchmarks.main import git_commit

    # What a results file needs to be quoted from: when, at which commit, on how busy a machine, by which command.
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "load_average_at_start": list(os.getloadavg()),
        "command": " ".join(["python -m omnivox.benchmarks.speech", *(argv if argv is not None else sys.argv[1:])]),
        "text_chars": len(args.text),
    }
    server = None
    address = args.address
    if address is None:
        from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

        model = args.model
        if model is None:
            from omnivox.services.defaults import ensure_default_speech_model

            model = str(ensure_default_speech_model())
        server = ServerProcess(model, args.server_arg, Path("bench-results") / "speech-server.log")
        address = server.address
    try:
        result = run_levels(address, levels, args.text, args.voice)
    finally:
        if server is not None:
            server.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**meta, **result}, indent=2))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
