"""Gemma 3, Gemma 2 and Phi-3 GGUF files in llama.cpp's layout on our decoder: equal to transformers on the checkpoint they
were converted from, at float precision and at their own Q8_0 precision. The files are written here from tiny random
checkpoints as llama.cpp's convert_hf_to_gguf.py writes them: Gemma's norms as 1 + weight, no query_pre_attn_scalar,
Gemma 3's global rope scaling under `gemma3.rope.scaling.*`, Gemma 2's soft-caps; Phi-3's fused attn_qkv / ffn_up, the rotated dims,
longrope's factors as tensors and the window in the metadata."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from support import gguf_writer
from support.checkpoints import load_reference, make_checkpoint
from support.decoder_parity import SHORT, XL, assert_matches
from support.engines import tiny_engine

from omnivox.engine import SamplingParams
from omnivox.models import quant
from omnivox.models.gguf_config import patch_gemma_config


def write_gguf(hf_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """The gemma3, gemma2 or phi3 checkpoint at hf_dir as a GGUF: metadata, byte-level BPE tokenizer, matrices in `qtype`."""
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    writer = gguf.GGUFWriter(out, arch)
    gguf_writer.add_shape(writer, config)
    gguf_writer.add_norm_and_vocab(writer, config)
    extra = {}
    if arch in ("gemma2", "gemma3"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        full = config.rope_parameters.get("full_attention", config.rope_parameters)
        writer.add_rope_freq_base(full["rope_theta"])
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    else:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        rope, head_dim = config.rope_parameters, config.hidden_size // config.num_attention_heads
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale = config.max_position_embeddings / config.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings)))  # fmt: skip
            extra = {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}
    gguf_writer.add_bpe_tokenizer(writer, hf_dir, chat_template=False)
    for name, values in extra.items():
        writer.add_tensor(name, np.array(values, dtype=np.float32))
    model_arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}[
        arch
    ]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in load_file(hf_dir / "model.safetensors").items():
        gemma_norm = arch != "phi3" and hf_name.endswith("norm.weight")
        w = tensor.float() + 1 if gemma_norm else tensor.float()  # llama.cpp stores Gemma's norms as 1 + weight
        name, w = names.get_name(hf_name.removesuffix(".weight")) + ".weight", w.numpy()
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Gemma 3 4B's text layout, shrunk: 7 layers (every 6th full: the 6th), a window of 16, linear rope scaling on
    the full layer; query_pre_attn_scalar = head_dim, as every Gemma 3 but the 27B has it (a GGUF does not carry it)."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    hf = make_checkpoint(root / "hf", "gemma3", seed=7, num_hidden_layers=7, layer_types=None, sliding_window=16,
                         query_pre_attn_scalar=16, rope_parameters=rope)  # fmt: skip
    # Phi-4-mini's layout, shrunk: 3/4 of each head rotating, longrope (its long factors: the prompts pass the
    # original 32 tokens), tied, no window (0 in the file); and Phi-3-mini-4k's: a window, untied, plain rope
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5]}  # fmt: skip
    phi4 = make_checkpoint(root / "phi4", "phi3", seed=7, rope_parameters=longrope, partial_rotary_factor=0.75,
                           original_max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    phi3 = make_checkpoint(root / "phi3", "phi3", seed=7, sliding_window=20)
    # Gemma 2 with caps of its own (0.05 / 3.0, not the 50 / 30 a config without them defaults to)
    gemma2 = make_checkpoint(root / "gemma2", "gemma2", seed=7, query_pre_attn_scalar=16)
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    return {
        "hf": hf, "f32": write_gguf(hf, root / "f32.gguf", f32), "q8": write_gguf(hf, root / "q8.gguf", q8),
        "phi4-hf": phi4, "phi4-f32": write_gguf(phi4, root / "phi4.gguf", f32),
        "phi4-q8": write_gguf(phi4, root / "phi4-q8.gguf", q8),
        "phi3-hf": phi3, "phi3-f32": write_gguf(phi3, root / "phi3.gguf", f32),
        "gemma2-hf": gemma2, "gemma2-f32": write_gguf(gemma2, root / "gemma2.gguf", f32),
    }  # fmt: skip


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "omnivox-cache"))


def test_float_gguf_equals_transformers_on_its_source(checkpoints):
    engine = tiny_engine(checkpoints["f32"], max_num_batched_tokens=8)
    cfg = engine.model_config
    assert (cfg.family, cfg.attn_scale, cfg.sliding_layers, cfg.local_rope_layers) == ("gemma3", 0.25, (0, 1, 2, 3, 4, 6), (0, 1, 2, 3, 4, 6))  # fmt: skip
    assert cfg.hf_config.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert_matches(engine, load_reference(checkpoints["hf"]), (SHORT, XL))


def test_q8_gguf_served_at_its_own_precision(checkpoints):
    """Int8 blocks as stored (the tied embedding too, scaled like the float one); the same greedy tokens as the
    file dequantised to float."""
    native = tiny_engine(checkpoints["q8"], quantization="auto")
    assert isinstance(native.model.layers[0].mlp.down_proj, quant.Int8Linear)
    assert isinstance(native.model.embed_tokens, quant.Int8Embedding)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dequantised = tiny_engine(checkpoints["q8"], quantization="none")
    assert native.generate([XL], params)[0].token_ids == dequantised.generate([XL], params)[0].token_ids


def test_query_scale_as_llama_cpp_reads_it():
    """1 / sqrt(head size), but hidden / heads for the 27Bs (their query_pre_attn_scalar: Gemma 3's 62 layers
    5376 / 32 = 168, Gemma 2's 46 layers 4608 / 32 = 144)."""
    cases = [("gemma3", 5376, 26, 256, 256), ("gemma3", 5376, 62, 128, 168), ("gemma2", 4608, 46, 128, 144),
             ("gemma2", 3584, 42, 256, 256)]  # fmt: skip
    for arch, hidden, layers, head_dim, want in cases:
        config_cls = transformers.Gemma3TextConfig if arch == "gemma3" else transformers.Gemma2Config
        config = config_cls(hidden_size=hidden, num_attention_heads=32, num_hidden_layers=layers)
        patch_gemma_config(config, {f"{arch}.block_count": layers}, arch, head_dim)
        assert config.query_pre_attn_scalar == want, (arch, layers)


@pytest.mark.parametrize("model", ["phi4", "phi3"])
def test_phi3_float_gguf_equals_transformers_on_its_source(checkpoints, model):
    engine = tiny_engine(checkpoints[f"{model}-f32"], max_num_batched_tokens=8)
    cfg = engine.model_config
    want = (12, None, True) if model == "phi4" else (None, 20, False)
    assert (cfg.rotary_dim, cfg.sliding_window, cfg.tie_word_embeddings) == want
    assert_matches(engine, load_reference(checkpoints[f"{model}-hf"]), (XL,) if model == "phi4" else (SHORT, XL))


def test_phi3_q8_gguf_served_at_its_own_precision(checkpoints):
    """The fused attn_qkv / ffn_up blocks split by rows of blocks at load, no float detour."""
    native = tiny_engine(checkpoints["phi4-q8"], quantization="auto")
    assert isinstance(native.model.layers[0].self_attn.qkv_proj, quant.Int8Linear)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dequantised = tiny_engine(checkpoints["phi4-q8"], quantization="none")
    assert native.generate([XL], params)[0].token_ids == dequantised.generate([XL], params)[0].token_ids


def test_gemma2_float_gguf_equals_transformers_on_its_source(checkpoints):
    engine = tiny_engine(checkpoints["gemma2-f32"], max_num_batched_tokens=8)
    cfg = engine.model_config
    assert (cfg.family, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == ("gemma2", pytest.approx(0.05), 3.0)
    assert_matches(engine, load_reference(checkpoints["gemma2-hf"]), (SHORT, XL))
