"""Sesame CSM (transformers' `CsmForConditionalGeneration`): a Llama backbone that predicts codebook 0 of each audio
frame, and a small depth decoder that predicts codebooks 1..N-1 of the same frame from the backbone's last hidden
state.

- `CsmBackbone` is our `DecoderModel` (paged KV, the engine's batching) with CSM's two vocabularies: text tokens in
  (`embed_text_tokens`), codebook-0 logits out (`lm_head`, `vocab_size` = codebook size + specials). A generated
  frame enters the next step as the sum of its N codebook embeddings (`frame_embeddings`, transformers'
  `CsmBackboneModelEmbeddings`), through the engine's embedding segments.
- `CsmDepthDecoder` runs once per frame for every request of a step together: position 0 is the backbone's hidden
  state, position i >= 1 the embedding of code i-1 (offset by (i-1) x vocab), and position i's hidden state through
  head i-1 gives code i. Its KV is dense and lives for one frame (N positions), as transformers' `generate` of the
  depth decoder starts each frame with a fresh cache. Sampling is the caller's (engine/frame_step.py): `start`
  returns code 1's logits, `advance(codes)` the next codebook's.

Shapes: B rows (requests), N codebooks, V = vocab_size; hidden states (B x hidden).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel
from omnivox.models.layers import RMSNorm, RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class FrameLayout:
    """What a frame is, for the engine and the codec: N codes per frame of codebook vocabularies of `vocab_size`."""

    num_codebooks: int
    vocab_size: int
    eos_code: int  # a frame whose first N-1 codes are all this ends the stream (transformers' generate)
    pad_code: int


def backbone_hf_config(csm_config):
    """The backbone as a transformers Llama config (what `ModelConfig.from_hf` normalises)."""
    from transformers import LlamaConfig

    fields = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias",
        "mlp_bias", "vocab_size",
    )  # fmt: skip
    cfg = LlamaConfig(**{f: getattr(csm_config, f) for f in fields}, tie_word_embeddings=False, eos_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


class CsmBackbone(DecoderModel):
    """The backbone: text-token embeddings in, codebook-0 logits out; frames embedded by `frame_embeddings`."""

    emits_frames = True  # engine/frame_step.py: each step's token is the first code of a frame

    def __init__(self, cfg: ModelConfig, csm_config) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(csm_config.text_vocab_size, cfg.hidden_size)
        n, v = csm_config.num_codebooks, csm_config.vocab_size
        self.embed_audio_tokens = nn.Embedding(n * v, cfg.hidden_size)  # (N*V x hidden), codebook i at rows i*V..
        self.register_buffer("audio_offsets", torch.arange(n) * v, persistent=False)
        self.layout = FrameLayout(n, v, int(csm_config.codebook_eos_token_id), int(csm_config.codebook_pad_token_id))
        self.depth_decoder = CsmDepthDecoder(csm_config.depth_decoder_config)

    def load_weights(self, tensors) -> None:
        _load_csm_weights(self, tensors)

    def frame_embeddings(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B x N) -> (B x hidden): the sum of each codebook's embedding, as the next step's input."""
        return self.embed_audio_tokens(codes + self.audio_offsets).sum(dim=1)


class _DepthAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        """x (B x t x hidden) at positions [start, start + t); kv: (B x H_kv x N x D) each, filled up to start."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b * t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b * t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos.repeat(b, 1, 1), sin.repeat(b, 1, 1))
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B x H x t x D)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        keys, values = kv
        keys[:, :, start : start + t] = k
        values[:, :, start : start + t] = v
        end = start + t
        mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)  # causal
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _DepthLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"CSM depth decoder hidden_act {cfg.hidden_act!r} is not supported")
        self.self_attn = _DepthAttention(cfg)
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv, start: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


@dataclass
class DepthState:
    """One frame's depth-decoder state for B rows: per-layer dense KV and the next position."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    position: int


class CsmDepthDecoder(nn.Module):
    """transformers' `CsmDepthDecoderForCausalLM`, one frame at a time for a batch of rows."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_codebooks, self.vocab_size = cfg.num_codebooks, cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.num_codebooks * cfg.vocab_size, cfg.backbone_hidden_size)
        self.inputs_embeds_projector = nn.Linear(cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(_DepthLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # (N-1 x hidden x V): head j gives code j+1 from position j+1's hidden state
        self.codebooks_head = nn.Parameter(torch.zeros(cfg.num_codebooks - 1, cfg.hidden_size, cfg.vocab_size))
        self.rotary = RotaryEmbedding(cfg, cfg.head_dim, cfg.num_codebooks + 1)
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim

    def _run(self, x: torch.Tensor, state: DepthState) -> torch.Tensor:
        """x (B x t x backbone_hidden) at the state's next positions -> the last position's code logits (B x V)."""
        t = x.shape[1]
        positions = torch.arange(state.position, state.position + t, device=x.device)
        cos, sin = self.rotary.tables(positions, x.dtype)  # (t x 1 x D)
        h = self.inputs_embeds_projector(x)
        for layer, kv in zip(self.layers, state.kv, strict=True):
            h = layer(h, cos, sin, kv, state.position)
        state.position += t
        last = self.norm(h[:, -1])  # (B x hidden)
        return (last @ self.codebooks_head[state.position - 2]).float()  # head of the code at this position

    def start(self, backbone_hidden: torch.Tensor, first_codes: torch.Tensor) -> tuple[torch.Tensor, DepthState]:
        """backbone_hidden (B x backbone_hidden), first_codes (B,) -> code 1's logits (B x V) and the state."""
        b = backbone_hidden.shape[0]
        shape = (b, self.kv_heads, self.num_codebooks, self.head_dim)
        dt, dev = backbone_hidden.dtype, backbone_hidden.device
        state = DepthState([(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                            for _ in self.layers], 0)  # fmt: skip
        x = torch.stack([backbone_hidden, self.embed_tokens(first_codes)], dim=1)  # (B x 2 x backbone_hidden)
        return self._run(x, state), state

    def advance(self, codes: torch.Tensor, state: DepthState) -> torch.Tensor:
        """codes (B,) of codebook `state.position - 1` -> the next codebook's logits (B x V)."""
        offset = (state.position - 1) * self.vocab_size
        return self._run(self.embed_tokens(codes + offset)[:, None], state)


def backbone_tensors(tensors):
    """CSM checkpoint names -> our backbone's (transformers Llama names, plus the frame embedding and the depth
    decoder); the Mimi codec's tensors (`codec_model.`) are skipped: codecs/mimi.py loads them."""
    for name, tensor in tensors:
        if name.startswith("codec_model."):
            continue
        if name == "embed_text_tokens.weight":
            yield "embed_tokens.weight", tensor
        elif name == "backbone_model.embed_tokens.embed_audio_tokens.weight":
            yield "embed_audio_tokens.weight", tensor
        elif name.startswith("backbone_model."):
            yield name.replace("backbone_model.", "model.", 1), tensor
        elif name == "depth_decoder.codebooks_head.weight":
            yield "depth_decoder.codebooks_head", tensor
        elif name.startswith("depth_decoder.model."):
            name = name.replace("depth_decoder.model.", "depth_decoder.", 1)
            yield name.replace(".mlp.", "."), tensor
        else:
            yield name, tensor


def _load_csm_weights(model: CsmBackbone, tensors) -> None:
    """The backbone through DecoderModel.load_weights (packed projections, missing-tensor check); the frame
    embedding and the depth decoder by name, strictly. transformers ties the backbone's audio embedding to the
    depth decoder's (`tie_codebooks_embeddings`): a checkpoint may carry only one of the two."""
    extra: dict[str, torch.Tensor] = {}

    def backbone_only():
        for name, tensor in backbone_tensors(tensors):
            if name.startswith("depth_decoder.") or name == "embed_audio_tokens.weight":
                extra[name] = tensor
            else:
                yield name, tensor

    parts = {k: model._modules.pop(k) for k in ("depth_decoder", "embed_audio_tokens")}
    try:
        DecoderModel.load_weights(model, backbone_only())
    finally:
        model._modules.update(parts)
    tied = ("embed_audio_tokens.weight", "depth_decoder.embed_tokens.weight")
    for a, b in (tied, tied[::-1]):
        if a not in extra and b in extra:
            extra[a] = extra[b]
    own = {k: v for k, v in model.state_dict().items() if k.startswith(("depth_decoder.", "embed_audio_tokens."))}
    missing = sorted(set(own) - set(extra))
    if missing:
        raise ValueError(f"CSM checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    with torch.no_grad():
        for name, p in own.items():
            if p.shape != extra[name].shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(extra[name].shape)} != model {tuple(p.shape)}")
            p.copy_(extra[name])


def build_csm(csm_config, device: torch.device, dtype: torch.dtype, max_model_len: int | None = None) -> CsmBackbone:
    """CSM's backbone (with its depth decoder and frame embedding) allocated on device, weights uninitialised."""
    cfg = ModelConfig.from_hf(backbone_hf_config(csm_config), max_model_len)
    cfg = dataclasses.replace(cfg, input_vocab_size=int(csm_config.text_vocab_size))
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = CsmBackbone(cfg, csm_config)
        finally:
            torch.set_default_dtype(prev)
    model.rotary.to(torch.float32)
    model.depth_decoder.rotary.to(torch.float32)
    return model
