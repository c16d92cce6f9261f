"""Every supported family and rope type builds under `torch.device("meta")` with every tensor on that device.

The CUDA load builds the decoder under `torch.device("cuda")`; a table made on the CPU (transformers' rope functions
return CPU tensors) and mixed with one made on the default device crashed the first Llama 3 load on a GPU. Under the
meta device the same mix fails on any machine, so this catches the whole class of bug without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import _BASE, FAMILIES

from omnivox.engine.loading import build_model
from omnivox.models.config import ModelConfig

# hidden 64 / 4 heads, or the family's explicit head_dim
HEAD_DIM = {"llama": 16, "qwen2": 16, "qwen3": 32, "mistral": 16, "phi3": 16, "gemma3": 16, "gemma2": 16}
HEAD_DIM["gemma"] = 32
HEAD_DIM |= {"qwen3_moe": 32, "mixtral": 16, "qwen2_moe": 16}  # the mixture-of-experts families

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


def _config(family: str, rope: str, partial: float = 1.0):
    config_cls, _, family_overrides = FAMILIES[family]
    params = ROPES[rope](int(HEAD_DIM[family] * partial) // 2)
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    if family == "gemma3":  # the global layers take the rope under test, the local ones their own default
        params = {"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return config_cls(**{**_BASE, **family_overrides, "rope_parameters": params})


# Phi-3's config accepts default and longrope only (and turns "yarn" / "su" into longrope); Phi-4-mini rotates 3/4
# of each head.
CASES = [(f, r, 1.0) for f in sorted(FAMILIES) for r in sorted(ROPES) if f != "phi3" or r in ("default", "longrope")]
CASES += [("phi3", "longrope", 0.75), ("phi3", "default", 0.5)]


@pytest.mark.parametrize(("family", "rope", "partial"), CASES)
def test_builds_on_meta_without_mixing_devices(family: str, rope: str, partial: float) -> None:
    hf = _config(family, rope, partial)
    params = hf.rope_parameters["full_attention"] if family == "gemma3" else hf.rope_parameters
    assert params["rope_type"] == rope  # transformers kept the rope type we asked for
    cfg = ModelConfig.from_hf(hf, None)
    model = build_model(cfg, torch.device("meta"), torch.bfloat16)
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"meta"}
    rotated = int(cfg.head_dim * partial)
    assert (model.rotary_local is not None) == (family == "gemma3")  # Gemma 3's local layers: tables of their own
    for tables in (model.rotary, model.rotary_local or model.rotary):
        assert tables.cos_sin.dtype == torch.float32  # tables stay float32 whatever the model dtype
        assert tables.cos_sin.shape == (cfg.max_model_len, 2, rotated // 2)  # one half: rotate_half repeats it


@pytest.mark.parametrize("kind", ["qwen2.5-vl text (M-RoPE)", "mistral (sliding window)"])
def test_multimodal_text_decoders_build_on_meta(kind: str) -> None:
    """The decoders of the vision-language checkpoints too: Qwen2.5-VL's text model (its M-RoPE band index is a
    buffer made at build time) and LLaVA-NeXT-Mistral's (Llama plus a sliding window on every layer)."""
    import transformers

    if kind.startswith("qwen"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        hf = transformers.Qwen2Config(**{**_BASE, "rope_parameters": rope})
    else:
        hf = transformers.MistralConfig(**{**_BASE, "sliding_window": 32})
    cfg = ModelConfig.from_hf(hf, None)
    model = build_model(cfg, torch.device("meta"), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    if kind.startswith("qwen"):
        assert model.rotary.mrope_axis is not None and model.rotary.mrope_axis.shape == (8,)
    else:
        assert cfg.family == "llama" and all(layer.self_attn.window == 32 for layer in model.layers)


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
    ours_cos, ours_sin = ours.tables(torch.arange(n), torch.float32)  # [n, 1, 16], widened from the stored half
    torch.testing.assert_close(ours_cos[:, 0], cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_sin[:, 0], sin[0], rtol=1e-5, atol=1e-5)


def test_dynamic_rope_is_refused() -> None:
    hf = _config("llama", "default")
    hf.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        build_model(ModelConfig.from_hf(hf, None), torch.device("meta"), torch.float32)


def test_mrope_decoder_builds_on_meta() -> None:
    """Qwen2.5-VL's decoder (M-RoPE sections in its rope parameters) builds as the text families do."""
    import transformers

    text = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    hf = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64), text_config=text
    )
    cfg = ModelConfig.from_hf(hf, None)
    model = build_model(cfg, torch.device("meta"), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_whisper_builds_on_meta() -> None:
    """The encoder-decoder family (models/audio/whisper.py), built by the engine's loader under the default device
    the serve path sets: every tensor on that device, none made on the CPU on the side."""
    from transformers import WhisperConfig

    from omnivox.models.audio.whisper import build_whisper

    hf = WhisperConfig(
        vocab_size=256,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
    )
    with torch.device("meta"):
        model = build_whisper(hf, torch.device("meta"), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert {t.dtype for t in model.parameters()} == {torch.bfloat16}
    assert model.config.num_layers == 2 and model.num_frames == 3000
