"""SNAC decode cost on CPU: seconds of codec time per second of audio, before and after the faster convolutions.

    python -m omnivox.benchmarks.codec [--frames 141] [--threads 1] [--out benchmarks/results/codec-cpu.json]

One run measures every variant on the same random full-size 24 kHz SNAC and the same codes: the unmodified float32
decoder (`fast_convs=False`) and the fast one, each one-shot (the whole utterance in one pass) and streamed through
`BatchedStreamDecoder` (windows with 2 frames of context each side; hop 8, and hop 16), for 1 and 2 streams at once,
frames arriving one at a time per stream as the engine produces them (the ready windows decoded after each).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from omnivox.codecs.snac import SnacDecoder, save_random_snac
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

ORPHEUS_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=141, help="frames per stream (141 = 12 s of audio)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    folder = save_random_snac(Path(tempfile.mkdtemp()) / "snac", seed=0)
    decoders = {
        "float32 (before)": SnacDecoder.from_folder(folder, fast_convs=False),
        "fast convs (after)": SnacDecoder.from_folder(folder),
    }
    g = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, 4096, (args.frames, 7), generator=g) for _ in range(2)]
    audio_s = args.frames * 2048 / 24000
    rows = []
    for name, dec in decoders.items():
        rows.append(
            {
                "decoder": name,
                "mode": "one-shot",
                "streams": 1,
                "s_per_audio_s": _time(lambda d=dec: d.decode_frames(frames[0][None], ORPHEUS_LEVELS), args.reps)
                / audio_s,
            }
        )
        for hop in (8, 16):
            bsd = BatchedStreamDecoder(dec, ORPHEUS_LEVELS, StreamingOptions(hop_frames=hop))
            for streams in (1, 2):

                def run(bsd=bsd, streams=streams) -> None:
                    # As in serving: every stream receives a frame, then the windows ready now are decoded together.
                    states = [bsd.open_stream() for _ in range(streams)]
                    rows = [f.tolist() for f in frames[:streams]]
                    for i in range(args.frames):
                        for s, r in zip(states, rows, strict=True):
                            s.push_frame(r[i])
                        bsd.decode_ready(states)
                    for s in states:
                        s.finish()
                    bsd.decode_ready(states)

                per = _time(run, args.reps) / (audio_s * streams)
                rows.append({"decoder": name, "mode": f"streamed hop {hop}", "streams": streams, "s_per_audio_s": per})
        for r in rows[-5:]:
            print(f"{r['decoder']:20s} {r['mode']:16s} streams={r['streams']}  {r['s_per_audio_s']:.3f} s per audio s")
    report = {
        "started": started,
        "load_average_at_end": os.getloadavg(),
        "threads": args.threads,
        "frames": args.frames,
        "audio_s_per_stream": audio_s,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
