"""Speech recognition on CPU: real-time factor and time to first partial result, omnivox vs transformers (and
faster-whisper when installed), whisper-base, in one run.

    python -m omnivox.benchmarks.transcription [--threads 1] [--reps 3] [--out benchmarks/results/transcription-cpu.json]

The audio: five espeak-ng sentences (22 s with the pauses, one 30 s window, so every system decodes it the same way)
between stretches of -60 dBFS noise, 16 kHz 16-bit. All systems read the same weights: the embedded whisper-base as
converted into the model cache (services/parts/defaults.py), in float32, greedy, language "en", no timestamps, one compute
thread each:
- omnivox: `omnivox serve --model <that folder> --threads N` as a child process; `Transcribe` over gRPC (client wall
  time), and `StreamingTranscribe` at real-time pace (100 ms chunks) with interim results.
- transformers: WhisperProcessor + WhisperForConditionalGeneration.generate on the same folder.
- faster-whisper (if importable): that folder converted to CTranslate2 by ctranslate2's own converter, float32 and
  int8, beam_size 1, no VAD filter.
Per system: RTF of the whole clip (median of --reps after a warm-up) and its word error rate against the sentences;
"first partial" = the compute of one pass on the first 1.0 s of speech (+0.2 s before it), what a streaming loop
that re-transcribes the open utterance each second waits for after its first second of speech; "utterance pass" = the
mean time of one pass on each sentence's own span. For omnivox the served stream's own numbers are measured too:
first result after the speech began, and each final's delay after its utterance's last voiced audio (which includes
the detector's 600 ms of silence).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from omnivox.benchmarks.host import write_results

RATE = 16000
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "She sells sea shells by the sea shore.",
    "We will meet at the station at half past nine tomorrow morning.",
)
LEAD_S, GAP_S, TAIL_S, PAD_S, FIRST_S = 0.5, 0.9, 1.0, 0.2, 1.0


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance (substitutions + insertions + deletions) over the reference's word count (words
    lower-cased, punctuation dropped); the tests score transcripts with it too."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def build_audio() -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The clip (float32, 16-bit values) and each sentence's [start, end) in samples."""
    import shutil
    import subprocess

    import soundfile

    from omnivox.codecs.audio_input import resample

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")
    rng = np.random.default_rng(0)

    def quiet(seconds: float) -> np.ndarray:
        return (10 ** (-60 / 20) * rng.standard_normal(round(seconds * RATE))).astype(np.float32)

    parts, spans, at = [quiet(LEAD_S)], [], round(LEAD_S * RATE)
    for i, sentence in enumerate(SENTENCES):
        wav = subprocess.run([exe, "--stdout", sentence], capture_output=True, check=True).stdout
        samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        clip = resample(samples, rate, RATE)
        parts.append(clip)
        spans.append((at, at + len(clip)))
        at += len(clip)
        gap = quiet(GAP_S if i < len(SENTENCES) - 1 else TAIL_S)
        parts.append(gap)
        at += len(gap)
    audio = np.concatenate(parts)
    audio = np.round(np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype(np.float32) / 32768.0
    return audio, spans


def variant(samples: np.ndarray, k: int) -> np.ndarray:
    """`samples` with its own +-1 LSB of dither: every run's audio differs, so omnivox's encoder and prefix caches
    (keyed by the samples) never serve a repeat; every system gets the same variants."""
    noise = np.random.default_rng(1000 + k).integers(-1, 2, len(samples)).astype(np.float32) / 32768.0
    return np.clip(samples + noise, -1.0, 32767 / 32768).astype(np.float32)


def _row(name: str, fn, audio, spans, reps: int) -> dict:
    seconds = len(audio) / RATE
    fn(variant(audio, 0))  # warm-up
    times, text = [], ""
    for k in range(1, reps + 1):
        start = time.perf_counter()
        text = fn(variant(audio, k))
        times.append(time.perf_counter() - start)
    pad = round(PAD_S * RATE)
    first_clip = audio[spans[0][0] - pad : spans[0][0] + round(FIRST_S * RATE)]
    fn(variant(first_clip, 0))  # warm-up at this shape
    start = time.perf_counter()
    fn(variant(first_clip, 1))
    first = time.perf_counter() - start
    utterance_times, utterance_texts = [], []
    for s, e in spans:
        start = time.perf_counter()
        utterance_texts.append(fn(variant(audio[s - pad : e + pad], 1)))
        utterance_times.append(time.perf_counter() - start)
    row = {
        "transcriber": name,
        "rtf": statistics.median(times) / seconds,
        "rtf_runs": [t / seconds for t in times],
        "wer": word_error_rate(" ".join(SENTENCES), text),
        "first_partial_pass_s": first,
        "utterance_pass_s": statistics.mean(utterance_times),
        "utterance_wer": word_error_rate(" ".join(SENTENCES), " ".join(utterance_texts)),
        "text": text,
    }
    print(f"{name:28s} RTF {row['rtf']:.3f}  WER {row['wer']:.3f}  first-second pass {first:.2f} s  "
          f"utterance pass {row['utterance_pass_s']:.2f} s", flush=True)  # fmt: skip
    return row


def omnivox_transcriber(address: str, model: str):
    import grpc

    from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

    stub = transcription_pb2_grpc.TranscriptionServiceStub(grpc.insecure_channel(address))

    def run(samples: np.ndarray) -> str:
        audio = content_pb2.AudioPart(
            data=(samples * 32768).astype("<i2").tobytes(),
            encoding=content_pb2.AUDIO_ENCODING_LINEAR16,
            sample_rate_hertz=RATE,
        )
        request = transcription_pb2.TranscribeRequest(model=model, audio=audio, language="en")
        return list(stub.Transcribe(request, timeout=600))[-1].summary.text

    return run


def omnivox_stream(address: str, model: str, audio: np.ndarray, chunk_s: float = 0.1) -> dict:
    """StreamingTranscribe at real-time pace with interim results: when each response arrived."""
    import grpc

    from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

    stub = transcription_pb2_grpc.TranscriptionServiceStub(grpc.insecure_channel(address))
    data, step = (audio * 32768).astype("<i2").tobytes(), 2 * round(chunk_s * RATE)
    clock: dict[str, float] = {}

    def requests():
        config = transcription_pb2.StreamingTranscriptionConfig(
            model=model, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=RATE, language="en",
            interim_results=True,
        )  # fmt: skip
        yield transcription_pb2.StreamingTranscribeRequest(config=config)
        clock["t0"] = time.perf_counter()
        for i, at in enumerate(range(0, len(data), step)):
            time.sleep(max(0.0, clock["t0"] + i * chunk_s - time.perf_counter()))
            yield transcription_pb2.StreamingTranscribeRequest(audio=data[at : at + step])

    arrivals = []
    for response in stub.StreamingTranscribe(requests(), timeout=600):
        arrivals.append((time.perf_counter(), response))
    start = clock["t0"]
    events = [(t - start, r.speech_event) for t, r in arrivals if r.HasField("speech_event")]
    results = [(t - start, r.result) for t, r in arrivals if r.HasField("result")]
    summary = arrivals[-1][1].summary
    off = lambda d: d.ToNanoseconds() / 1e9  # noqa: E731
    onset = off(events[0][1].offset)
    ends = [off(e.offset) for _, e in events if e.type == 2]
    finals = [(t, r) for t, r in results if r.is_final]
    delays = [t - end for (t, _), end in zip(finals, ends, strict=False)]
    return {
        "first_result_after_onset_s": results[0][0] - onset if results else None,
        "first_result_is_final": results[0][1].is_final if results else None,
        "interim_results": sum(1 for _, r in results if not r.is_final),
        "utterances": len(finals),
        "final_delay_after_speech_end_s": delays,
        "final_delay_median_s": statistics.median(delays) if delays else None,
        "served_rtf": summary.real_time_factor,
        "wer": word_error_rate(" ".join(SENTENCES), summary.text),
        "text": summary.text,
    }


def transformers_transcriber(folder: Path, threads: int):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    torch.set_num_threads(threads)
    processor = WhisperProcessor.from_pretrained(folder)
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def run(samples: np.ndarray) -> str:
        features = processor(samples, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            ids = model.generate(features, language="en", task="transcribe", num_beams=1, do_sample=False)
        return processor.batch_decode(ids, skip_special_tokens=True)[0].strip()

    return run


def faster_whisper_transcriber(folder: Path, threads: int, compute_type: str):
    from faster_whisper import WhisperModel

    model = WhisperModel(str(folder), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=1)

    def run(samples: np.ndarray) -> str:
        segments, _ = model.transcribe(
            samples, language="en", beam_size=1, best_of=1, temperature=0.0, vad_filter=False,
            without_timestamps=True,
        )  # fmt: skip
        return " ".join(s.text.strip() for s in segments)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.transcription", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every system")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of the whole clip per system (after a warm-up)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    from omnivox.benchmarks.main import git_commit
    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess
    from omnivox.services.parts.defaults import ensure_default_whisper

    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "load_average_at_start": list(os.getloadavg()),
        "command": " ".join(
            ["python -m omnivox.benchmarks.transcription", *(argv if argv is not None else sys.argv[1:])]
        ),
        "threads": args.threads,
        "reps": args.reps,
    }
    folder = ensure_default_whisper(progress=False)
    audio, spans = build_audio()
    meta["audio_seconds"] = len(audio) / RATE
    meta["sentences"] = list(SENTENCES)
    print(f"{meta['audio_seconds']:.1f} s of audio, {len(SENTENCES)} sentences; whisper-base from {folder}", flush=True)
    rows = []
    server = ServerProcess(
        str(folder), ["--name", "whisper-base", "--threads", str(args.threads)],
        Path("bench-results") / "transcription-server.log",
    )  # fmt: skip
    try:
        rows.append(_row("omnivox (gRPC Transcribe)", omnivox_transcriber(server.address, "whisper-base"), audio,
                         spans, args.reps))  # fmt: skip
        stream = omnivox_stream(server.address, "whisper-base", variant(audio, 99))
        print(f"omnivox stream: first result {stream['first_result_after_onset_s']:.2f} s after speech began, "
              f"finals {stream['final_delay_median_s']:.2f} s after each utterance (median), "
              f"{stream['interim_results']} interims, served RTF {stream['served_rtf']:.3f}", flush=True)  # fmt: skip
    finally:
        server.close()
    rows.append(_row("transformers generate", transformers_transcriber(folder, args.threads), audio, spans, args.reps))
    try:
        import ctranslate2  # noqa: F401
        import faster_whisper

        meta["faster_whisper"] = faster_whisper.__version__
    except ImportError as err:
        meta["faster_whisper"] = f"not installed ({err})"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ct2 = Path(tmp) / "ct2"
            converter = ctranslate2.converters.TransformersConverter(
                str(folder), copy_files=["tokenizer.json", "preprocessor_config.json"]
            )
            converter.convert(str(ct2), quantization="float32")
            for compute_type in ("float32", "int8"):
                fn = faster_whisper_transcriber(ct2, args.threads, compute_type)
                rows.append(_row(f"faster-whisper {compute_type}", fn, audio, spans, args.reps))
    result = {**meta, "load_average_at_end": list(os.getloadavg()), "rows": rows, "stream": stream}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
