"""Per-step output processing (stop rules, detokenizer, the RequestOutput handed out) at short and long outputs, this
code against an earlier commit's engine/outputs.py + detokenizer.py + output_processor.py, A/B in one process.

    python -m omnivox.benchmarks.output_processing --before HEAD~1 --lengths 100 4000 --repeats 5

One request's output processor is fed `length` tokens one step at a time (a tiny byte-level BPE tokenizer trained
here, English text, a stop string so the stop search runs, with and without logprobs), then the next --steps steps
are timed: the cost of one step at that output length, median over the repeats, variants alternated. A step whose
cost grows with the length (copying every token, the text and the logprobs so far into each output) shows as a
ratio long / short well above 1.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnivox.benchmarks.host import write_results

CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Speech synthesis turns text into audio; "
    "vision models read images. Hello there! How are you today? I am fine, thank you. "
)
_MODULES = ("outputs", "detokenizer", "output_processor")


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def load_before(root: Path, rev: str):
    """The OutputProcessor class of `rev`, with its own outputs and detokenizer modules."""
    loaded = {}
    for name in _MODULES:
        source = subprocess.run(
            ["git", "show", f"{rev}:engine/{name}.py"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        for other in _MODULES:
            source = source.replace(f"omnivox.engine.{other} import", f"_before_{other} import")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"_before_{name}", f.name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"_before_{name}"] = module
        spec.loader.exec_module(module)
        os.unlink(f.name)
        loaded[name] = module
    return loaded["output_processor"].OutputProcessor, loaded["outputs"].TokenLogprob


def step_cost(processor_cls, logprob_cls, tok, ids: list[int], length: int, steps: int, logprobs: bool) -> float:
    """Seconds per step over `steps` steps after `length` tokens."""
    from omnivox.engine.params import SamplingParams
    from omnivox.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=length + steps + 1, ignore_eos=True, stop=["\n\n"])
    params.logprobs = 1 if logprobs else None
    req = Request("r", [tok.bos_token_id], params, length + steps + 1, ())
    proc = processor_cls(tok, 10**6)
    proc.add(req, None)
    lp = [logprob_cls(0, -0.5, ((0, -0.5),))] if logprobs else [None]
    for i in range(length):
        req.output_token_ids.append(ids[i % len(ids)])
        proc.process(req, req.output_token_ids[-1:], lp, 0.0)
    gc.collect()  # each variant's timed steps start from the same collector state
    t0 = time.perf_counter()
    for i in range(length, length + steps):
        req.output_token_ids.append(ids[i % len(ids)])
        proc.process(req, req.output_token_ids[-1:], lp, 0.0)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    from omnivox.benchmarks.main import git_commit
    from omnivox.engine.output_processor import OutputProcessor
    from omnivox.engine.outputs import TokenLogprob

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD~1", help="git revision whose output side is the baseline")
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 4000])
    ap.add_argument("--steps", type=int, default=200, help="steps timed after each length")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)

    root = Path(__file__).resolve().parents[1]
    variants = {"before": load_before(root, args.before), "after": (OutputProcessor, TokenLogprob)}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    tok = tiny_tokenizer()
    ids = tok.encode(CORPUS * 4, add_special_tokens=False)
    results: dict[str, dict] = {}
    for logprobs in (False, True):
        case = "logprobs" if logprobs else "plain"
        us: dict[str, dict[int, list[float]]] = {v: {n: [] for n in args.lengths} for v in variants}
        for _ in range(args.repeats):
            for n in args.lengths:
                for v, (cls, lp_cls) in variants.items():  # alternated, so both see the same machine
                    us[v][n].append(1e6 * step_cost(cls, lp_cls, tok, ids, n, args.steps, logprobs))
        med = {v: {n: statistics.median(s) for n, s in per.items()} for v, per in us.items()}
        lo, hi = min(args.lengths), max(args.lengths)
        results[case] = {
            "us_per_step": {v: {str(n): round(m, 2) for n, m in per.items()} for v, per in med.items()},
            "long_over_short": {v: round(per[hi] / per[lo], 2) for v, per in med.items()},
        }
    result = {
        "benchmark": "output_processing",
        "started": started,
        "commit": git_commit(),
        "before": args.before,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "repeats": args.repeats,
        "steps": args.steps,
        "python": sys.version.split()[0],
        "cases": results,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
