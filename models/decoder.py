"""Our own decoder for the Llama family (Llama incl. SmolLM2 and Llama 3.x rope scaling, Qwen2, Qwen3, Mistral,
Phi-3, Gemma 2, Gemma 3's text decoder) and its mixture-of-experts kin (Qwen3-MoE, Mixtral, Qwen2-MoE: models/moe.py).

Config knobs followed as transformers does (tests/models/test_config_sweep.py, tests/models/test_decoder_families.py): rope types
of models/config.py, partial rotary, explicit head_dim, MQA / GQA, tied or untied output, attention_bias (q/k/v, and
o_proj but for Qwen2), mlp_bias, per-layer sliding windows. Phi-3's fused qkv_proj / gate_up_proj are split at load
(`split_fused_projections`); Gemma 3 adds norms around attention and MLP (`SandwichDecoderLayer`), GELU-tanh, a
scaled embedding, its own query scale, local and global rope tables, and (1 + weight) norms folded at load; Gemma 2
the same less q/k norms and local rope, plus soft-capped attention scores.

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
from omnivox.models.fused_decode import MANY_MAX_ROWS, fused_decode_for
from omnivox.models.layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary, linear
from omnivox.models.moe import Experts, SparseMoeBlock, expert_tensor


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
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.partial_rotary = cfg.rotary_dim is not None  # the fused CPU step rotates whole heads only
        self.local_rope = layer in cfg.local_rope_layers  # reads DecoderModel.rotary_local's tables
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2: scores soft-capped (models/attention.py)

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
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(t, q_rows))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.inter = inter = intermediate_size or cfg.intermediate_size  # Qwen2-MoE's shared expert: its own
        self.gate_up_proj = PackedLinear(cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act  # "silu" or "gelu_tanh" (the fused CPU step computes both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate = gate_up[:, : self.inter]
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * gate_up[:, self.inter :])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = make_mlp(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: dense, or (a MoE family's sparse layers) the routed experts."""
    if cfg.moe is None or layer not in cfg.moe.sparse_layers:
        return MLP(cfg)
    shared = cfg.moe.shared_expert_intermediate_size
    return SparseMoeBlock(cfg, MLP(cfg, shared) if shared else None)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 / 3's layer: post_attention_layernorm norms the attention output (not the MLP input), and the MLP sits
    between pre_feedforward_layernorm and post_feedforward_layernorm. Its own type: the fused CPU step (which runs
    DecoderLayer's arithmetic) passes it to the torch path."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


# Checkpoint names that land inside a packed layer: checkpoint suffix -> (our module, part name).
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q_proj"),
    "k_proj": ("qkv_proj", "k_proj"),
    "v_proj": ("qkv_proj", "v_proj"),
    "gate_proj": ("gate_up_proj", "gate_proj"),
    "up_proj": ("gate_up_proj", "up_proj"),
}


def split_fused_projections(cfg: ModelConfig, tensors: Iterable[tuple[str, object]]):
    """Phi-3's fused checkpoint projections as the separate ones every loader reads: `self_attn.qkv_proj` into
    q/k/v rows, `mlp.gate_up_proj` into gate (first half) and up (second), as transformers' Phi3 slices them.
    Mixtral's `block_sparse_moe` is renamed `mlp` (as transformers does). Other names pass through (idempotent: a
    stream already split is unchanged)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for name, tensor in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected q + k + v = {q + 2 * kv}")
            yield f"{base}q_proj.{kind}", tensor[:q]
            yield f"{base}k_proj.{kind}", tensor[q : q + kv]
            yield f"{base}v_proj.{kind}", tensor[q + kv :]
        elif prefix.endswith("mlp.gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            if tensor.shape[0] != 2 * inter:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected gate + up = {2 * inter}")
            yield f"{base}gate_proj.{kind}", tensor[:inter]
            yield f"{base}up_proj.{kind}", tensor[inter:]
        else:
            yield name, tensor


def norm_value(cfg: ModelConfig, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint RMSNorm weight as our RMSNorm multiplies by it: Gemma's (1 + weight) folded, in float32 (the
    norm then multiplies by 1 + w, as transformers does, rounded once to the model dtype)."""
    return tensor.float() + cfg.norm_offset if cfg.norm_offset else tensor


def make_rotaries(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """(the rope tables of every layer, or of the global ones; the local layers' tables or None). Gemma 3's
    sliding layers rotate with rope_parameters["sliding_attention"] (rope_local_base_freq), the others with
    ["full_attention"] (rope_theta plus any scaling)."""
    if cfg.local_rope_layers:
        full = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, "full_attention", cfg.rotary_dim)
        local = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, "sliding_attention", cfg.rotary_dim)
        return full, local
    return RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, rotary_dim=cfg.rotary_dim), None


def scale_embeddings(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Embedding rows times the family's scale (Gemma: sqrt(hidden)), the scale rounded to x's dtype first as
    transformers does (sqrt(3072) is 55.5 in bf16); unchanged when the family has none."""
    return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)


class DecoderModel(nn.Module):
    """Token (or embedding) rows in, logits out; attention state lives in the caller's paged KV cache."""

    # (layer, attention, MLP): the exact classes the fused CPU decode step computes (models/fused_decode.py); a layer
    # of any other class (Gemma 3's SandwichDecoderLayer) takes the torch path.
    fused_layer_types: tuple[type, type, type] = (DecoderLayer, Attention, MLP)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary, self.rotary_local = make_rotaries(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the layers take them ([T] -> [T, hidden]): Gemma's scaled by sqrt(hidden), the scale
        rounded to the model dtype as transformers does."""
        return scale_embeddings(self.embed_tokens(input_ids), self.config.embed_scale)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], or [3, T] M-RoPE rows for Qwen2.5-VL (KV slots stay 1-D: slot_mapping)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embed_rows: torch.Tensor | None = None,  # [S] rows whose embedding is replaced (vision / audio segments)
        embed_values: torch.Tensor | None = None,  # [S, hidden]
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.embed(input_ids)
        if embed_rows is not None and embed_rows.numel():
            x = x.index_copy(0, embed_rows, embed_values.to(x.dtype))
        rope = self.rotary.tables(positions, x.dtype)
        small_cpu = x.device.type == "cpu" and x.shape[0] <= MANY_MAX_ROWS  # fused.applies checks its own bound
        fused = fused_decode_for(self) if small_cpu and self.config.moe is None else None  # the C step has no experts
        if fused is not None and fused.applies(x, meta):  # a small CPU step: all layers in one C call
            return self.norm(fused(x, rope, kv_caches, meta, self.config.intermediate_size))
        local = self.rotary_local.tables(positions, x.dtype) if self.rotary_local is not None else None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, local if layer.self_attn.local_rope else rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, window: tuple[int, int] | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32; with `window` (lo, hi) only the vocabulary rows lo..hi-1 are projected
        ([N, hi - lo]: the sampler's candidates all lie there, engine/vocab_window.py)."""
        logits = self._project(hidden, window)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # elementwise: any window gives the same rows

    def _project(self, hidden: torch.Tensor, window: tuple[int, int] | None) -> torch.Tensor:
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
        for name, tensor in split_fused_projections(self.config, tensors):
            ours = name.removeprefix("model.")
            if "rotary_emb" in ours:
                continue
            if ours == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            if load_expert(self, ours, tensor):
                continue
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
            if isinstance(self.get_submodule(ours.rpartition(".")[0]), RMSNorm):
                tensor = norm_value(self.config, tensor)
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(ours)
        missing = []
        for pname, _ in self.named_parameters():
            mod_name, _, kind = pname.rpartition(".")
            mod = self.get_submodule(mod_name)
            if isinstance(mod, PackedLinear):
                missing += [f"{mod_name}.{p}.{kind}" for p in mod.parts if f"{mod_name}.{p}.{kind}" not in loaded]
            elif isinstance(mod, Experts) and pname not in loaded:  # stacked whole, or expert by expert
                missing += mod.missing(mod_name, kind)
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def load_expert(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copy a per-expert checkpoint tensor (`layers.0.mlp.experts.3.gate_proj.weight`, no "model." prefix) into its
    stacked slot; False for any other name. Every loader calls this before its own routing."""
    where = expert_tensor(name)
    if where is None:
        return False
    module, expert, proj = where
    try:
        experts = model.get_submodule(module)
    except AttributeError:
        experts = None
    if not isinstance(experts, Experts):
        raise ValueError(f"checkpoint tensor {name!r} has no place in the {model.config.family} model")
    experts.load_expert(expert, proj, tensor)
    return True
