"""Measure candidate sampling defaults for the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

    .venv/bin/python -m omnivox.benchmarks.sampling_defaults [--seeds 10] [--out results.json]

A fixed set of factual and chat prompts, each with the words a correct answer contains, is run through the engine
(prompts built by the service's own chat-template builder) under each candidate setting with several seeds. A reply
scores when it holds one of its prompt's words (case-insensitive); a reply that runs to the token limit counts as
"rambling". The numbers and the choice are in services/parts/data/README.md, next to the shipped generation_config.json.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from omnivox.benchmarks.host import write_results

# (prompt, words of which a correct reply holds one). Factual first, then chat-style asks with a checkable core.
PROMPTS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("What is the chemical symbol for water?", ("h2o", "h₂o")),
    ("How many days are there in a week?", ("seven", "7")),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What gas do plants absorb from the air?", ("carbon dioxide", "co2")),
    ("What is the freezing point of water in degrees Celsius?", ("0", "zero")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is 2 + 2?", ("4", "four")),
    ("Hi! Can you tell me what language people speak in Spain?", ("spanish",)),
    ("I need a word that means the opposite of hot.", ("cold", "cool")),
    ("Please name the ocean between Europe and America.", ("atlantic",)),
    ("Tell me which animal says 'moo'.", ("cow",)),
]

CANDIDATES: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0},
    "greedy rep1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "t1.0 (engine default)": {"temperature": 1.0},
    "t0.2 top_p0.9 (model card)": {"temperature": 0.2, "top_p": 0.9},
    "t0.2 top_k3": {"temperature": 0.2, "top_k": 3},
    "t0.2 min_p0.2": {"temperature": 0.2, "min_p": 0.2},
    "t0.3 min_p0.1": {"temperature": 0.3, "min_p": 0.1},
    "t0.3 top_p0.9 min_p0.1": {"temperature": 0.3, "top_p": 0.9, "min_p": 0.1},
    "t0.1 top_p0.9": {"temperature": 0.1, "top_p": 0.9},
    "t0.1": {"temperature": 0.1},
    "t0.1 rep1.1": {"temperature": 0.1, "repetition_penalty": 1.1},
    # A nucleus of 0.5 keeps only the top token wherever it holds more than half the mass (the first token of the
    # France answer: "The" 0.55 at t=0.2), and samples among the few leading tokens where the model is unsure.
    "t0.2 top_p0.5": {"temperature": 0.2, "top_p": 0.5},
    "t0.3 top_p0.5": {"temperature": 0.3, "top_p": 0.5},
    "t0.5 top_p0.5": {"temperature": 0.5, "top_p": 0.5},
    "t0.7 top_p0.5": {"temperature": 0.7, "top_p": 0.5},
    "t0.3 top_p0.7": {"temperature": 0.3, "top_p": 0.7},
    "t0.2 min_p0.7": {"temperature": 0.2, "min_p": 0.7},
}


@dataclass
class Score:
    correct: int = 0
    rambling: int = 0
    runs: int = 0
    france: int = 0
    france_runs: int = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="write the measurement as JSON here")
    parser.add_argument("--only", nargs="*", help="measure only these candidates (names as in CANDIDATES)")
    args = parser.parse_args()

    import torch

    from omnivox.engine import Engine, SamplingParams
    from omnivox.services.parts.defaults import ensure_default_model
    from omnivox.services.processing.prompt import ChatPromptBuilder
    from omnivox.v1 import content_pb2

    torch.set_num_threads(1)
    path = ensure_default_model(progress=False)
    engine = Engine.from_pretrained(str(path), device="cpu", kv_cache_gib=0.5, max_num_seqs=64)
    builder = ChatPromptBuilder(engine.tokenizer)
    token_ids = [
        builder.build([content_pb2.Content(role="user", parts=[content_pb2.Part(text=p)])]).token_ids
        for p, _ in PROMPTS
    ]
    results: dict[str, dict] = {}
    for name, setting in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        greedy = setting.get("temperature") == 0.0
        seeds = [0] if greedy else list(range(args.seeds))
        prompts, params, keys = [], [], []
        for seed in seeds:
            for i, ids in enumerate(token_ids):
                prompts.append(ids)
                params.append(SamplingParams(**setting, seed=seed, max_tokens=args.max_tokens))
                keys.append(i)
        start = time.monotonic()
        outs = engine.generate(prompts, params)
        score = Score()
        wrong: dict[str, int] = {}
        for i, out in zip(keys, outs, strict=True):
            weight = args.seeds if greedy else 1  # a greedy reply stands for every seed
            text = out.text.lower()
            ok = any(w in text for w in PROMPTS[i][1])
            score.runs += weight
            score.correct += weight * ok
            score.rambling += weight * (out.finish_reason == "length")
            if i == 0:
                score.france_runs += weight
                score.france += weight * ok
            if not ok:
                wrong[PROMPTS[i][0]] = wrong.get(PROMPTS[i][0], 0) + weight
        results[name] = {
            "setting": setting,
            "correct": score.correct,
            "runs": score.runs,
            "accuracy": round(score.correct / score.runs, 3),
            "rambling": round(score.rambling / score.runs, 3),
            "france_paris": f"{score.france}/{score.france_runs}",
            "wrong_by_prompt": wrong,
            "sample_france": outs[0].text[:120],
        }
        print(
            f"{name:28s} accuracy {score.correct / score.runs:6.1%}  Paris {score.france}/{score.france_runs}  "
            f"length-capped {score.rambling / score.runs:5.1%}  ({time.monotonic() - start:.0f} s)",
            flush=True,
        )
    engine.shutdown()
    if args.out:
        result = {"model": path.name, "seeds": args.seeds, "max_tokens": args.max_tokens, "prompts": PROMPTS}
        write_results(args.out, result | {"results": results}, indent=1)


if __name__ == "__main__":
    main()
