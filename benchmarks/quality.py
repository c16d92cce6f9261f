"""Quality and speed of quantised weights against float32, measured in one run on one model.

- **Perplexity** of each quantisation on a fixed English text shipped here (`data/pride_and_prejudice.txt`: the first
  chapters of Jane Austen's *Pride and Prejudice*, 1813, public domain, written out for this benchmark; ~3 900 SmolLM2
  tokens), every token predicted from all before it through the model's own paged KV cache. Twice: in steps of 16
  rows (`perplexity`: the quantised kernels with int16 activations, as decode runs them) and in prefill chunks of 256
  rows (`perplexity_prefill`: layers dequantised for float GEMM, i.e. the weights' quantisation alone).
- **Greedy agreement** with float32 over 64 tokens on 20 fixed prompts (chat template applied): the mean share of
  the 64 tokens before the first divergence, how many of the 20 continuations are identical, and the teacher-forced
  top-1 agreement (each position predicted from float32's own continuation).
- **Speed** through the engine in-process: batch-1 ITL (one request, the time for 64 decode steps), and total TPS
  with 16 requests of 64 tokens submitted together (prefill included).

`python -m omnivox.benchmarks.quality [--model PATH] [--modes none,int8,int4,native] [--no-quality | --no-speed]
[--passes N] [--output results.json]`;
the default model is the embedded SmolLM2-135M-Instruct (Q4_1 GGUF): mode "native" serves it at its own precision.
A mode suffixed "/a8" (e.g. "native/a8") runs the decoder layers' many-row VNNI kernel with 8-bit activations
(llama.cpp's Q8_1) instead of 15 bits (`quant.set_act_bits`); the lm_head keeps 15.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results
from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.decoder import DecoderModel

TEXT = Path(__file__).with_name("data") / "pride_and_prejudice.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "What is a prime number?",
    "Suggest a name for a bakery.",
    "Summarise the story of Cinderella.",
    "What should I pack for a beach holiday?",
    "How does a bicycle stay upright?",
    "Write a short thank-you note to a teacher.",
    "What are the three states of matter?",
    "Tell me a fun fact about octopuses.",
    "How do vaccines work?",
]
GREEDY_TOKENS = 64
CHUNK = 16  # rows per step: below quant.LARGE_BATCH, so the block kernels run
PREFILL_CHUNK = 256
BLOCK = 16


class SequenceCache:
    """A private paged KV cache for one sequence (contiguous blocks), enough for `max_len` tokens."""

    def __init__(self, model: DecoderModel, max_len: int) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        blocks = -(-max_len // BLOCK)
        shape = (blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
        self.table = torch.arange(blocks)
        self.len = 0

    def forward(self, model: DecoderModel, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] float32 logits
        start, n = self.len, len(ids)
        self.len += n
        chunk = PrefillChunk(0, n, self.len, self.table[: -(-self.len // BLOCK)])
        meta = AttentionMetadata(BLOCK, torch.arange(start, start + n), 0, None, None, None, [chunk])
        hidden = model(torch.tensor(ids), torch.arange(start, start + n), self.kv, meta)
        return model.compute_logits(hidden)


@torch.inference_mode()
def perplexity(model: DecoderModel, ids: list[int], chunk: int = CHUNK) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given everything before, in prefill chunks of `chunk` tokens."""
    cache = SequenceCache(model, len(ids))
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, chunk):
        piece = ids[s : min(s + chunk, len(ids) - 1)]
        logp = cache.forward(model, piece).log_softmax(-1)
        targets = torch.tensor(ids[s + 1 : s + 1 + len(piece)])
        nll -= logp.gather(1, targets[:, None]).sum().item()
        count += len(piece)
    return math.exp(nll / count)


@torch.inference_mode()
def greedy(model: DecoderModel, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt (prefill, then one-row decode steps: the batch-1 path of every layer)."""
    cache = SequenceCache(model, len(prompt) + n)
    out = [int(cache.forward(model, prompt)[-1].argmax())]
    while len(out) < n:
        out.append(int(cache.forward(model, out[-1:])[-1].argmax()))
    return out


@torch.inference_mode()
def teacher_forced_top1(model: DecoderModel, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions of the reference continuations where the model's top-1 token is the reference's token,
    each prediction made from the reference prefix (so one early flip does not decide the rest, as in greedy)."""
    hits = total = 0
    for prompt, cont in zip(prompts, reference, strict=True):
        ids = prompt + cont
        cache = SequenceCache(model, len(ids))
        preds = torch.cat([cache.forward(model, ids[s : s + CHUNK]).argmax(-1) for s in range(0, len(ids), CHUNK)])
        hits += int((preds[len(prompt) - 1 : -1] == torch.tensor(cont)).sum())
        total += len(cont)
    return hits / total


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Mean share of tokens before the first divergence, and the number of identical continuations."""
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(k / len(a))
    return {
        "mean_prefix_share": sum(prefixes) / len(prefixes),
        "identical": sum(p == 1.0 for p in prefixes),
        "of": len(prefixes),
    }


def engine_speed(model: DecoderModel, tokenizer, prompts: list[list[int]]) -> dict:
    """Batch-1 ITL (ms) and total TPS at 16 through the engine in-process."""
    from omnivox.engine import Engine, SamplingParams

    engine = Engine(model, tokenizer, kv_cache_gib=0.5)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS + 1, ignore_eos=True)
    engine.generate([prompts[0]], [one])  # warm-up
    itls = []
    for p in prompts[:3]:
        t0 = time.perf_counter()
        engine.generate([p], [one])
        t1 = time.perf_counter()
        engine.generate([p], [full])
        t2 = time.perf_counter()
        itls.append(((t2 - t1) - (t1 - t0)) / GREEDY_TOKENS * 1e3)
    batch = prompts[:16]
    t0 = time.perf_counter()
    outs = engine.generate(batch, [SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)] * 16)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"itl_batch1_ms": sorted(itls)[len(itls) // 2], "total_tps_16": tokens / dt}


def run(model_path: str, modes: list[str], threads: int, speed: bool, quality: bool = True, passes: int = 1) -> dict:
    """Quality of each mode (unless `quality` is False), then `passes` speed passes, each running every mode back to
    back (on a shared machine the passes show the spread; the rows carry every pass and their medians)."""
    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.models.quant import weight_bytes

    if speed:
        import omnivox.engine  # noqa: F401  (fail before the quality runs, not after them)
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_path)
    text_ids = tokenizer(TEXT.read_text()).input_ids
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    results: dict = {
        "model": str(model_path),
        "text_tokens": len(text_ids),
        "threads": threads,
        "machine": platform.processor() or platform.machine(),
        "commit": _commit(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_start": list(os.getloadavg()),
        "modes": {},
    }
    reference = None
    order = ["none", *[m for m in modes if m != "none"]]
    for mode in order if quality else []:
        t0 = time.perf_counter()
        model = _load(model_path, mode)
        row: dict = {"load_s": time.perf_counter() - t0, "weight_mb": weight_bytes(model) / 1e6}
        row["perplexity"] = perplexity(model, text_ids)
        row["perplexity_prefill"] = perplexity(model, text_ids, PREFILL_CHUNK)
        outs = [greedy(model, p, GREEDY_TOKENS) for p in prompts]
        if reference is None:
            reference = outs
        row["greedy"] = agreement(reference, outs)
        row["greedy"]["teacher_forced_top1"] = teacher_forced_top1(model, prompts, reference)
        base = results["modes"].get("none")
        if base is not None:
            row["perplexity_vs_float32"] = row["perplexity"] / base["perplexity"] - 1
            row["perplexity_prefill_vs_float32"] = row["perplexity_prefill"] / base["perplexity_prefill"] - 1
        results["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
        del model
    if speed:
        models = {m: _load(model_path, m) for m in order}
        for i in range(passes):
            for mode in order:
                row = results["modes"].setdefault(mode, {"weight_mb": weight_bytes(models[mode]) / 1e6})
                row.setdefault("speed_passes", []).append(engine_speed(models[mode], tokenizer, prompts))
                print(f"pass {i + 1} {mode}", row["speed_passes"][-1], flush=True)
        for row in results["modes"].values():
            for key in ("itl_batch1_ms", "total_tps_16"):
                values = sorted(p[key] for p in row["speed_passes"])
                row[key] = values[len(values) // 2]
    return results


def _load(model_path: str, mode: str) -> DecoderModel:
    """The model of a mode: none / int8 / int4 / native, optionally suffixed /a8 (8-bit activations, see above)."""
    from omnivox.models.loading import load_decoder
    from omnivox.models.quant import set_act_bits

    base, _, bits = mode.partition("/a")
    model = load_decoder(model_path, quantization=None if base == "native" else base).eval()
    if bits:
        set_act_bits(model, int(bits))
    return model


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=TEXT.parent)
        return out.stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--modes", default="none,int8,int4,native", help="comma-separated: none,int8,int4,native")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-speed", action="store_true", help="quality only")
    parser.add_argument("--no-quality", action="store_true", help="speed only")
    parser.add_argument("--passes", type=int, default=1, help="speed passes (each runs every mode; medians kept)")
    parser.add_argument("--output", default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from omnivox.services.parts.defaults import ensure_default_model

        model = str(ensure_default_model())
    results = run(model, args.modes.split(","), args.threads, not args.no_speed, not args.no_quality, args.passes)
    if args.output:
        write_results(args.output, results)


if __name__ == "__main__":
    main()
