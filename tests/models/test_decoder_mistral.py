"""Mistral text models (LLaVA-NeXT-Mistral's decoder) on our Llama decoder, against transformers."""

from __future__ import annotations

import torch
import transformers

from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.checkpoint import iter_checkpoint_tensors
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel

BLOCK = 16


def _mistral(path, **overrides):
    config = transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return model


def _logits(path, ids: list[int]) -> tuple[ModelConfig, torch.Tensor]:
    cfg = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path))
    model = DecoderModel(cfg).eval()
    model.load_weights(iter_checkpoint_tensors(path))
    n = len(ids)
    blocks = n // BLOCK + 1
    kv = [(torch.zeros(blocks * BLOCK, 2, 16), torch.zeros(blocks * BLOCK, 2, 16)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(BLOCK, torch.arange(n), 0, None, None, None, [PrefillChunk(0, n, n, torch.arange(blocks))])
    with torch.no_grad():
        return cfg, model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def test_mistral_without_window_equals_transformers(tmp_path):
    ref = _mistral(tmp_path, sliding_window=None)
    ids = list(range(3, 60))
    cfg, ours = _logits(tmp_path, ids)
    assert cfg.family == "llama" and cfg.max_model_len == 256
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_mistral_window_masks_keys_past_it(tmp_path):
    ref = _mistral(tmp_path, sliding_window=32)
    ids = list(range(3, 60))  # longer than the window: the later queries see only the last 32 keys
    cfg, ours = _logits(tmp_path, ids)
    assert (cfg.max_model_len, cfg.sliding_window, cfg.sliding_layers) == (256, 32, (0, 1))
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
