"""The engine step of speech requests with and without detokenising their audio tokens, A/B in one process.

    python -m omnivox.benchmarks.speech_step --streams 2 --frames 50 --repeats 5

Speech requests (Orpheus layout and sampling, the speech token constraint) on the random speech decoder, run with
`detokenize=True` and `detokenize=False` alternately, repeat by repeat, on the same seeds: the token ids must be
identical, and the step times are compared (median ms per engine step of each variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from omnivox.benchmarks.host import write_results


def main(argv: list[str] | None = None) -> None:
    import torch

    from omnivox.benchmarks.main import git_commit
    from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
    from omnivox.engine import Engine, SamplingParams, shared
    from omnivox.engine.detokenizer import IncrementalDetokenizer
    from omnivox.models.orpheus import SpeechLayout, SpeechTokenConstraint
    from omnivox.services.parts.defaults import save_random_speech_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=2, help="speech requests run together")
    ap.add_argument("--frames", type=int, default=50, help="audio frames (7 tokens each) per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        small_snac = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)  # the codec is not run here
        path = save_random_speech_model(Path(tmp) / "speech", snac_config=small_snac)
        engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
        layout = SpeechLayout.load(path)
        assert layout is not None
    constraint = SpeechTokenConstraint(layout, engine.model_config.vocab_size)
    texts = [f"Sentence number {i}, spoken by the random decoder." for i in range(args.streams)]
    prompts = [layout.build_prompt(engine.tokenizer, t) for t in texts]
    base = dict(
        temperature=layout.temperature,
        top_p=layout.top_p,
        repetition_penalty=layout.repetition_penalty,
        max_tokens=args.frames * layout.frame_size,
        stop_token_ids=[layout.end_of_speech],
        constraint_factory=shared(constraint),
    )

    def run(detokenize: bool) -> tuple[float, list[list[int]], int]:
        for i, prompt in enumerate(prompts):
            params = SamplingParams(**base, seed=100 + i, detokenize=detokenize)  # type: ignore[arg-type]
            engine.add_request(prompt, params, request_id=f"{detokenize}-{i}-{time.monotonic_ns()}")
        done: dict[str, list[int]] = {}
        steps0, t0 = engine.num_steps, time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        wall = time.perf_counter() - t0
        steps = engine.num_steps - steps0
        return 1e3 * wall / steps, [done[k] for k in sorted(done)], steps

    run(True), run(False)  # warm up
    ms: dict[str, list[float]] = {"detokenize": [], "token_ids_only": []}
    tokens: dict[str, list[list[int]]] = {}
    steps = 0
    for _ in range(args.repeats):
        for name, flag in (("detokenize", True), ("token_ids_only", False)):
            step_ms, ids, steps = run(flag)
            ms[name].append(step_ms)
            assert tokens.setdefault(name, ids) == ids, "a seeded run must repeat its tokens"
    identical = tokens["detokenize"] == tokens["token_ids_only"]

    # The detokenising alone, on the same ids, as the output processor does it (one token at a time): less noisy on
    # a shared machine than the difference of two step times.
    detok_s = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for prompt, ids in zip(prompts, tokens["detokenize"], strict=True):
            detok = IncrementalDetokenizer(engine.tokenizer, prompt, None, False, True)
            for token in ids:
                detok.add(token)
            detok.take(final=True)
        detok_s.append(time.perf_counter() - t0)
    before, after = statistics.median(ms["detokenize"]), statistics.median(ms["token_ids_only"])
    result = {
        "benchmark": "speech_step",
        "started": started,
        "commit": git_commit(),
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "streams": args.streams,
        "frames": args.frames,
        "repeats": args.repeats,
        "steps_per_run": steps,
        "step_ms": ms,
        "median_step_ms": {"detokenize": before, "token_ids_only": after},
        "min_step_ms": {name: min(v) for name, v in ms.items()},
        "detokenizing_ms_per_step": 1e3 * statistics.median(detok_s) / steps,
        "ratio": after / before,
        "identical_token_ids": identical,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
