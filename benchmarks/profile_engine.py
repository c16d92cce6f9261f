"""Where a decode step's time goes: omnivox's engine in-process under torch.profiler, at one batch size.

    python -m omnivox.benchmarks.profile_engine --model PATH --batch 1 --tokens 32

Prints the wall time per engine step, the share of it spent inside torch operators (the rest is Python: scheduling,
sampling bookkeeping, detokenising), and the operators that take the most time.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    import torch

    from omnivox.benchmarks.workload import WorkloadSpec, make_workload
    from omnivox.engine import Engine, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=15, help="operators to list")
    args = ap.parse_args(argv)

    engine = Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype)
    spec = WorkloadSpec(num_requests=args.batch, output_tokens=(args.tokens, args.tokens))
    prompts = [r.prompt_token_ids for r in make_workload(spec, engine.tokenizer)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
    steps0 = engine.num_steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    events = prof.key_averages()
    # Top-level operators only (self time of every aten op adds up to the time spent inside torch).
    in_torch = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
    print(f"batch {args.batch}, {args.tokens} tokens each: {steps} engine steps in {wall:.2f} s")
    print(
        f"{1e3 * wall / steps:.1f} ms per step; inside torch operators {in_torch:.2f} s ({in_torch / wall:.0%} of wall)"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
