"""Randomly initialised checkpoints with the shapes of real models, and a local tokenizer: no download needed.

Random weights decode at the same speed as trained ones (the same bytes are read, the same FLOPs done), so these
stand in for Qwen2.5-0.5B and Llama-3.2-1B in speed measurements. The tokenizer is word-level over the workload's
words plus filler tokens, as large as the model's vocabulary so that every id the model may emit decodes; it carries a
ChatML chat template.

    python -m omnivox.benchmarks.make_random_checkpoint --shape qwen2.5-0.5b --out /tmp/qwen-0.5b-random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
    ),
    # A few MB: for tests and dry runs.
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    ),
}

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids: specials, merges trained on the workload's words, then
    filler tokens that no text produces but every id decodes to. BPE (not word-level) because transformers rebuilds
    some families' tokenizers (e.g. Qwen2Tokenizer) from vocab + merges whatever tokenizer.json says."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from omnivox.benchmarks.workload import WORDS

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = byte_level
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1024), special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    trained.train_from_iterator([" ".join(WORDS)] * 8 + [f"{w} {w}" for w in WORDS], trainer=trainer)
    state = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(state["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    for i in range(vocab_size - len(vocab)):
        vocab[f"<t{i}>"] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} is too small for {len(vocab)} tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_random_checkpoint(
    out_dir: Path, shape: str = "qwen2.5-0.5b", dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu"
) -> Path:
    """Write config.json + model.safetensors (+ tokenizer) of a random model with `shape`'s config to out_dir."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"shape: unknown {shape!r}; choose from {sorted(SHAPES)}")
    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # norms start at 1.0: perturb them so every weight matters
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    make_tokenizer(out_dir, config.vocab_size)
    (out_dir / "RANDOM_WEIGHTS.json").write_text(json.dumps({"shape": shape, "seed": seed, "trained": False}) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    path = make_random_checkpoint(args.out, args.shape, getattr(torch, args.dtype), args.seed, args.device)
    print(path)


if __name__ == "__main__":
    main()
