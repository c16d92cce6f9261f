"""Whisper (encoder and decoder of a `WhisperForConditionalGeneration`), with the decoder on the paged KV cache.

Design (issue 11). vLLM and SGLang both struggled with encoder-decoder models: vLLM kept a second, separately
allocated cross-attention KV cache with its own block tables and turned prefix caching off for it; a chunked prefill
that splits the 1,500-frame encoder "prefix" across steps needed special cases. We avoid all three:
- The cross-attention keys/values are not in the paged cache at all. They depend only on the audio, so the encoder
  worker computes them once per audio (`encode_cross`: encoder + every decoder layer's encoder_attn k/v projections)
  as ONE tensor [num_layers, 2, heads, 1500, head_dim] per audio, shared through the encoder cache (same key: same
  tensor, several requests may hold it). The engine holds it per request and passes it to `forward` as `cross`;
  cross-attention is plain SDPA over it per request chunk (no mask: every encoder frame is visible to every row).
  Whisper-base: 6 layers x 2 x 1500 x 512 x 4 B = 36.9 MB per audio in float32.
- Self-attention over the decoder's own tokens reads and writes the paged cache exactly like the text decoder
  (`write_kv` + `paged_attention`), so chunked prefill, decode batching and prefix caching of the decoder prompt work
  unchanged; the engine folds the audio's key into the block hashes (decoder states depend on the audio).
- No rope: learned absolute positions (`embed_positions[positions]`, at most `max_target_positions` = 448).
Pre-LayerNorm blocks, GELU MLPs, a final LayerNorm; logits from the tied token embedding (`proj_out` in transformers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models.attention import AttentionMetadata, paged_attention, write_kv
from omnivox.models.config import ModelConfig
from omnivox.models.layers import Linear, PackedLinear, linear
from omnivox.models.meta import meta_device

# One cross-attention span of a step: (first row, number of rows, kv [num_layers, 2, heads, T_enc, head_dim]).
CrossSpan = tuple[int, int, torch.Tensor]


def whisper_model_config(hf_config: Any, max_model_len: int | None = None) -> ModelConfig:
    """The engine's view of a WhisperConfig: the decoder's shape (the encoder is this module's own business)."""
    if getattr(hf_config, "model_type", None) != "whisper":
        raise ValueError(f"not a Whisper config: model_type {getattr(hf_config, 'model_type', None)!r}")
    if getattr(hf_config, "activation_function", "gelu") != "gelu":
        raise ValueError(
            f"Whisper config activation_function {hf_config.activation_function!r} is not supported (only 'gelu')"
        )
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    heads, d = int(hf_config.decoder_attention_heads), int(hf_config.d_model)
    max_pos = int(hf_config.max_target_positions)
    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family="whisper",
        vocab_size=int(hf_config.vocab_size),
        hidden_size=d,
        intermediate_size=int(hf_config.decoder_ffn_dim),
        num_layers=int(hf_config.decoder_layers),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
        rms_norm_eps=1e-5,  # LayerNorm's eps (transformers' nn.LayerNorm default); no RMSNorm here
        max_position_embeddings=max_pos,
        max_model_len=min(max_pos, max_model_len) if max_model_len else max_pos,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        attention_bias=True,  # q / v / out carry a bias; k has none
        mlp_bias=True,
        qk_norm=False,
        eos_token_ids=eos_ids,
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        hf_config=hf_config,
    )


def _qkv(d: int) -> PackedLinear:
    # Whisper's k_proj has no bias: its slice of the packed bias is zeroed at load (`_zero_k_bias`).
    return PackedLinear(d, {"q_proj": d, "k_proj": d, "v_proj": d}, bias=True)


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _qkv(d)
        self.self_attn.out_proj = Linear(d, d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, ffn), Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d]
        b, t, d = x.shape
        qkv = self.self_attn.qkv_proj(self.self_attn_layer_norm(x)).view(b, t, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, hd]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        x = x + self.self_attn.out_proj(o.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as transformers does: keep float16 activations finite
            big = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-big, big)
        return x


class WhisperEncoder(nn.Module):
    def __init__(self, hf: Any) -> None:
        super().__init__()
        d = int(hf.d_model)
        self.conv1 = nn.Conv1d(int(hf.num_mel_bins), d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(int(hf.max_source_positions), d)
        heads, ffn = int(hf.encoder_attention_heads), int(hf.encoder_ffn_dim)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ffn) for _ in range(int(hf.encoder_layers)))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, n_mels, 2 * T_enc] -> [B, T_enc, d]
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)  # [B, T_enc, d]
        x = x + self.embed_positions.weight[: x.shape[1]]  # a short window takes the first T_enc positions
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _qkv(d)
        self.self_attn.out_proj = Linear(d, d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = nn.Module()
        self.encoder_attn.q_proj = Linear(d, d)
        # k|v of the encoder states: used only by `cross_kv` (the encoder worker), never in the decode step.
        self.encoder_attn.kv_proj = PackedLinear(d, {"k_proj": d, "v_proj": d}, bias=True)
        self.encoder_attn.out_proj = Linear(d, d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, cfg.intermediate_size), Linear(cfg.intermediate_size, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, cross, layer: int):
        t, d = x.shape
        qkv = self.self_attn.qkv_proj(self.self_attn_layer_norm(x)).view(t, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [T, H, hd]
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        x = x + self.self_attn.out_proj(paged_attention(q, kv[0], kv[1], meta, self.scale).reshape(t, d))
        if cross is not None:
            q = self.encoder_attn.q_proj(self.encoder_attn_layer_norm(x)).view(t, self.heads, self.head_dim)
            o = torch.empty_like(q)
            for start, n, states in cross:
                qc = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
                kc, vc = states[layer, 0].unsqueeze(0), states[layer, 1].unsqueeze(0)  # [1, H, T_enc, hd]
                o[start : start + n] = F.scaled_dot_product_attention(qc, kc, vc, scale=self.scale)[0].transpose(0, 1)
            x = x + self.encoder_attn.out_proj(o.reshape(t, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(cfg.hidden_size)


class WhisperModel(nn.Module):
    """Whisper's encoder and decoder; the decoder reads the caller's paged KV cache and per-request cross kv."""

    is_encoder_decoder = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.num_mel_bins = int(hf.num_mel_bins)
        self.encoder_len = int(hf.max_source_positions)  # 1500 encoder frames
        self.num_frames = 2 * self.encoder_len  # 3000 mel frames = 30 s of 10 ms (conv2 has stride 2)
        self.encoder = WhisperEncoder(hf)
        self.decoder = WhisperDecoder(cfg)
        self.proj_out = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -- encoder side (the encoder worker) ----------------------------------------------------------------------------

    def encode(self, features: torch.Tensor, encoder: nn.Module | None = None) -> torch.Tensor:
        """Log-mel features [B, n_mels, F] -> encoder states [B, F / 2, d_model] (in the model's dtype); `encoder`: a
        stand-in for `self.encoder` with the same layout (the int8 copy of models/audio/whisper_int8.py).

        F is 3000 (the 30 s window transformers' encoder insists on) or a shorter even window, the first F frames of
        the padded 30 s features: the encoder then reads only the first F / 2 positions (the audio must end well
        before the window does, see `short_window_frames`). whisper-base on 40 clips of 2-8 s: see BENCHMARKS.md
        "Whisper short windows"."""
        frames = features.shape[-1] if features.dim() == 3 else 0
        if features.dim() != 3 or features.shape[1] != self.num_mel_bins or not _valid_window(frames, self.num_frames):
            raise ValueError(
                f"Whisper features must be [B, {self.num_mel_bins}, F] with F = {self.num_frames} or an even F below "
                f"it, got {tuple(features.shape)}"
            )
        w = self.encoder.conv1.weight
        return (encoder or self.encoder)(features.to(w.device, w.dtype))

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder states [T_enc, d] -> every decoder layer's cross-attention k, v: [L, 2, H, T_enc, hd] for SDPA."""
        t = states.shape[0]
        cfg = self.config
        out = states.new_empty(cfg.num_layers, 2, cfg.num_heads, t, cfg.head_dim)
        for i, layer in enumerate(self.decoder.layers):
            kv = layer.encoder_attn.kv_proj(states).view(t, 2, cfg.num_heads, cfg.head_dim)
            out[i] = kv.permute(1, 2, 0, 3)
        return out

    def encode_cross(
        self, features: torch.Tensor | Sequence[torch.Tensor], encoder: nn.Module | None = None
    ) -> list[torch.Tensor]:
        """What the encoder worker runs: features [B, n_mels, 3000] (or a list of [n_mels, 3000], as `EncoderWorker`
        passes its queued payloads) -> one cross kv tensor per audio."""
        if not isinstance(features, torch.Tensor):
            features = torch.stack([f.to(self.encoder.conv1.weight.device) for f in features])
        return [self.cross_kv(s) for s in self.encode(features, encoder)]

    # -- decoder side (the engine's step) -----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] decoder positions (< max_target_positions)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embed_rows: torch.Tensor | None = None,  # [S] rows whose embedding is replaced (unused by Whisper prompts)
        embed_values: torch.Tensor | None = None,  # [S, d]
        cross: list[CrossSpan] | None = None,
    ) -> torch.Tensor:  # hidden [T, d]
        """`cross`: (first_row, num_rows, kv) per request chunk, covering rows [0, T) in order (decode rows first,
        one span each, then the prefill chunks), kv as `cross_kv` returns it. None skips cross-attention, as
        transformers does without encoder states: only for a memory-profiling pass, never for real requests."""
        dec = self.decoder
        x = dec.embed_tokens(input_ids)
        if embed_rows is not None and embed_rows.numel():
            x = x.index_copy(0, embed_rows, embed_values.to(x.dtype))
        x = x + dec.embed_positions.weight.index_select(0, positions)
        if cross is not None:
            row = 0
            for start, n, _ in cross:
                if start != row:
                    raise ValueError(f"cross spans must cover the rows in order: a span starts at {start}, not {row}")
                row += n
            if row != x.shape[0]:
                raise ValueError(f"cross spans cover {row} rows of {x.shape[0]}")
        for i, (layer, kv) in enumerate(zip(dec.layers, kv_caches, strict=True)):
            x = layer(x, kv, meta, cross, i)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor, window: tuple[int, int] | None = None) -> torch.Tensor:
        """[N, d] -> [N, vocab] float32; `window` (lo, hi): only vocabulary rows lo..hi-1 ([N, hi - lo])."""
        if window is not None:
            return self.compute_logits(hidden)[:, window[0] : window[1]]
        if self.proj_out is None:  # tied: the token embedding is the output projection
            return linear(hidden, self.decoder.embed_tokens.weight).float()
        return self.proj_out(hidden).float()

    # -- weights ------------------------------------------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers' `WhisperForConditionalGeneration` tensors into place; fail on unknown or missing ones.

        `model.` is stripped; q/k/v land in packed projections (k has no bias: its bias slice is zero);
        `proj_out.weight` is skipped when tied.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors:
            ours = name.removeprefix("model.")
            if ours == "proj_out.weight" and self.proj_out is None:
                continue
            parts = ours.split(".")
            if len(parts) >= 3 and parts[-3] in ("self_attn", "encoder_attn") and parts[-2] in _PACKED_PARTS:
                attn, proj, kind = parts[-3], parts[-2], parts[-1]
                packed = "kv_proj" if attn == "encoder_attn" else "qkv_proj"
                if not (attn == "encoder_attn" and proj == "q_proj"):
                    if proj == "k_proj" and kind == "bias":
                        raise ValueError(f"{name}: Whisper's k_proj has no bias")
                    target = ".".join(parts[:-2] + [packed])
                    self.get_submodule(target).load_part(proj, kind, tensor)
                    loaded.add(f"{target}.{proj}.{kind}")
                    continue
            if ours not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the Whisper model")
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
                for part in mod.parts:
                    if part == "k_proj" and kind == "bias":
                        _zero_k_bias(mod)
                    elif f"{mod_name}.{part}.{kind}" not in loaded:
                        missing.append(f"{mod_name}.{part}.{kind}")
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


_PACKED_PARTS = ("q_proj", "k_proj", "v_proj")


def _valid_window(frames: int, full: int) -> bool:
    return frames == full or (0 < frames < full and frames % 2 == 0)


def short_window_frames(num_samples: int, window_s: float, margin_s: float, full_frames: int, rate: int = 16000) -> int:
    """The mel frames to encode for a clip of `num_samples`: a `window_s` window (100 frames a second) when the clip
    ends at least `margin_s` before it, else the full window. Windows cut close to the clip's end made whisper-base
    loop ("... simbication." x8 on 2 of 6 espeak sentences with 0.3-1 s of padding): keep the margin seconds long."""
    frames = 2 * int(window_s * 50)
    if frames >= full_frames or num_samples > (window_s - margin_s) * rate:
        return full_frames
    return frames


def _zero_k_bias(mod: PackedLinear) -> None:
    start, rows = mod.offsets["k_proj"]
    with torch.no_grad():
        mod.bias[start : start + rows].zero_()


def build_whisper(
    hf_config: Any, device: torch.device | str, dtype: torch.dtype, max_model_len: int | None = None
) -> WhisperModel:
    """A WhisperModel allocated on `device` in `dtype`, weights uninitialised (call `load_weights`)."""
    cfg = whisper_model_config(hf_config, max_model_len)
    with meta_device():  # not torch.device("meta"): its init fills import torch._dynamo (~1 s)
        model = WhisperModel(cfg)
    model.to_empty(device=torch.device(device))
    return model.to(dtype).eval()


def load_whisper(
    path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, max_model_len: int | None = None
) -> WhisperModel:
    """`build_whisper` + `load_weights` from a transformers checkpoint folder."""
    from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config

    model = build_whisper(load_hf_config(path), device, dtype, max_model_len)
    model.load_weights(iter_checkpoint_tensors(path, part=None))
    return model
