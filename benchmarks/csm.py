"""CSM speech on CPU: omnivox's engine (frame step + Mimi) against transformers' own generate loop, in one run.

    python -m omnivox.benchmarks.csm --frames 6 --streams 1,4 --out benchmarks/results/csm_cpu.json

A random-weight checkpoint of sesame/csm-1b's shape (models/csm_random.py CSM_1B_SHAPE: 16-layer 2048-wide Llama
backbone, 4-layer depth decoder, 32 codebooks, Mimi; the text vocabulary is SmolLM2's 49k, not Llama 3's 128k: the
embedding is only looked up) in float32. For each stream count, the same prompts through
- transformers: `CsmForConditionalGeneration.generate` (a batch of the prompts, sampled), a streamer timing the
  first frame, then `codec_model.decode` of the frames;
- omnivox: the engine (continuous batching, the depth decoder batched per step), then our Mimi decode;
reporting time to first audio (first frame + its codec pass), real-time factor (engine + codec seconds over audio
seconds, 80 ms per frame) and frames (engine steps) per second per stream. Random weights: the speed is a trained
model's, the audio is noise. transformers runs first and is freed before omnivox loads (one 5.5 GB copy at a time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

FRAME_SECONDS = 0.08  # Mimi: 12.5 frames per second


def _transformers_run(path: Path, prompts: list[list[int]], frames: int) -> dict:
    import torch
    from transformers import CsmForConditionalGeneration
    from transformers.generation.streamers import BaseStreamer

    model = CsmForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    class FirstFrame(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    streamer = FirstFrame()
    ids = torch.tensor(prompts)  # equal lengths: no padding
    with torch.no_grad():
        t0 = time.perf_counter()
        codes = model.generate(ids, max_new_tokens=frames, streamer=streamer)
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        model.codec_model.decode(codes[:1, :1].transpose(1, 2))  # one frame: the first audio's codec pass
        t_first_codec = time.perf_counter() - t1
        t2 = time.perf_counter()
        for row in codes:
            model.codec_model.decode(row.T[None].clamp(max=2047))
        t_codec = time.perf_counter() - t2
    # streamer.put is called with the prompt first (generate's convention), then once per frame
    first = streamer.times[1] - t0 if len(streamer.times) > 1 else t_gen
    del model
    gc.collect()
    n = len(prompts)
    return {
        "time_to_first_audio_s": first + t_first_codec,
        "engine_seconds": t_gen,
        "codec_seconds": t_codec,
        "real_time_factor": (t_gen + t_codec) / (n * frames * FRAME_SECONDS),
        "frames_per_second_per_stream": frames / t_gen,
    }


def _omnivox_run(engine, codec, prompts: list[list[int]], frames: int) -> dict:
    import torch

    from omnivox.engine import SamplingParams

    first: dict[str, float] = {}
    outs: dict[str, list] = {}

    def collect(out) -> None:
        first.setdefault(out.request_id, time.perf_counter())
        if out.finished:
            outs[out.request_id] = out.frames

    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.9, top_k=50, seed=i, max_tokens=frames)
        engine.add_request(prompt, params, request_id=f"r{i}", on_output=collect)
    while engine.has_unfinished():
        engine.step()
    t_gen = time.perf_counter() - t0
    first_frame = min(first.values()) - t0
    t1 = time.perf_counter()
    codec.decode_chunk(torch.tensor(outs["r0"][:1]).T[None].clamp(max=2047), codec.new_state(1))
    t_first_codec = time.perf_counter() - t1
    t2 = time.perf_counter()
    for rid in sorted(outs):
        codec.decode(torch.tensor(outs[rid]).T[None].clamp(max=2047))
    t_codec = time.perf_counter() - t2
    n = len(prompts)
    return {
        "time_to_first_audio_s": first_frame + t_first_codec,
        "engine_seconds": t_gen,
        "codec_seconds": t_codec,
        "real_time_factor": (t_gen + t_codec) / (n * frames * FRAME_SECONDS),
        "frames_per_second_per_stream": frames / t_gen,
        "frames": [len(outs[r]) for r in sorted(outs)],
    }


def main(argv: list[str] | None = None) -> None:
    import torch

    from omnivox.benchmarks.host import write_results
    from omnivox.benchmarks.main import git_commit
    from omnivox.codecs.mimi import MimiDecoder
    from omnivox.engine import Engine
    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.models.csm_random import CSM_1B_SHAPE, save_random_csm
    from omnivox.services.parts.csm_part import CsmLayout
    from omnivox.services.parts.defaults import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=6, help="frames (80 ms each) per stream")
    ap.add_argument("--streams", default="1,4", help="stream counts, comma-separated")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))))
    counts = [int(c) for c in args.streams.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    result: dict = {"benchmark": "csm", "started": started, "commit": git_commit(), "load_average_at_start": load,
                    "frames": args.frames, "threads": torch.get_num_threads(), "shape": "csm-1b (random weights)",
                    "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = save_random_csm(Path(tmp) / "csm-1b", CSM_1B_SHAPE, load_tokenizer(ensure_default_model()), seed=0)
        result["build_seconds"] = time.perf_counter() - t
        tokenizer = load_tokenizer(path)
        layout = CsmLayout(num_codebooks=32, codebook_size=2048, eos_code=0, sample_rate=24000)
        prompt = layout.build_prompt(tokenizer, "A sentence for the benchmark, spoken by speaker zero.", "0")
        for n in counts:
            result["runs"].setdefault(str(n), {})["transformers"] = _transformers_run(path, [prompt] * n, args.frames)
            print(json.dumps({n: result["runs"][str(n)]}), flush=True)
        engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_num_seqs=max(counts))
        codec = MimiDecoder.from_folder(path, prefix="codec_model.")
        _omnivox_run(engine, codec, [prompt], 1)  # warm-up: the C kernels' first build, allocations
        for n in counts:
            result["runs"][str(n)]["omnivox"] = _omnivox_run(engine, codec, [prompt] * n, args.frames)
            print(json.dumps({n: result["runs"][str(n)]}), flush=True)
    for runs in result["runs"].values():
        ours, theirs = runs["omnivox"], runs["transformers"]
        runs["speedup_frames_per_second"] = (
            ours["frames_per_second_per_stream"] / theirs["frames_per_second_per_stream"]
        )
        runs["ttfa_ratio"] = ours["time_to_first_audio_s"] / theirs["time_to_first_audio_s"]
    result["load_average_at_end"] = list(os.getloadavg())
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
