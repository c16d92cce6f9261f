"""SNAC decode cost on CPU: seconds of codec time per second of audio, for each form of the decoder.

    python -m omnivox.benchmarks.codec [--frames 141] [--threads 1] [--out benchmarks/results/codec-cpu.json]

One run measures every variant on the same random full-size 24 kHz SNAC and the same codes: the unmodified float32
decoder (`fast_convs=False`), the fast convolutions in torch (`c_kernels=False`) and with the C kernels (the default:
codecs/codec_kernels.py), each one-shot (the whole utterance in one pass) and streamed through `BatchedStreamDecoder`
at hop 16 with 2 and with 1 frame of context each side, for 1 and 2 streams at once, frames arriving one at a time per
stream as the engine produces them (the ready windows decoded after each). Variants alternate repeat by repeat, and
each streamed variant's largest difference from the float32 one-shot decode is recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from omnivox.benchmarks.host import write_results
from omnivox.codecs.snac import SnacDecoder, save_random_snac
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions

ORPHEUS_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=141, help="frames per stream (141 = 12 s of audio)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from omnivox.benchmarks.main import git_commit

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    folder = save_random_snac(Path(tempfile.mkdtemp()) / "snac", seed=0)
    decoders = {
        "float32 as built": SnacDecoder.from_folder(folder, fast_convs=False),
        "fast convs, torch": SnacDecoder.from_folder(folder, c_kernels=False),
        "fast convs + C kernels": SnacDecoder.from_folder(folder),
    }
    g = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, 4096, (args.frames, 7), generator=g) for _ in range(2)]
    audio_s = args.frames * 2048 / 24000
    reference = decoders["float32 as built"].decode_frames(frames[0][None], ORPHEUS_LEVELS)[0].numpy()
    cases = []  # (decoder, mode, streams, context, fn)
    for name, dec in decoders.items():
        cases.append((name, "one-shot", 1, None, lambda d=dec: d.decode_frames(frames[0][None], ORPHEUS_LEVELS)))
        for context in (2, 1):
            opts = StreamingOptions(hop_frames=16, left_context_frames=context, lookahead_frames=context)
            bsd = BatchedStreamDecoder(dec, ORPHEUS_LEVELS, opts)
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

                cases.append((name, f"streamed hop 16, context {context}", streams, bsd, run))
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.reps + 1):  # the first round warms up
        for k, (*_, fn) in enumerate(cases):
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    rows = []
    for (name, mode, streams, bsd, _), t in zip(cases, times, strict=True):
        row = {"decoder": name, "mode": mode, "streams": streams}
        row["s_per_audio_s"] = float(np.median(t[1:])) / (audio_s * streams)
        if bsd is not None and streams == 1:
            row["max_abs_diff_vs_float32_one_shot"] = float(np.abs(bsd.decode_all(frames[0]) - reference).max())
        rows.append(row)
        diff = row.get("max_abs_diff_vs_float32_one_shot")
        print(
            f"{name:24s} {mode:28s} streams={streams}  {row['s_per_audio_s']:.3f} s per audio s"
            + (f"  max diff {diff:.1e}" if diff is not None else "")
        )
    report = {
        "started": started,
        "commit": git_commit(),
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "command": "python -m omnivox.benchmarks.codec " + " ".join(sys.argv[1:]),
        "threads": args.threads,
        "frames": args.frames,
        "audio_s_per_stream": audio_s,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, report)


if __name__ == "__main__":
    main()
