"""Per-step grammar mask cost (engine/structured.py) for a realistic JSON schema on SmolLM2's 49 152-token vocabulary.

    python -m omnivox.benchmarks.structured_masks [--steps 200] [--out benchmarks/results/structured-masks-cpu.json]

Each of B rows walks through its own valid document for the schema (tokenized by SmolLM2's tokenizer), one token per
step, starting at different offsets, so the batch holds every kind of state (keys, strings, numbers, enums, between
items). A step is what the engine does: one `fill_next_token_bitmask_par` over the batch plus unpacking the bitmask
to the bool masks the sampler reads (`GrammarMasks._fill`), then each row consumes its token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from omnivox.benchmarks.host import write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 64},
                "email": {"type": "string", "format": "email"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items"],
    "additionalProperties": False,
}

DOCUMENTS = [
    {
        "order_id": "ABC-123456",
        "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
        "items": [
            {"sku": "KB-001", "quantity": 2, "price": 49.5, "gift": False},
            {"sku": "MS-17", "quantity": 1, "price": 19.99},
        ],
        "notes": "Leave at the door, please.",
    },
    {
        "order_id": "XYZ-000042",
        "customer": {"name": "Grace Hopper", "email": "grace@navy.mil", "tier": "enterprise"},
        "items": [{"sku": "COBOL-1959", "quantity": 100, "price": 0.5}],
        "notes": None,
    },
]


def run(steps: int, batches: list[int]) -> dict:
    import llguidance
    import torch

    from omnivox.engine.structured import GrammarMasks, compile_grammar, grammar_tokenizer, unpack_bitmask
    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.services.parts.defaults import ensure_default_model
    from omnivox.services.processing.structured import JSON_OPTIONS

    hf = load_tokenizer(ensure_default_model(progress=False))
    vocab = len(hf)
    eos = [hf.eos_token_id]
    t0 = time.perf_counter()
    tok = grammar_tokenizer(hf, vocab, eos)
    tokenizer_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    factory = compile_grammar(tok, grammar, vocab, eos)
    compile_s = time.perf_counter() - t0
    docs = [hf.encode(json.dumps(d, separators=(",", ":")), add_special_tokens=False) + eos for d in DOCUMENTS]
    results = []
    for batch in batches:
        masks = GrammarMasks(vocab)
        rows = [factory() for _ in range(batch)]
        plan = [(docs[i % len(docs)], (7 * i) % len(docs[i % len(docs)])) for i in range(batch)]
        for c, (doc, offset) in zip(rows, plan, strict=True):
            c.advance(doc[:offset])
        positions = [offset for _, offset in plan]
        fill_ms, single_ms = [], []
        for step in range(steps):
            t = time.perf_counter()
            masks._fill(rows)  # what overlaps the forward pass each step
            fill_ms.append((time.perf_counter() - t) * 1e3)
            for i, c in enumerate(rows):
                doc = plan[i][0]
                token = doc[positions[i]]
                assert c.allowed([])[token], (batch, step, i)  # the masks admit the document
                if positions[i] + 1 >= len(doc):  # document done: start it again
                    c.rollback(c.num_consumed)
                    positions[i] = 0
                else:
                    c.advance([token])
                    positions[i] += 1
            if batch == 1 or step % 10 == 0:  # the one-row path a constraint falls back to, for reference
                c = rows[0]
                c._mask_at = -1  # forget the batch's mask: time the one-row path
                t = time.perf_counter()
                c.allowed([])
                single_ms.append((time.perf_counter() - t) * 1e3)
        fill_ms.sort()
        bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
        unpack_ms = []
        for _ in range(20):
            t = time.perf_counter()
            unpack_bitmask(bitmask, vocab)
            unpack_ms.append((time.perf_counter() - t) * 1e3)
        results.append(
            {
                "batch": batch,
                "steps": steps,
                "fill_p50_ms": statistics.median(fill_ms),
                "fill_p90_ms": fill_ms[int(0.9 * len(fill_ms))],
                "fill_per_row_p50_us": statistics.median(fill_ms) * 1e3 / batch,
                "unpack_p50_ms": statistics.median(unpack_ms),
                "single_row_p50_ms": statistics.median(single_ms),
            }
        )
    return {
        "benchmark": "structured_masks",
        "vocab_size": vocab,
        "tokenizer_build_s": tokenizer_s,
        "grammar_compile_s": compile_s,
        "document_tokens": [len(d) for d in docs],
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    load = list(os.getloadavg())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = run(args.steps, [int(b) for b in args.batches.split(",")])
    result.update(started=started, commit=commit, load_average_at_start=load, cpus=os.cpu_count())
    print(format_table(result))
    if args.out is not None:
        write_results(args.out, result)


def format_table(result: dict) -> str:
    lines = [
        "| batch | mask fill p50 (ms) | p90 (ms) | per row p50 (µs) | of which unpacking (ms) | one-row path p50 (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['batch']} | {r['fill_p50_ms']:.3f} | {r['fill_p90_ms']:.3f} | {r['fill_per_row_p50_us']:.1f} "
            f"| {r['unpack_p50_ms']:.3f} | {r['single_row_p50_ms']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
