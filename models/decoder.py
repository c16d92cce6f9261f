"""Our own decoder for the Llama family (Llama incl. SmolLM2 and Llama 3.x rope scaling, Qwen2, Qwen3, Mistral).

Config knobs followed as transformers does (tests/test_config_sweep.py): rope types of models/config.py, explicit
head_dim, MQA / GQA, tied or untied output, attention_bias (q/k/v, and o_proj but for Qwen2), mlp_bias, per-layer
sliding windows.

It reads and writes the paged KV cache directly (models/attention.py). transformers supplies only the config;
the parity tests compare this module against transformers' own implementation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models.attention import AttentionMetadata, paged_attention, write_kv
from omnivox.models.config import ModelConfig
from omnivox.models.fused_decode import MAX_ROWS, fused_decode_for
from omnivox.models.layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary, linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = cfg.sliding_window if layer in cfg.sliding_layers else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(
            cfg.hidden_size, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, cfg.attention_bias
        )
        self.o_proj = Linear(q_rows, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor], meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_rows].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_rows : q_rows + kv_rows].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_rows + kv_rows :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window)
        return self.o_proj(o.reshape(t, q_rows))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = PackedLinear(
            cfg.hidden_size, {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}, cfg.mlp_bias
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoint names that land inside a packed layer: checkpoint suffix -> (our module, part name).
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q_proj"),
    "k_proj": ("qkv_proj", "k_proj"),
    "v_proj": ("qkv_proj", "v_proj"),
    "gate_proj": ("gate_up_proj", "gate_proj"),
    "up_proj": ("gate_up_proj", "up_proj"),
}


class DecoderModel(nn.Module):
    """Token (or embedding) rows in, logits out; attention state lives in the caller's paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], or [3, T] M-RoPE rows for Qwen2.5-VL (KV slots stay 1-D: slot_mapping)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embed_rows: torch.Tensor | None = None,  # [S] rows whose embedding is replaced (vision / audio segments)
        embed_values: torch.Tensor | None = None,  # [S, hidden]
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.embed_tokens(input_ids)
        if embed_rows is not None and embed_rows.numel():
            x = x.index_copy(0, embed_rows, embed_values.to(x.dtype))
        rope = self.rotary.tables(positions, x.dtype)
        fused = fused_decode_for(self) if x.device.type == "cpu" and x.shape[0] <= MAX_ROWS else None
        if fused is not None and fused.applies(x, meta):  # a small CPU step: all layers in one C call
            return self.norm(fused(x, rope, kv_caches, meta, self.config.intermediate_size))
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, window: tuple[int, int] | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32; with `window` (lo, hi) only the vocabulary rows lo..hi-1 are projected
        ([N, hi - lo]: the sampler's candidates all lie there, engine/vocab_window.py)."""
        lo, hi = window if window is not None else (0, self.config.vocab_size)
        if self.lm_head is None:  # tied: the embedding matrix is the output projection
            return linear(hidden, self.embed_tokens.weight[lo:hi]).float()
        if type(self.lm_head) is Linear:
            bias = self.lm_head.bias[lo:hi] if self.lm_head.bias is not None else None
            return linear(hidden, self.lm_head.weight[lo:hi], bias).float()
        return self.lm_head(hidden)[:, lo:hi].float()  # a quantised layer (models/quant.py): every row, then the window

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) into place, one at a time.

        Fails when a parameter is missing, including one part of a packed projection.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors:
            ours = name.removeprefix("model.")
            if "rotary_emb" in ours:
                continue
            if ours == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            parts = ours.split(".")
            if len(parts) >= 2 and parts[-2] in PACKED_PROJECTIONS:
                module_name, part = PACKED_PROJECTIONS[parts[-2]]
                target = ".".join(parts[:-2] + [module_name])
                self.get_submodule(target).load_part(part, parts[-1], tensor)
                loaded.add(f"{target}.{part}.{parts[-1]}")
                continue
            if ours not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.config.family} model")
            p = params[ours]
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(ours)
        missing = []
        for pname, _ in self.named_parameters():
            mod_name, _, kind = pname.rpartition(".")
            mod = self.get_submodule(mod_name)
            if isinstance(mod, PackedLinear):
                missing += [f"{mod_name}.{p}.{kind}" for p in mod.parts if f"{mod_name}.{p}.{kind}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
