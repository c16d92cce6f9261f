"""Speculative decoding (n-gram prompt lookup) against plain decoding, in one run, on one model, in-process.

- **Batch 1**, greedy, one request at a time: inter-token latency (mean gap between streamed tokens after the first)
  and per-user TPS (output tokens / time from first token to last), on two workloads: *repetitive* (the model is asked
  to repeat a given passage with one change, so its answer copies its prompt: what prompt lookup is for) and *chat*
  (short questions, answers that rarely repeat the prompt).
- **Total TPS** with 16 and 64 chat requests submitted together, speculation left on: the adaptive gate switches it
  off for batches that are compute-bound, so these should not get worse.
Greedy output is the same with and without speculation (the tests prove it); this measures only time.

`python -m omnivox.benchmarks.speculative [--model PATH] [--output results.json] [--k 4]`; default model: the
embedded SmolLM2-135M-Instruct, float32 as served by default.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results
from omnivox.engine import Engine, SamplingParams
from omnivox.engine.speculative import NgramProposer

PASSAGE = Path(__file__).with_name("data") / "pride_and_prejudice.txt"
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "Give me a tip for learning a language.",
]


def repetitive_prompts(n: int = 3) -> list[str]:
    words = PASSAGE.read_text().split()
    out = []
    for i in range(n):
        passage = " ".join(words[i * 60 : i * 60 + 60])
        out.append(f"Repeat this passage exactly, word for word, but write 'Mr.' as 'Mister':\n\n{passage}")
    return out


def chat_ids(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def timed_solo(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float, int, int]:
    """(mean ITL s, per-user TPS, drafted, accepted) of one request stepped alone."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    stamps: list[tuple[float, int]] = []
    drafted = accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                stamps.append((time.perf_counter(), len(out.new_token_ids)))
        drafted += engine.last_step.stats.num_drafted
        accepted += engine.last_step.stats.num_accepted
    tokens = sum(n for _, n in stamps)
    span = stamps[-1][0] - stamps[0][0]
    gaps = tokens - stamps[0][1]
    return (span / gaps if gaps else float("nan")), (gaps / span if span else float("nan")), drafted, accepted


def step_ms(model: str, k: int) -> float:
    """Median engine step (ms) of one decoding request: a plain one-token step (k = 0) or a verify step of the last
    token plus k drafts (always proposed, whatever their acceptance)."""
    proposer = (lambda req: [5] * k) if k else None
    engine = Engine.from_pretrained(model, device="cpu", kv_cache_gib=0.5, proposer=proposer)
    if k:
        engine.core.gate.min_acceptance = 0.0
    engine.add_request(list(range(100, 180)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[5:])


def total_tps(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder or .gguf (default: the embedded default)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--output", type=Path, help="write the results JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from omnivox.services.parts.defaults import ensure_default_model

        args.model = str(ensure_default_model(progress=False))
    engines = {
        "plain": Engine.from_pretrained(args.model, device="cpu", kv_cache_gib=0.5),
        "ngram": Engine.from_pretrained(args.model, device="cpu", kv_cache_gib=0.5, proposer=NgramProposer(k=args.k)),
    }
    results: dict = {
        "model": args.model,
        "k": args.k,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "load_average_at_start": list(os.getloadavg()),
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "batch1": {},
        "total_tps": {},
    }
    base = engines["plain"]
    workloads = {
        "repetitive": [chat_ids(base, p) for p in repetitive_prompts()],
        "chat": [chat_ids(base, p) for p in CHAT[:3]],
    }
    for wname, prompts in workloads.items():
        for mode, engine in engines.items():  # the two modes alternate per prompt: same machine conditions
            itl, tps, drafted, accepted = [], [], 0, 0
            for p in prompts:
                a, b, d, acc = timed_solo(engine, p, 96)
                itl.append(a)
                tps.append(b)
                drafted, accepted = drafted + d, accepted + acc
            results["batch1"].setdefault(wname, {})[mode] = {
                "itl_ms": 1000 * statistics.median(itl),
                "per_user_tps": statistics.median(tps),
                "drafted": drafted,
                "accepted": accepted,
            }
            print(wname, mode, results["batch1"][wname][mode], flush=True)
    results["step_ms"] = {"plain": step_ms(args.model, 0), f"verify_1+{args.k}": step_ms(args.model, args.k)}
    print("steps", results["step_ms"], flush=True)
    chat = [chat_ids(base, p) for p in CHAT]
    for n in (16, 64):
        prompts = [chat[i % len(chat)] for i in range(n)]
        for mode, engine in engines.items():
            results["total_tps"].setdefault(str(n), {})[mode] = total_tps(engine, prompts, 48)
            print("total", n, mode, results["total_tps"][str(n)][mode], flush=True)
    if args.output:
        write_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
