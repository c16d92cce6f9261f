"""Every supported family and rope type builds under `torch.device("meta")` with every tensor on that device.

The CUDA load builds the decoder under `torch.device("cuda")`; a table made on the CPU (transformers' rope functions
return CPU tensors) and mixed with one made on the default device crashed the first Llama 3 load on a GPU. Under the
meta device the same mix fails on any machine, so this catches the whole class of bug without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import _BASE, FAMILIES

from omnivox.engine.loading import build_model
from omnivox.models.config import ModelConfig

HEAD_DIM = {"llama": 16, "qwen2": 16, "qwen3": 32}  # hidden 64 / 4 heads, or Qwen3's explicit head_dim

ROPES = {
    "default": lambda half: {"rope_type": "default", "rope_theta": 10000.0},
    "linear": lambda half: {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": lambda half: {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": lambda half: {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "longrope": lambda half: {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [1.5] * half,
        "original_max_position_embeddings": 128,
    },
}


def _config(family: str, rope: str):
    config_cls, _, family_overrides = FAMILIES[family]
    params = ROPES[rope](HEAD_DIM[family] // 2)
    return config_cls(**{**_BASE, **family_overrides, "rope_parameters": params})


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builds_on_meta_without_mixing_devices(family: str, rope: str) -> None:
    hf = _config(family, rope)
    assert hf.rope_parameters["rope_type"] == rope  # transformers kept the rope type we asked for
    cfg = ModelConfig.from_hf(hf, None)
    model = build_model(cfg, torch.device("meta"), torch.bfloat16)
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"meta"}
    assert model.rotary.cos.dtype == torch.float32  # tables stay float32 whatever the model dtype
    assert model.rotary.cos.shape == (cfg.max_model_len, cfg.head_dim)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_tables_equal_transformers_rotary(rope: str) -> None:
    """The tables, built on the CPU and moved, are transformers' own cos/sin (attention scaling included)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from omnivox.models.layers import RotaryEmbedding

    hf = _config("llama", rope)
    # longrope: transformers switches to long_factor once a sequence passes original_max_position_embeddings (128);
    # our fixed tables use short_factor throughout, so only the short regime is compared (a known gap, no supported
    # family uses longrope).
    n = 128 if rope == "longrope" else 256
    ours = RotaryEmbedding(hf, 16, n)
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, n, 16), torch.arange(n)[None])
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)


def test_dynamic_rope_is_refused() -> None:
    hf = _config("llama", "default")
    hf.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        build_model(ModelConfig.from_hf(hf, None), torch.device("meta"), torch.float32)
