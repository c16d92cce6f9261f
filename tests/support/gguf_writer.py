"""What every test GGUF writer puts in a file the same way: the decoder's shape keys and the test BPE tokenizer.

tests/models/test_checkpoint.py (dense), tests/models/test_decoder_families_gguf.py (Phi-3, Gemma) and tests/models/test_gguf_moe.py (MoE)
each add their family's own keys and tensors around these, as llama.cpp's convert_hf_to_gguf.py does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers


def add_shape(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    """Layer count, context, widths, heads, RMS epsilon and vocabulary size."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def add_norm_and_vocab(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def add_bpe_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, *, chat_template: bool = True) -> None:
    """The folder's byte-level BPE tokenizer.json as llama.cpp's "gpt2" model (BOS 1, EOS 2, PAD 0); with
    `chat_template`, BOS not added and the folder's template too (what a served file carries)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if chat_template:
        writer.add_add_bos_token(False)
        writer.add_chat_template(transformers.AutoTokenizer.from_pretrained(hf_dir).chat_template)


_GGUF_LEAF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LEAF[module]}.{leaf}"


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    hf_dir: Path,
    out: Path,
    quantize: dict[str, gguf.GGMLQuantizationType],
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """A GGUF of the checkpoint at hf_dir: metadata, byte-level BPE tokenizer, tensors (quantized where asked).

    `raw` gives some tensors as ready blocks (uint8 [rows, bytes per row]) of a type, stored as they are: for types the
    gguf package cannot quantize (K-quants).
    """
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = config.model_type
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name("tiny-test")
    add_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    add_norm_and_vocab(writer, config)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)

    add_bpe_tokenizer(writer, hf_dir)

    for hf_name, tensor in load_file(hf_dir / "model.safetensors").items():
        weights = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            weights = _llama_cpp_permute(weights, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            weights = _llama_cpp_permute(weights, config.num_key_value_heads)
        name = _gguf_name(hf_name)
        qtype = quantize.get(name, gguf.GGMLQuantizationType.F32)
        if raw and name in raw:
            blocks, raw_type = raw[name]
            writer.add_tensor(name, blocks, raw_dtype=raw_type)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(weights))
        else:
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(rope, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3 rope scaling as per-frequency divisors."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


Q4_K = gguf.GGMLQuantizationType.Q4_K


def _random_k_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random but valid K-quant blocks, uint8 [rows, cols / 256 * block bytes]: random quants and sub-block scales,
    finite small f16 super-block scales (d, and dmin for Q4_K)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype == Q4_K:  # d: f16, dmin: f16, scales: 12 bytes, qs: 128 bytes
        blocks[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    else:  # Q6_K: ql 128 bytes, qh 64 bytes, scales 16 int8, d: f16 (last)
        blocks[:, -2:] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


F32, Q8_0, Q4_K, Q6_K = (gguf.GGMLQuantizationType[t] for t in ("F32", "Q8_0", "Q4_K", "Q6_K"))


ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}


_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip


_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


_EXPERT_LEAF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def llama_cpp_tensors(hf_dir: Path, stacked: bool = True) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, float32, Llama-arch Q/K permuted, experts stacked (or as
    the Mixtral files converted before spring 2024 hold them: blk.N.ffn_gate.E.weight, one per expert)."""
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    out, experts = {}, {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        w = tensor.float().numpy()
        if (m := _EXPERT.fullmatch(name)) and not stacked:
            out[f"blk.{m[1]}.ffn_{_EXPERT_LEAF[m[3]]}.{m[2]}.weight"] = w
            continue
        if m:
            experts.setdefault(f"blk.{m[1]}.ffn_{_EXPERT_LEAF[m[3]]}_exps.weight", {})[int(m[2])] = w
            continue
        if name in top:
            out[top[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        if config.model_type == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)  # LlamaModel.permute
        if module == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp's {n_embd}
        out[f"blk.{layer}.{_LAYER[module]}.{leaf}"] = w
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_moe_gguf(
    hf_dir: Path, out: Path, qtype=F32, raw: dict | None = None, stacked: bool = True, sizes: bool = True
) -> Path:
    """A GGUF of the MoE checkpoint at hf_dir: metadata as convert_hf_to_gguf.py writes it, the test tokenizer with its
    chat template, matrices in `qtype` (router, norms, biases and embeddings float), `raw` blocks as given."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = ARCH[config.model_type]
    writer = gguf.GGUFWriter(out, arch)
    add_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    add_norm_and_vocab(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(config.num_local_experts)
    else:
        writer.add_expert_count(config.num_experts)
    if arch != "llama" and sizes:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen2moe" and sizes:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    add_bpe_tokenizer(writer, hf_dir)
    for name, w in llama_cpp_tensors(hf_dir, stacked).items():
        if raw and name in raw:
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif _quantized(name) and qtype != F32:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _quantized(gguf_name: str) -> bool:
    """What a quantised file quantises here: attention and expert matrices (llama-quantize keeps routers float)."""
    return (
        gguf_name.startswith("blk.")
        and gguf_name.endswith(".weight")
        and "_inp" not in gguf_name
        and "norm" not in gguf_name
    )
