"""Decode past a sliding window against full attention over the same context, A/B in one process on the same weights.

    python -m omnivox.benchmarks.sliding_window --context 1024 --window 256 --batch 1 4 --repeats 3

One random Mistral-shaped checkpoint is saved twice, identical but for `sliding_window` (null, and --window). Each
variant prefills --context tokens per request and decodes --steps tokens; the decode time per step is the time of
(context + steps) minus the time of the prefill alone, over steps. Past the window the windowed model's decode rows
take the gathered attention path (the paged C kernel and the fused CPU step know only lengths), so this measures what
a window costs on CPU where it bites.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from omnivox.benchmarks.host import write_results


def main(argv: list[str] | None = None) -> None:
    import torch
    import transformers

    from omnivox.benchmarks.main import git_commit
    from omnivox.engine import Engine, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests decoding together")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    config = transformers.MistralConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=4 * (args.context + args.steps),
        sliding_window=None,
    )
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        full = Path(tmp) / "full"
        transformers.MistralForCausalLM(config).save_pretrained(full)
        windowed = Path(tmp) / "windowed"
        shutil.copytree(full, windowed)
        saved = json.loads((windowed / "config.json").read_text())
        (windowed / "config.json").write_text(json.dumps(saved | {"sliding_window": args.window}))
        max_seqs = max(args.batch)
        kv = 2 * args.layers * config.num_key_value_heads * 64 * 4 * max_seqs * (args.context + args.steps + 32)
        for name, path in (("full", full), ("windowed", windowed)):
            engines[name] = Engine.from_pretrained(
                path, device="cpu", dtype="float32", kv_cache_gib=kv / 2**30, max_num_seqs=max_seqs
            )
    gen = torch.Generator().manual_seed(1)
    results: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batch} for name in engines}
    for _ in range(args.repeats):
        for b in args.batch:
            prompts = [torch.randint(3, 32000, (args.context,), generator=gen).tolist() for _ in range(b)]
            for name, engine in engines.items():  # A/B on the same prompts, alternating
                engine.core.pool.enable_prefix_caching = False  # every run prefills
                t0 = time.perf_counter()
                engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                t1 = time.perf_counter()
                engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True))
                t2 = time.perf_counter()
                results[name][b].append(((t2 - t1) - (t1 - t0)) / args.steps * 1000)
    report = {
        "benchmark": "sliding_window",
        "started": started,
        "commit": git_commit(),
        "load_avg_at_start": load,
        "threads": torch.get_num_threads(),
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 32000, "kv_heads": config.num_key_value_heads},
        "context": args.context,
        "window": args.window,
        "steps": args.steps,
        "decode_ms_per_step_median": {
            name: {str(b): statistics.median(v) for b, v in by_batch.items()} for name, by_batch in results.items()
        },
        "ratio_windowed_over_full": {
            str(b): statistics.median(results["windowed"][b]) / statistics.median(results["full"][b])
            for b in args.batch
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        write_results(args.out, report)


if __name__ == "__main__":
    main()
