"""Perplexity of the embedded default on each many-row kernel and activation precision, against float32: the AVX2
kernel (block_kernels_avx2.c, the x86-64-v3 build) next to the VNNI one (the native build, where the CPU has it),
at 15 and 8 bits. The text and the 16-row steps are benchmarks/quality.py's (its `perplexity`), cut to the first
--tokens tokens so that it finishes on a loaded machine; the full quality run is `python -m
omnivox.benchmarks.quality`.

With `--greedy N`, also greedy agreement with float32 on the first N of benchmarks/quality.py's 20 chat prompts
(64 tokens each: how many continuations are identical, the mean share before the first divergence) and the
teacher-forced top-1 agreement (each of float32's tokens predicted from its own prefix, in the 16-row steps where
the many-row kernel serves), as issue 33 asks per setting.

    python -m omnivox.benchmarks.kernel_quality [--tokens 1024] [--settings float32,avx2/a15,avx2/a8] [--greedy 20]
        [--out F]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.main import default_model, git_commit
from omnivox.benchmarks.quality import GREEDY_TOKENS, PROMPTS, TEXT, agreement, greedy, perplexity, teacher_forced_top1
from omnivox.models import cpu_kernels
from omnivox.models.checkpoint import load_tokenizer
from omnivox.models.loading import load_decoder
from omnivox.models.quant import set_act_bits

# name -> (kernel target, quantisation, activation bits of the many-row kernel)
SETTINGS = {
    "float32": ("native", "none", 15),
    "vnni/a15": ("native", None, 15),
    "vnni/a8": ("native", None, 8),
    "avx2/a15": ("x86-64-v3", None, 15),
    "avx2/a8": ("x86-64-v3", None, 8),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Q4_1 / Q8_0 GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"subset of {list(SETTINGS)} (float32 always runs)")
    ap.add_argument("--greedy", type=int, default=0, help="greedy agreement on this many chat prompts (0: none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_path = args.model or default_model()
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer(TEXT.read_text()).input_ids[: args.tokens]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in PROMPTS[: args.greedy]]  # fmt: skip
    chats = [list(c["input_ids"]) if hasattr(c, "keys") else list(c) for c in chats]  # a BatchEncoding or ids
    chosen = {"float32", *args.settings.split(",")}
    rows, reference = {}, None
    for name, (target, quantization, bits) in SETTINGS.items():
        if name not in chosen:
            continue
        if name.startswith("vnni") and not cpu_kernels.vnni_available(cpu_kernels.library("native")):
            continue
        cpu_kernels.use_target(target)
        model = load_decoder(model_path, quantization=quantization).eval()
        if quantization is None:
            set_act_bits(model, bits)
        rows[name] = {"kernel": cpu_kernels.many_row_kernel(), "perplexity": perplexity(model, ids)}
        if chats:
            outs = [greedy(model, c, GREEDY_TOKENS) for c in chats]
            reference = reference or outs  # float32 runs first
            rows[name]["greedy"] = agreement(reference, outs)
            rows[name]["greedy"]["teacher_forced_top1"] = teacher_forced_top1(
                model, [list(c) for c in chats], reference
            )
        print(name, rows[name], flush=True)
    cpu_kernels.use_target("native")
    base = rows["float32"]["perplexity"]
    for row in rows.values():
        row["vs_float32_pct"] = 100 * (row["perplexity"] / base - 1)
    result = {"model": Path(model_path).name, "commit": git_commit(), "tokens": len(ids), "settings": rows}
    if args.out:
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
