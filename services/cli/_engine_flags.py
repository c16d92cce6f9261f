"""`omnivox serve`'s engine flags (KV cache, context, caches, quantisation, speculative decoding, device), defined in
the order `omnivox serve --help` lists them; services/cli/_serve_flags.py adds them among the others."""

from __future__ import annotations

import argparse


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-gib", type=float, help="KV cache size per model (default: the engine decides)")
    p.add_argument("--max-model-len", type=int, help="cap the context length")
    p.add_argument(
        "--image-cache-mib",
        type=int,
        default=256,
        help="encoded images each vision model keeps for reuse; a single image whose features exceed it is refused",
    )
    p.add_argument(
        "--whisper-short-window",
        type=float,
        metavar="SECONDS",
        help="Transcribe and StreamingTranscribe encode a clip that ends 3.5 s before this window in it (10: clips up "
        "to 6.5 s, ~0.3x the encoder time of the 30 s window, WER measured within noise on 32 clips; BENCHMARKS.md "
        "'Whisper short windows'); default: the 30 s window, transformers' own. Realtime turns take 10 s either way",
    )
    p.add_argument(
        "--whisper-int8-short-window",
        action="store_true",
        help="encode Whisper's short windows (realtime turns, --whisper-short-window) with int8 weights (Q8_0 blocks, "
        "the CPU block kernels; float elsewhere): same WER as float on 32 clips at 0.84-0.91x its encoder time",
    )
    p.add_argument(
        "--max-request-megapixels",
        type=float,
        default=48.0,
        help="pixels of all the images of one request together (millions); the image that passes it is refused "
        "from its header, and the images after it are never decoded",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        help="tokens one engine step may compute (decodes + prefill chunks): lower bounds inter-token latency, "
        "higher gives faster time to first token (default: 128 on CPU, 2048 on CUDA)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        help="while decodes run, a step carries only as many prompt tokens as keep it near this many milliseconds, "
        "by this machine's step times measured at start-up, rescaled by the mixed steps measured since (default: off, "
        "the whole --max-batched-tokens)",
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        help="while decodes run, a step carries at most this many tokens (decodes + prompt chunks; prompts keep "
        "at least 16 a step); instead of measuring --max-step-ms",
    )
    p.add_argument(
        "--quantization",
        metavar="[NAME=]MODE",
        action="append",
        default=[],
        help="weights: auto (default: what the checkpoint carries: a GGUF at its own bit widths on CPU, several "
        "times faster batch-1 steps at float quality; float elsewhere), none (float), int8 or int4 (linear layers "
        "quantised at load); with NAME= for one model, else for every model",
    )
    p.add_argument(
        "--quantize-lm-head", action="store_true", default=None, help="also quantise the output projection (int8)"
    )
    p.add_argument(
        "--activation-bits",
        metavar="[NAME=]BITS",
        action="append",
        default=[],
        help="activations in quantised weights' many-row kernel: 16 (default) or 8 (llama.cpp's Q8_1: on the "
        "embedded model ~1.25x the tokens/s at 16 concurrent, perplexity +1.08 %%, 4 of 20 greedy answers as float); "
        "AVX-512 VNNI on CPU only, steps of 3+ rows; the lm_head keeps 16; needs quantised weights; with NAME= for "
        "one model, else for every model",
    )
    p.add_argument(
        "--speculative",
        metavar="[NAME=]KIND",
        action="append",
        default=[],
        help="speculative decoding: ngram (prompt lookup) or draft:PATH (a small checkpoint with the same "
        "tokenizer); with NAME= for one model, else for every model",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed per step (default 4)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when present)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="weights and activations dtype")
