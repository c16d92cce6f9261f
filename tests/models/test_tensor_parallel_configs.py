"""Tensor parallelism (2 ranks over gloo on CPU) on configurations beyond the plain ones of
tests/engine/test_tensor_parallel_engine.py: each equals one process, or is refused at load naming the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.tensor_parallel import KV_GIB, two_ranks_equal_one

from omnivox.engine import Engine
from omnivox.models.config import NotApplicable


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path: Path) -> None:
    """MQA (one KV head, 4 query heads) on 2 ranks: each rank holds the one KV head (as vLLM replicates it), so its
    cache is as large as the one process's; the tokens are the one process's. Tied embeddings and an odd vocabulary
    too (the head reads the embedding's shard, the last shard padded)."""
    path = make_checkpoint(
        tmp_path / "mqa", "llama", with_tokenizer=False, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=383
    )
    two_ranks_equal_one(path, 24, tp_kv_gib=KV_GIB)


def test_sliding_window_model_on_two_ranks(tmp_path: Path) -> None:
    """Mistral with a 16-key window on every layer: the ranks slide as one process does, and rank 0 releases the
    blocks behind the window (the workers' caches follow its slots)."""
    path = make_checkpoint(tmp_path / "mistral", "mistral", with_tokenizer=False, sliding_window=16)
    peak_single, peak_tp = two_ranks_equal_one(path, 40)
    assert peak_tp == peak_single <= 2 * (16 // 16 + 1)


def test_quantised_weights_refused_naming_the_reason(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "llama", "llama", with_tokenizer=False)
    with pytest.raises(NotApplicable, match="tensor parallelism needs float weights; quantization 'int8'"):
        Engine.from_pretrained(path, device="cpu", kv_cache_gib=KV_GIB, tensor_parallel=2, quantization="int8")


def test_shard_decoder_cuts_replicated_kv_heads_as_the_streaming_loader_does(tmp_path: Path) -> None:
    """shard_decoder's packed q/k/v cut (from a loaded model) equals load_shard's per-tensor cut, with 2 KV heads on
    4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 head 1, each its own quarter of the query heads."""
    from omnivox.models.checkpoint import iter_checkpoint_tensors
    from omnivox.models.loading import load_decoder
    from omnivox.models.tensor_parallel import _column_shard, _slice_for_rank

    path = make_checkpoint(tmp_path / "gqa", "llama", with_tokenizer=False, attention_bias=True)  # 4 heads, 2 KV
    model = load_decoder(path, torch.device("cpu"), torch.float32)
    packed = model.layers[0].self_attn.qkv_proj
    prefix = "model.layers.0.self_attn."
    for rank in range(4):
        shard = _column_shard(packed, rank, 4, kv_heads=2)
        cut = dict(_slice_for_rank(iter_checkpoint_tensors(path), rank, 4, kv_heads=2))
        for kind in ("weight", "bias"):
            want = torch.cat([cut[f"{prefix}{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
            torch.testing.assert_close(getattr(shard, kind), want, atol=0, rtol=0)
        k_rows = cut[f"{prefix}k_proj.weight"]
        assert k_rows.shape[0] == model.config.head_dim  # one KV head ...
        full_k = dict(iter_checkpoint_tensors(path))[f"{prefix}k_proj.weight"]
        head = rank // 2  # ... the one its query heads read
        torch.testing.assert_close(k_rows, full_k[head * k_rows.shape[0] : (head + 1) * k_rows.shape[0]])
