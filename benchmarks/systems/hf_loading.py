"""Loading the benchmarked checkpoint (a folder or a .gguf file) with transformers, for the peers and the workload."""

from __future__ import annotations

from pathlib import Path

import torch


def _split(path: str | Path) -> tuple[str, dict]:
    p = Path(path)
    if p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    return str(p), {}


def load_tokenizer(path: str | Path):
    """The tokenizer the omnivox server uses for this checkpoint (same loader, same GGUF conversion)."""
    from omnivox.models.checkpoint import load_tokenizer as load

    tokenizer = load(path)
    if tokenizer is None:
        raise SystemExit(
            f"--model: {path} ships no tokenizer; the benchmark sends text (make_random_checkpoint adds one)"
        )
    return tokenizer


def load_model(path: str | Path, dtype: torch.dtype, device: str = "cpu"):
    """transformers' own implementation of the checkpoint (a GGUF is dequantised to `dtype`)."""
    import transformers

    where, kw = _split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw)
    return model.to(device).eval()


def load_config(path: str | Path):
    """The transformers config omnivox reads for this checkpoint (GGUF metadata patched as the engine does)."""
    from omnivox.models.checkpoint import load_hf_config

    return load_hf_config(path)
