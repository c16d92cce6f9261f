"""Voice round trip: synthesize with a served voice, transcribe it back with the embedded whisper-base on the same
server, score the transcript by word error rate (WER); with time to first audio and real-time factor per request.

    python -m omnivox.benchmarks.voices [--address HOST:PORT] [--piper FOLDER] [--out FILE.json]

Without --address it starts `omnivox serve` with no --model (the out-of-the-box server: hibari is its default speech
model, whisper-base its recognizer). --piper FOLDER also starts `omnivox serve --model FOLDER --model <whisper-base>`
and measures that voice the same way. Per model, over the sentences of data/voice_sentences.txt (none is in the
tests; the first five are the out-of-the-box check):
- one request at a time: WER of each sentence, time to first audio (client side) and the server's RTF;
- the same with StreamingSynthesizeSpeech, the text sent in three chunks;
- 8 concurrent requests: each stream's RTF (all < 1: faster than real time).
The JSON records the CPU, its flags and the load average (the benchmark host is shared).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.transcription import word_error_rate

CORPUS = Path(__file__).parent / "data" / "voice_sentences.txt"
ASR_MODEL = "whisper-base"
TARGETS = {"mean_wer": 0.15, "max_wer": 0.4, "ttfa_p50_s": 0.6, "rtf_p50": 0.35}


def sentences() -> list[str]:
    return [line.strip() for line in CORPUS.read_text().splitlines() if line.strip() and not line.startswith("#")]


@dataclass
class RoundTrip:
    text: str
    transcript: str
    wer: float
    ttfa_s: float  # client side: request sent -> first audio bytes
    rtf: float  # the server's summary: compute seconds / audio seconds
    audio_s: float


def three_chunks(text: str) -> list[str]:
    """The text cut at two spaces near its thirds (so words arrive split across messages as an LLM sends them)."""
    cuts = [text.find(" ", len(text) * k // 3) for k in (1, 2)]
    cuts = [c for c in cuts if c > 0]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if text[a:b]]


def synthesize(channel: grpc.Channel, text: str, model: str = "", stream: bool = False) -> tuple[bytes, float, object]:
    """(WAV bytes at 16 kHz, client-side time to first audio, the summary)."""
    from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    audio = speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_WAV, sample_rate_hertz=16000)
    sent = time.monotonic()
    if stream:
        config = speech_pb2.StreamingSpeechConfig(model=model, audio_config=audio)
        messages = [speech_pb2.StreamingSynthesizeSpeechRequest(config=config)]
        messages += [speech_pb2.StreamingSynthesizeSpeechRequest(text=c) for c in three_chunks(text)]
        messages.append(speech_pb2.StreamingSynthesizeSpeechRequest(end=True))
        responses = stub.StreamingSynthesizeSpeech(iter(messages), timeout=120)
    else:
        request = speech_pb2.SynthesizeSpeechRequest(model=model, text=text, audio_config=audio)
        responses = stub.SynthesizeSpeech(request, timeout=120)
    data, first, summary = b"", None, None
    for response in responses:
        kind = response.WhichOneof("response")
        if kind == "audio":
            first = first or time.monotonic()
            data += response.audio.data
        elif kind == "summary":
            summary = response.summary
    return data, (first or time.monotonic()) - sent, summary


def transcribe(channel: grpc.Channel, wav: bytes, model: str = ASR_MODEL) -> str:
    from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

    stub = transcription_pb2_grpc.TranscriptionServiceStub(channel)
    request = transcription_pb2.TranscribeRequest(model=model, audio=content_pb2.AudioPart(data=wav))
    return list(stub.Transcribe(request, timeout=300))[-1].summary.text


def round_trip(channel: grpc.Channel, text: str, model: str = "", stream: bool = False) -> RoundTrip:
    return round_trips(channel, [text], model, stream)[0]


def round_trips(channel: grpc.Channel, texts: list[str], model: str = "", stream: bool = False) -> list[RoundTrip]:
    """Each text synthesized one at a time (so its first audio and RTF are a lone request's), then all transcribed
    at once (whisper-base's engine batches them: one by one took 4x as long on 2 cores)."""
    spoken = [synthesize(channel, text, model, stream) for text in texts]
    with ThreadPoolExecutor(max(len(texts), 1)) as pool:
        transcripts = list(pool.map(lambda s: transcribe(channel, s[0]), spoken))
    return [RoundTrip(text, got.strip(), word_error_rate(text, got), ttfa, summary.real_time_factor,
                      summary.audio_seconds) for text, got, (_, ttfa, summary) in zip(texts, transcripts, spoken,
                                                                                      strict=True)]  # fmt: skip


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(trips: list[RoundTrip]) -> dict:
    return {
        "mean_wer": statistics.fmean(t.wer for t in trips),
        "max_wer": max(t.wer for t in trips),
        "ttfa_p50_s": _p50([t.ttfa_s for t in trips]),
        "rtf_p50": _p50([t.rtf for t in trips]),
        "requests": [asdict(t) for t in trips],
    }


def measure_model(channel: grpc.Channel, model: str, texts: list[str]) -> dict:
    """One request at a time (unary and streamed in three chunks), then 8 at once."""
    synthesize(channel, "Warm up.", model)  # not counted: the first call opens the channel
    one = summarize(round_trips(channel, texts, model))
    streamed = summarize(round_trips(channel, texts, model, stream=True))
    batch = texts[:8]
    with ThreadPoolExecutor(len(batch)) as pool:
        started = time.monotonic()
        results = list(pool.map(lambda t: synthesize(channel, t, model), batch))
        wall = time.monotonic() - started
    rtfs = [summary.real_time_factor for _, _, summary in results]
    concurrent = {"streams": len(batch), "rtf_each": rtfs, "ttfa_each_s": [t for _, t, _ in results],
                  "all_faster_than_real_time": all(r < 1.0 for r in rtfs), "wall_s": wall}  # fmt: skip
    return {"one_at_a_time": one, "streamed_three_chunks": streamed, "concurrent_8": concurrent}


def check_targets(out_of_box: dict) -> dict[str, bool]:
    return {key: out_of_box[key] <= bound if "wer" in key else out_of_box[key] < bound for key, bound in
            TARGETS.items()}  # fmt: skip


def cpu_description() -> dict:
    from omnivox.native.kernel_build import cpu_flags, cpu_model

    model, flags = cpu_model(), cpu_flags()
    wanted = re.compile(r"^(avx2|avx512\w*|fma|f16c|amx\w*|avx_vnni|sse4_2)$")
    return {"cpu": model, "cores": os.cpu_count(), "cpu_flags": sorted(f for f in flags if wanted.match(f)),
            "load_average_at_start": list(os.getloadavg())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

    ap = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.voices", description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="an out-of-the-box omnivox server already running")
    ap.add_argument("--piper", type=Path, help="also measure this Piper voice folder")
    ap.add_argument("--sentences", type=int, default=0, help="use the first N sentences of the corpus (0: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from omnivox.benchmarks.main import git_commit

    texts = sentences()[: args.sentences or None]
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
                    "command": " ".join(["python -m omnivox.benchmarks.voices", *(argv or sys.argv[1:])]),
                    **cpu_description(), "models": {}}  # fmt: skip
    servers: list[ServerProcess] = []
    try:
        address = args.address
        if address is None:
            servers.append(ServerProcess(None, [], Path("bench-results") / "voices-server.log", 600))
            address = servers[-1].address
        with grpc.insecure_channel(address) as channel:
            out_of_box = summarize(round_trips(channel, texts[:5]))
            result["out_of_the_box_5"] = {**out_of_box, "meets": check_targets(out_of_box)}
            result["models"]["hibari"] = measure_model(channel, "hibari", texts)
        if args.piper is not None:
            from omnivox.services.parts.defaults import ensure_default_whisper

            whisper = ensure_default_whisper(progress=False)
            piper_flags = ["--model", str(args.piper), "--model", str(whisper), "--name", "piper", "--name", ASR_MODEL]
            servers.append(ServerProcess(None, piper_flags, Path("bench-results") / "voices-piper.log", 600))
            with grpc.insecure_channel(servers[-1].address) as channel:
                result["models"]["piper"] = measure_model(channel, "piper", texts)
    finally:
        for server in servers:
            server.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, result)
    print(format_table(result))
    return 0


def format_table(result: dict) -> str:
    lines = ["| model | mode | mean WER | max WER | first audio p50 | RTF p50 |", "|---|---|---|---|---|---|"]
    box = result.get("out_of_the_box_5")
    if box:
        lines.append(f"| hibari | out of the box, 5 sentences | {box['mean_wer']:.3f} | {box['max_wer']:.3f} | "
                     f"{box['ttfa_p50_s'] * 1000:.0f} ms | {box['rtf_p50']:.3f} |")  # fmt: skip
    for name, m in result["models"].items():
        for mode in ("one_at_a_time", "streamed_three_chunks"):
            s = m[mode]
            lines.append(f"| {name} | {mode} | {s['mean_wer']:.3f} | {s['max_wer']:.3f} | "
                         f"{s['ttfa_p50_s'] * 1000:.0f} ms | {s['rtf_p50']:.3f} |")  # fmt: skip
        c = m["concurrent_8"]
        lines.append(f"| {name} | 8 concurrent | | | {max(c['ttfa_each_s']) * 1000:.0f} ms max | "
                     f"{max(c['rtf_each']):.3f} max |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
