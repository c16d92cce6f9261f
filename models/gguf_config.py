"""A GGUF file's config, completed: what transformers' GGUF config mapping leaves out for the architectures we read
(Qwen 3 head size, Qwen MoE expert sizes, Mixtral as llama.cpp writes it, Gemma 2 / 3 query scale, soft-caps and rope
scaling, Phi-3's rope and window, Llama 3.x rope scaling from `rope_freqs.weight`), as llama.cpp reads those files.
models/gguf_checkpoint.py reads the file and caches the result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import transformers

Tensors = Callable[[], list]  # the file's tensor table: (name, type, shape, raw) per tensor


def patch_gguf_config(config: transformers.PretrainedConfig, metadata: dict, path: Path, tensors: Tensors) -> None:
    """Fill what transformers' GGUF config mapping leaves out for our architectures. `tensors()`: the file's tensor
    table (models/gguf_checkpoint.py gguf_tensor_table), read only for the architectures that need it."""
    arch = metadata.get("general.architecture")
    key_length = metadata.get(f"{arch}.attention.key_length")
    # transformers maps no head size for qwen3 GGUFs; Qwen3's default (128) is wrong for other head sizes.
    if arch in ("qwen3", "qwen3moe") and key_length is not None:
        config.head_dim = int(key_length)
    if arch in ("qwen2moe", "qwen3moe"):  # transformers maps neither the expert nor the shared expert size
        _patch_moe_sizes(config, metadata, arch, path, tensors)
    if arch in ("gemma2", "gemma3"):
        patch_gemma_config(config, metadata, arch, int(key_length or config.head_dim))
    if arch == "phi3":
        _patch_phi3_config(config, metadata, tensors)
    if arch == "llama":
        rope_freqs = next((raw for name, _, _, raw in tensors() if name == "rope_freqs.weight"), None)
        if rope_freqs is not None:
            config.rope_parameters = _llama3_rope_from_freq_factors(
                np.asarray(rope_freqs).view(np.float32).reshape(-1), config, path
            )


def _patch_moe_sizes(
    config: transformers.PretrainedConfig, metadata: dict, arch: str, path: Path, tensors: Tensors
) -> None:
    """Qwen MoE expert sizes: `{arch}.expert_feed_forward_length` / `expert_shared_feed_forward_length` as
    convert_hf_to_gguf.py writes them, else the rows of layer 0's ffn_gate_exps / ffn_gate_shexp (llama.cpp itself
    sizes the experts by their tensors)."""
    wanted = ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_shexp.weight")
    rows = {name: shape[-2] for name, _, shape, _ in tensors() if name in wanted}
    sizes = [("moe_intermediate_size", "expert_feed_forward_length", "blk.0.ffn_gate_exps.weight")]
    if arch == "qwen2moe":
        sizes.append(("shared_expert_intermediate_size", "expert_shared_feed_forward_length", "blk.0.ffn_gate_shexp.weight"))  # fmt: skip
    for attr, key, tensor in sizes:
        size = metadata.get(f"{arch}.{key}") or rows.get(tensor)
        if size is None:
            raise ValueError(f"{path}: GGUF has neither {arch}.{key} nor {tensor}: cannot size its experts")
        setattr(config, attr, int(size))


def mixtral_config(llama: transformers.PretrainedConfig, metadata: dict) -> transformers.MixtralConfig:
    """Mixtral as llama.cpp writes it: arch llama with `llama.expert_count` / `expert_used_count` (transformers reads
    it as a dense Llama). The expert size is `feed_forward_length` (Mixtral's intermediate_size); no window, as
    llama.cpp runs it."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")  # fmt: skip
    kwargs = {k: getattr(llama, k) for k in keys if getattr(llama, k, None) is not None}
    inter = metadata.get("llama.expert_feed_forward_length") or metadata["llama.feed_forward_length"]
    head_dim = metadata.get("llama.attention.key_length") or llama.hidden_size // llama.num_attention_heads
    return transformers.MixtralConfig(
        **kwargs,
        intermediate_size=int(inter),
        head_dim=int(head_dim),
        num_local_experts=int(metadata["llama.expert_count"]),
        num_experts_per_tok=int(metadata["llama.expert_used_count"]),
        sliding_window=None,
    )


def patch_gemma_config(config: transformers.PretrainedConfig, metadata: dict, arch: str, key_length: int) -> None:
    """What a Gemma 2 / 3 GGUF leaves to the reader (transformers' mapping reads none of it): the query scale, which
    llama.cpp takes as 1 / sqrt(head size) but for the 27Bs (Gemma 2: 46 layers, Gemma 3: 62; hidden / heads, their
    query_pre_attn_scalar 144 and 168); Gemma 2's soft-caps; Gemma 3's global linear rope scaling (4B and larger)."""
    layers = int(metadata.get(f"{arch}.block_count", config.num_hidden_layers))
    big = layers == (46 if arch == "gemma2" else 62)
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else key_length
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if metadata.get(f"{arch}.{key}") is not None:
            setattr(config, key, float(metadata[f"{arch}.{key}"]))
    if arch == "gemma3" and metadata.get("gemma3.rope.scaling.type") == "linear":
        full = dict(config.rope_parameters["full_attention"])
        full |= {"rope_type": "linear", "factor": float(metadata["gemma3.rope.scaling.factor"])}
        config.rope_parameters = {**config.rope_parameters, "full_attention": full}


def _patch_phi3_config(config: transformers.PretrainedConfig, metadata: dict, tensors: Tensors) -> None:
    """Phi-3's rope and window as llama.cpp's convert_hf_to_gguf.py stores them, which transformers' mapping drops:
    the rotated dims (`phi3.rope.dimension_count`: Phi-4-mini rotates 3/4 of each head), longrope's factors as the
    tensors `rope_factors_long` / `rope_factors_short` with the original context and attention factor in the metadata,
    and the sliding window (0: none, Phi-4)."""
    window = metadata.get("phi3.attention.sliding_window")
    config.sliding_window = int(window) if window else None
    rope = {"rope_type": "default", "rope_theta": float(config.rope_parameters["rope_theta"])}
    head_dim = config.hidden_size // config.num_attention_heads
    dims = int(metadata.get("phi3.rope.dimension_count") or head_dim)
    rope["partial_rotary_factor"] = config.partial_rotary_factor = dims / head_dim
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    factors = {n: np.asarray(raw).view(np.float32).reshape(-1) for n, _, _, raw in tensors() if n in names}
    if factors:
        original = int(metadata["phi3.rope.scaling.original_context_length"])
        config.original_max_position_embeddings = original
        rope |= {"rope_type": "longrope", "long_factor": factors[names[0]].tolist(),
                 "short_factor": factors[names[1]].tolist(), "original_max_position_embeddings": original}  # fmt: skip
        if metadata.get("phi3.rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(metadata["phi3.rope.scaling.attn_factor"])
    config.rope_parameters = rope


def _llama3_freq_factors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's convert_hf_to_gguf.py stores as `rope_freqs.weight` for Llama 3.x."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    smooth = (old_context / wavelen - low) / (high - low)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < old_context / high, 1.0, factors)
    return np.where(wavelen > old_context / low, factor, factors)


def _llama3_rope_from_freq_factors(factors: np.ndarray, config: transformers.PretrainedConfig, path: Path) -> dict:
    """Llama 3.x rope scaling recovered from the `rope_freqs.weight` llama.cpp stores instead of the parameters.

    transformers' GGUF config ignores that tensor, which leaves Llama 3.1+ with plain rope: wrong at every position.
    Only the ratios of (original context, low, high) matter to the frequencies, so the context is fixed and the two
    factors are Llama 3's own or, failing that, fitted to the smooth band (the values strictly between 1 and `factor`).
    """
    theta = config.rope_parameters["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return dict(config.rope_parameters)
    # Llama 3's own context (8192) unless the model's is shorter (transformers wants the original below it);
    # scaling (context, low, high) together leaves the frequencies unchanged.
    context = min(8192, config.max_position_embeddings // 2)
    scale = context / 8192
    candidates = [(1.0 * scale, 4.0 * scale)]  # every Llama 3.1 / 3.2 / 3.3 release: low 1, high 4, context 8192
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    band = (factors > 1.0 + 1e-4) & (factors < factor - 1e-4)
    if band.sum() >= 2:  # smooth = (context / wavelen - low) / (high - low) is linear in 1 / wavelen
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)
        span = context / slope
        candidates.append((float(-intercept * span), float((1 - intercept) * span)))
    for low, high in candidates:
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor}
        rope |= {"low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": context}
        if np.allclose(_llama3_freq_factors(theta, head_dim, rope), factors, rtol=1e-4, atol=1e-5):
            return rope
    raise ValueError(
        f"{path}: rope_freqs.weight does not match Llama 3 rope scaling; cannot derive the rope parameters"
    )
