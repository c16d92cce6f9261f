"""Tiny random CSM checkpoints (models/csm_random.py) for the engine, service and codec tests: two shapes with
different codebook counts, depth-decoder sizes and Mimi codecs, each with SmolLM2's tokenizer and CSM's template."""

from __future__ import annotations

from pathlib import Path

from omnivox.models.checkpoint import load_tokenizer
from omnivox.models.csm_random import save_random_csm
from omnivox.services.parts.defaults import ensure_default_model
from support.mimi_checkpoints import TINY_MIMI_CONFIGS

TINY_CSM_SHAPES: dict[str, dict] = {
    "csm-a": dict(
        num_codebooks=4, vocab_size=18, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, codebook_pad_token_id=17, codebook_eos_token_id=0,
        max_position_embeddings=512,
        depth_decoder_config=dict(num_codebooks=4, vocab_size=18, backbone_hidden_size=32, hidden_size=16,
                                  intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1),
        codec_config=dict(TINY_MIMI_CONFIGS["mimi-a"], codebook_size=16, model_type="mimi"),
    ),
    "csm-b": dict(
        num_codebooks=6, vocab_size=35, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, codebook_pad_token_id=34, codebook_eos_token_id=0,
        max_position_embeddings=512,
        depth_decoder_config=dict(num_codebooks=6, vocab_size=35, backbone_hidden_size=48, hidden_size=24,
                                  intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8),
        codec_config=dict(TINY_MIMI_CONFIGS["mimi-b"], codebook_size=32, model_type="mimi"),
    ),
}  # fmt: skip


def save_tiny_csm(out_dir: Path, name: str, seed: int = 0) -> Path:
    return save_random_csm(out_dir, TINY_CSM_SHAPES[name], load_tokenizer(ensure_default_model(progress=False)), seed)
