"""Perplexity of the embedded default on each many-row kernel and activation precision, against float32: the AVX2
kernel (block_kernels_avx2.c, the x86-64-v3 build) next to the VNNI one (the native build, where the CPU has it),
at 15 and 8 bits. The text and the 16-row steps are benchmarks/quality.py's (its `perplexity`), cut to the first
--tokens tokens so that it finishes on a loaded machine; the full quality run is `python -m
omnivox.benchmarks.quality`.

    python -m omnivox.benchmarks.kernel_quality [--tokens 1024] [--out F]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.main import default_model, git_commit
from omnivox.benchmarks.quality import TEXT, perplexity
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
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_path = args.model or default_model()
    ids = load_tokenizer(model_path)(TEXT.read_text()).input_ids[: args.tokens]
    rows = {}
    for name, (target, quantization, bits) in SETTINGS.items():
        if name.startswith("vnni") and not cpu_kernels.vnni_available(cpu_kernels.library("native")):
            continue
        cpu_kernels.use_target(target)
        model = load_decoder(model_path, quantization=quantization).eval()
        if quantization is None:
            set_act_bits(model, bits)
        rows[name] = {"kernel": cpu_kernels.many_row_kernel(), "perplexity": perplexity(model, ids)}
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
