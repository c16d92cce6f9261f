"""Incremental detokenising, this code against an earlier commit's engine/detokenizer.py, A/B in one process.

    python -m omnivox.benchmarks.detokenize --before 6a98053 --tokens 2000 --repeats 5

Token sequences on the embedded SmolLM2 tokenizer, fed one token at a time as the output processor does
(skip_special_tokens=True): `mixed` (ordinary text tokens, characters split into byte tokens, runs of 1-12 special
tokens), `specials` (a sentence, then only special tokens), `text` (ordinary tokens only). Each variant must release
the same text; reported are tokens/s (median of the repeats) and the tokens handed to decode per token.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnivox.benchmarks.host import write_results

PHRASES = ["東京は日本の首都です。", " café, naïve", " 😀🎉", " 👍!", " Hello there, how are you?", " The fox."]


class _Counting:
    """A tokenizer that counts the tokens each decode call is given."""

    def __init__(self, tok) -> None:
        self.tok, self.tokens = tok, 0

    def decode(self, ids, **kwargs):
        self.tokens += len(ids)
        return self.tok.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def workloads(tok, n: int, seed: int = 0) -> dict[str, list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omnivox.engine.detokenizer import skipped_token_ids

    byte_chars = bytes_to_unicode()  # byte-level BPE's one token a byte
    rng = random.Random(seed)
    specials = sorted(skipped_token_ids(tok))
    encoded = [tok.encode(p, add_special_tokens=False) for p in PHRASES]
    text: list[int] = []
    while len(text) < n:
        text.extend(rng.choice(encoded))
    mixed: list[int] = []
    while len(mixed) < n:
        r = rng.random()
        if r < 0.5:
            mixed.extend(rng.choice(encoded))
        elif r < 0.7:
            mixed.extend(tok.convert_tokens_to_ids([byte_chars[b] for b in rng.choice("😀é東👍ü").encode()]))
        else:
            mixed.extend(rng.choice(specials) for _ in range(rng.randint(1, 12)))
    head = tok.encode("Hello there.", add_special_tokens=False)
    return {
        "mixed": mixed[:n],
        "specials": head + [specials[i % len(specials)] for i in range(n - len(head))],
        "text": text[:n],
    }


def load_detokenizer(source: str, name: str):
    """The IncrementalDetokenizer class of a detokenizer.py source text."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module.IncrementalDetokenizer


def run(cls, tok, prompt: list[int], ids: list[int]) -> tuple[float, str, int]:
    counting = _Counting(tok)
    t0 = time.perf_counter()
    detok = cls(counting, prompt, None, False, True)
    text = ""
    for t in ids:
        detok.add(t)
        text += detok.take(final=False)
    text += detok.take(final=True)
    return time.perf_counter() - t0, text, counting.tokens


def main(argv: list[str] | None = None) -> None:
    from omnivox.benchmarks.main import git_commit
    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.services.parts.defaults import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="6a98053", help="git revision whose engine/detokenizer.py is the baseline")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)

    root = Path(__file__).resolve().parents[1]
    old_source = subprocess.run(
        ["git", "show", f"{args.before}:engine/detokenizer.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    from omnivox.engine.detokenizer import IncrementalDetokenizer

    variants = {"before": load_detokenizer(old_source, "detokenizer_before"), "after": IncrementalDetokenizer}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    tok = load_tokenizer(ensure_default_model(progress=False))
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat, add_special_tokens=False)
    results: dict[str, dict] = {}
    for name, ids in workloads(tok, args.tokens).items():
        secs: dict[str, list[float]] = {v: [] for v in variants}
        texts, decoded = {}, {}
        for _ in range(args.repeats):
            for v, cls in variants.items():  # alternate, so both see the same machine
                s, texts[v], decoded[v] = run(cls, tok, list(prompt), ids)
                secs[v].append(s)
        assert texts["before"] == texts["after"], f"{name}: the two detokenizers released different text"
        tps = {v: len(ids) / statistics.median(s) for v, s in secs.items()}
        results[name] = {
            "tokens": len(ids),
            "tokens_per_s": tps,
            "decoded_tokens_per_token": {v: decoded[v] / len(ids) for v in variants},
            "speedup": tps["after"] / tps["before"],
        }
    result = {
        "benchmark": "detokenize",
        "started": started,
        "commit": git_commit(),
        "before": args.before,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "repeats": args.repeats,
        "python": sys.version.split()[0],
        "workloads": results,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
