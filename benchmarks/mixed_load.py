"""Mixed load on one server: text streams, speech syntheses and transcriptions at once, with the step arbiter on and
off in the same run (engine/arbiter.py: a speech stream behind its playback deadline steps first).

    python -m omnivox.benchmarks.mixed_load [--seconds 20] [--text 6] [--speech 2] [--transcriptions 2] [--threads 1]

Starts `omnivox serve` with no --model (the embedded defaults: SmolLM2-135M Q4_1 text, the speech models and
whisper-base), once with `--audio-first-margin 1.0` (the default) and once with `--audio-first-margin 0` (off)
(`--margins 1,2,0`: one mode per margin), alternating `--rounds` times, and for `--seconds` each runs closed loops of clients: text streams (Generate, a short
chat prompt, 48 tokens: TTFT and ITL per token), speech syntheses (SynthesizeSpeech by orpheus-random, the speech
model that runs on an engine, LINEAR16 24 kHz: time to first
audio, RTF = wall / audio seconds, lateness = how late the worst chunk was for playback started at the first one)
and transcriptions (Transcribe of 6 s of a tone: RTF; `--streaming-transcriptions N` adds N clients streaming two
spoken sentences to StreamingTranscribe at real-time pace: each final result's delay after its speech ended, RTF). It scrapes the server's /metrics at the end of each round for
the arbiter's decisions (omnivox_arbiter_yields_total per model). `--before-tree DIR` adds a third mode, "arbiter on,
before": the server run from another omnivox tree (DIR holds its `omnivox` package, put first on PYTHONPATH; e.g. the
commit before a policy change), so a change is compared with what it replaced in the same run. Results: medians and p99s per mode, the CPU's
flags and the load average, in benchmarks/results/mixed-load-cpu.json. The machine it runs on may be shared: the
load average is recorded before and after, and the two modes alternate so that both see the same neighbours.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from omnivox.benchmarks.cpu_flags import cpu_flags
from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.speech import synthesize_one
from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

TEXT_PROMPT = "Write a short story about a lighthouse keeper and a storm."
SPEECH_TEXT = "Hello there! This is a quick test of speech synthesis under load."
RATE = 16000


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Server(ServerProcess):
    """`omnivox serve` (embedded defaults) on free ports; its gRPC and /metrics addresses read from its log."""

    def __init__(self, extra: list[str], log_path: Path) -> None:
        super().__init__(None, ["--metrics-port", "0", *extra], log_path, startup_timeout_s=600)
        try:
            self.metrics_url = re.search(r"metrics on (\S+)", log_path.read_text(errors="replace")).group(1)
        except BaseException:
            self.close()
            raise

    def scrape(self) -> dict[str, float]:
        """omnivox_arbiter_* and omnivox_audio_underruns_total samples, by `name{labels}`."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        wanted = (
            "omnivox_arbiter_yields_total",
            "omnivox_arbiter_yield_seconds_total",
            "omnivox_audio_underruns_total",
        )
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(wanted)
        }


def text_client(address: str, until: float, out: dict) -> None:
    from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc

    turn = content_pb2.Content(role="user", parts=[content_pb2.Part(text=TEXT_PROMPT)])
    request = generation_pb2.GenerateRequest(contents=[turn], max_output_tokens=48, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        while time.monotonic() < until:
            start = last = time.monotonic()
            first = True
            for response in stub.Generate(request, timeout=600):
                if response.WhichOneof("response") != "delta":
                    continue
                now = time.monotonic()
                if first:
                    out["ttft"].append(now - start)
                else:
                    out["itl"].append(now - last)
                first, last = False, now
            out["requests"] += 1


def speech_client(address: str, until: float, out: dict, model: str = "orpheus-random") -> None:
    """Syntheses by the engine-driven speech model (the default hibari voice has no engine steps to arbitrate)."""
    while time.monotonic() < until:
        r = synthesize_one(address, SPEECH_TEXT, "", model, 600)
        out["ttfa"].append(r.ttfa_s)
        out["rtf"].append(r.rtf)
        out["lateness"].append(r.lateness_s)


def transcription_client(address: str, until: float, out: dict) -> None:
    from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

    t = np.arange(int(6.0 * RATE)) / RATE
    samples = (0.3 * np.sin(2 * np.pi * 440 * t) * (t % 1.0 < 0.6)).astype(np.float32)
    audio = content_pb2.AudioPart(
        data=(samples * 32767).astype("<i2").tobytes(), encoding=content_pb2.AUDIO_ENCODING_LINEAR16,
        sample_rate_hertz=RATE,
    )  # fmt: skip
    request = transcription_pb2.TranscribeRequest(audio=audio, language="en")
    with grpc.insecure_channel(address) as channel:
        stub = transcription_pb2_grpc.TranscriptionServiceStub(channel)
        while time.monotonic() < until:
            start = time.monotonic()
            list(stub.Transcribe(request, timeout=600))
            out["rtf"].append((time.monotonic() - start) / 6.0)


def streaming_transcription_client(address: str, until: float, out: dict, audio: np.ndarray) -> None:
    """StreamingTranscribe of `audio` (espeak-ng sentences) at real-time pace in 100 ms chunks, stream after stream:
    each final result's delay after its utterance's speech ended, and the server's RTF of each stream."""
    from omnivox.benchmarks.transcription import omnivox_stream

    while time.monotonic() < until:
        r = omnivox_stream(address, "", audio)
        out["final_delay"].extend(r["final_delay_after_speech_end_s"])
        out["rtf"].append(r["served_rtf"])


def run_round(server: Server, args: argparse.Namespace, stream_audio: np.ndarray | None = None) -> dict:
    """All clients at once for args.seconds (each finishes the request it is in); their raw samples."""
    text = {"ttft": [], "itl": [], "requests": 0}
    speech = {"ttfa": [], "rtf": [], "lateness": []}
    asr = {"rtf": []}
    live = {"final_delay": [], "rtf": []}
    before = server.scrape()
    until = time.monotonic() + args.seconds
    jobs = [(text_client, text)] * args.text + [(speech_client, speech)] * args.speech
    jobs += [(transcription_client, asr)] * args.transcriptions
    if args.streaming_transcriptions:
        assert stream_audio is not None
        live_client = functools.partial(streaming_transcription_client, audio=stream_audio)
        jobs += [(live_client, live)] * args.streaming_transcriptions
    threads = [threading.Thread(target=fn, args=(server.address, until, out)) for fn, out in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    after = server.scrape()
    metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"text": text, "speech": speech, "transcription": asr, "streaming": live, "metrics": metrics}


def summarize(rounds: list[dict]) -> dict:
    def cat(part: str, key: str) -> list[float]:
        return [v for r in rounds for v in r[part][key]]

    ttfa, rtf, late = cat("speech", "ttfa"), cat("speech", "rtf"), cat("speech", "lateness")
    metrics: dict[str, float] = {}
    for r in rounds:
        for k, v in r["metrics"].items():
            metrics[k] = metrics.get(k, 0.0) + v
    return {
        "text_requests": sum(r["text"]["requests"] for r in rounds),
        "text_ttft_p50_s": percentile(cat("text", "ttft"), 50),
        "text_itl_p50_ms": (percentile(cat("text", "itl"), 50) or 0) * 1e3,
        "text_itl_p99_ms": (percentile(cat("text", "itl"), 99) or 0) * 1e3,
        "speech_streams": len(ttfa),
        "speech_first_audio_p50_s": percentile(ttfa, 50),
        "speech_rtf_p50": percentile(rtf, 50),
        "speech_rtf_max": max(rtf) if rtf else None,
        "speech_streams_late": sum(x > 0 for x in late),
        "speech_rtf_per_stream": [round(x, 3) for x in rtf],  # in the order the streams ended, rounds in turn
        "speech_lateness_per_stream_s": [round(x, 3) for x in late],  # the worst chunk's, playback from the first
        "transcriptions": len(cat("transcription", "rtf")),
        "transcription_rtf_p50": percentile(cat("transcription", "rtf"), 50),
        "streaming_transcriptions": len(cat("streaming", "rtf")),
        "streaming_final_delay_p50_s": percentile(cat("streaming", "final_delay"), 50),
        "streaming_final_delay_p90_s": percentile(cat("streaming", "final_delay"), 90),
        "streaming_rtf_p50": percentile(cat("streaming", "rtf"), 50),
        "metrics": metrics,
    }


def mode_name(margin_s: float) -> str:
    """ "arbiter off" (margin 0), "arbiter on" (the default margin, 1 s), else "arbiter on, margin X s"."""
    return "arbiter off" if margin_s == 0 else "arbiter on" if margin_s == 1.0 else f"arbiter on, margin {margin_s:g} s"


def serve(mode: str, flags: list[str], tree: Path | None) -> Server:
    """The mode's server; from `tree`'s omnivox package when given (first on the child's PYTHONPATH)."""
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree), *([saved] if saved else [])])
    try:
        return Server(flags, Path(f"bench-results/mixed-{mode.replace(' ', '').replace(',', '-')}.log"))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each round (the issue's load ran 60 s)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per mode, the modes alternating")
    ap.add_argument("--text", type=int, default=6)
    ap.add_argument("--speech", type=int, default=2)
    ap.add_argument("--transcriptions", type=int, default=2)
    ap.add_argument(
        "--streaming-transcriptions",
        type=int,
        default=0,
        help="clients streaming speech (espeak-ng, two sentences) to StreamingTranscribe at real-time pace",
    )
    ap.add_argument("--threads", type=int, default=1, help="`serve --threads`")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `omnivox serve` argument (repeat)")
    ap.add_argument(
        "--before-tree", type=Path, help="a folder whose omnivox package serves a third mode, 'arbiter on, before'"
    )
    ap.add_argument(
        "--margins",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1.0, 0.0],
        help="`serve --audio-first-margin` of each mode, comma-separated (0: arbiter off; default 1,0)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/mixed-load-cpu.json"))
    args = ap.parse_args(argv)
    from omnivox.benchmarks.main import git_commit, machine_description

    modes = {mode_name(m): ["--audio-first-margin", f"{m:g}"] for m in args.margins}
    trees = {mode: None for mode in modes}
    if args.before_tree is not None:
        first_on = modes[mode_name(next(m for m in args.margins if m))]  # the before tree at the first margin on
        modes["arbiter on, before"], trees["arbiter on, before"] = first_on, args.before_tree.resolve()
    raw: dict[str, list[dict]] = {m: [] for m in modes}
    stream_audio = None
    if args.streaming_transcriptions:
        from omnivox.benchmarks.transcription import build_audio

        audio, spans = build_audio()
        stream_audio = audio[: spans[1][1] + RATE]  # the first two sentences and a second of quiet after them
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for mode, flags in modes.items():
            server = serve(mode, [*flags, "--threads", str(args.threads), *args.server_arg], trees[mode])
            try:
                raw[mode].append(run_round(server, args, stream_audio))
            finally:
                server.close()
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "machine": machine_description("cpu"),
        "cpu_flags": cpu_flags(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "note": "measured on a machine shared with other jobs (see the load averages): compare the modes, "
        "which alternate round by round, not the absolute numbers",
        "load": {
            k: getattr(args, k)
            for k in (
                "seconds",
                "rounds",
                "text",
                "speech",
                "transcriptions",
                "streaming_transcriptions",
                "threads",
                "margins",
            )
        },
        "before_tree": str(args.before_tree) if args.before_tree else None,
        "modes": {mode: summarize(rounds) for mode, rounds in raw.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result)
    print(json.dumps(result["modes"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
