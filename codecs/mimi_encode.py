"""Mimi's encoder: 24 kHz audio -> code frames, one shot (transformers' `MimiModel.encode`), for CSM's voice prompts.

A created CSM voice is a reference recording encoded once (services/processing/csm_voice.py), so this runs off the decode path,
on the whole recording at once: no streaming state. The layers mirror transformers' names so that a Mimi folder's
(or a CSM folder's `codec_model.`) tensors load by name:

- SEANet encoder (`encoder.layers.N`): conv, then per ratio (reversed) residual blocks, ELU and a strided conv,
  then ELU and a conv; causal convs pad `kernel - stride` on the left (constant) plus the extra right padding that
  makes the last window whole (transformers' `_get_extra_padding_for_conv1d`);
- the encoder transformer (`encoder_transformer.`): the decoder's layers (codecs/mimi_layers.py), on a fresh state;
- `downsample`: a causal strided conv with replicate padding, to the frame rate;
- the split residual quantizer: semantic and acoustic groups, each projected in and quantized codebook by codebook to
  the nearest centroid (Euclidean, on the residual), codes concatenated semantic-first.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import MimiConfig

from omnivox.codecs.mimi import read_mimi_config, read_tensors
from omnivox.codecs.mimi_layers import DecoderTransformer


class CausalConv1d(nn.Module):
    """transformers' causal `MimiConv1d` for a whole signal: left padding `kernel - stride`, right padding to fit."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, **kw) -> None:
        super().__init__()
        self.pad_mode = kw.pop("pad_mode", "constant")
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, **kw)
        self.kernel = (kernel - 1) * dilation + 1
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B x C_in x T) -> (B x C_out x ceil(T / stride))
        length, total = x.shape[-1], self.kernel - self.stride
        frames = math.ceil((length - self.kernel + total) / self.stride + 1) - 1
        extra = frames * self.stride + self.kernel - total - length
        return self.conv(F.pad(x, (total, extra), mode=self.pad_mode))


class EncoderResnetBlock(nn.Module):
    """transformers' `MimiResnetBlock` of the encoder: ELU, conv (dilated), ELU, conv 1x1, plus the input."""

    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int, conv_shortcut: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [nn.ELU(), CausalConv1d(dim, hidden, kernel, dilation=dilation), nn.ELU(), CausalConv1d(hidden, dim, 1)]
        )
        self.shortcut = CausalConv1d(dim, dim, 1) if conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return (x if self.shortcut is None else self.shortcut(x)) + h


class SeanetEncoder(nn.Module):
    """transformers' `MimiEncoder` (SEANet): (B x 1 x T) -> (B x hidden x T / hop)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.layers = _seanet_layers(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _seanet_layers(config: MimiConfig) -> nn.ModuleList:
    nf, scale = config.num_filters, 1
    layers: list[nn.Module] = [CausalConv1d(config.audio_channels, nf, config.kernel_size)]
    for ratio in reversed(config.upsampling_ratios):
        dim = scale * nf
        for j in range(config.num_residual_layers):
            layers.append(
                EncoderResnetBlock(
                    dim,
                    dim // config.compress,
                    config.residual_kernel_size,
                    config.dilation_growth_rate**j,
                    config.use_conv_shortcut,
                )
            )
        layers += [nn.ELU(), CausalConv1d(dim, dim * 2, kernel=ratio * 2, stride=ratio)]
        scale *= 2
    layers += [nn.ELU(), CausalConv1d(scale * nf, config.hidden_size, config.last_kernel_size)]
    return nn.ModuleList(layers)


class MimiEncoder(nn.Module):
    """audio (B x T samples) at the codec's rate -> codes (B x K x frames). One encode at a time (a lock)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        if not config.use_causal_conv or config.pad_mode != "constant" or config.audio_channels != 1:
            raise ValueError("only causal mono Mimi encoders (constant padding) are served")
        self.config = config
        self.encoder = SeanetEncoder(config)
        rope = config.rope_parameters or {}
        self.encoder_transformer = DecoderTransformer(
            {**config.to_dict(), "head_dim": config.head_dim, "rope_theta": rope.get("rope_theta", 10000.0)}
        )
        stride = int(config.latent_stride) if config.frame_rate != config.encodec_frame_rate else 1
        h = config.hidden_size
        self.downsample = (
            CausalConv1d(h, h, 2 * stride, stride, bias=False, pad_mode="replicate") if stride > 1 else None
        )
        self.num_semantic, k, dim = config.num_semantic_quantizers, config.codebook_size, config.codebook_dim
        self.codebooks = nn.Parameter(torch.zeros(config.num_quantizers, k, dim), requires_grad=False)  # (Q x K x D)
        vq = config.vector_quantization_hidden_dimension
        self.semantic_proj = nn.Conv1d(h, vq, 1, bias=False) if vq != h else None
        self.acoustic_proj = nn.Conv1d(h, vq, 1, bias=False) if vq != h else None
        self.frame_samples = stride * math.prod(config.upsampling_ratios)
        self._lock = threading.Lock()
        self.eval()

    @classmethod
    def from_folder(cls, path: str | Path, prefix: str = "", device=None) -> MimiEncoder:
        """A Mimi folder, or a CSM folder with `prefix="codec_model."` (its config's `codec_config`)."""
        path = Path(path)
        return cls.from_tensors(MimiConfig(**read_mimi_config(path)), read_tensors(path, prefix), device)

    @classmethod
    def from_tensors(cls, config: MimiConfig, tensors: dict[str, torch.Tensor], device=None) -> MimiEncoder:
        model = cls(config)
        state = {}
        for name in model.state_dict():
            if name == "codebooks" or name in ("semantic_proj.weight", "acoustic_proj.weight"):
                continue
            if name not in tensors:
                raise ValueError(f"Mimi checkpoint lacks {name} (a decoder-only Mimi cannot encode)")
            state[name] = tensors[name]
        books = []
        for group, count in (
            ("semantic", model.num_semantic),
            ("acoustic", config.num_quantizers - model.num_semantic),
        ):
            base = f"quantizer.{group}_residual_vector_quantizer"
            for j in range(count):
                usage = tensors[f"{base}.layers.{j}.codebook.cluster_usage"].float()  # (K,)
                books.append(tensors[f"{base}.layers.{j}.codebook.embed_sum"].float() / usage.clamp(min=1e-5)[:, None])
            if getattr(model, f"{group}_proj") is not None:
                state[f"{group}_proj.weight"] = tensors[f"{base}.input_proj.weight"]
        state["codebooks"] = torch.stack(books)
        model.load_state_dict(state, strict=True)
        return model.to(device or "cpu")

    @property
    def sample_rate(self) -> int:
        return int(self.config.sampling_rate)

    def _quantize(self, latents: torch.Tensor, books: torch.Tensor, proj: nn.Module | None) -> list[torch.Tensor]:
        """latents (B x hidden x F) -> one (B x F) code tensor per codebook of `books` (n x K x D), residually."""
        residual = (latents if proj is None else proj(latents)).transpose(1, 2).float()  # (B x F x D)
        codes = []
        for book in books:
            index = torch.cdist(residual, book[None].expand(residual.shape[0], -1, -1)).argmin(dim=-1)  # (B x F)
            residual = residual - F.embedding(index, book)
            codes.append(index)
        return codes

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor, num_codebooks: int | None = None) -> torch.Tensor:
        """audio (B x T) float at `sample_rate` -> codes (B x K x ceil(T / frame_samples)), K = num_codebooks."""
        k = num_codebooks or self.config.num_quantizers
        if not self.num_semantic <= k <= self.config.num_quantizers:
            raise ValueError(f"{k} codebooks asked; this Mimi has {self.num_semantic}..{self.config.num_quantizers}")
        with self._lock:
            x = audio.to(self.codebooks.device, torch.float32)[:, None]  # (B x 1 x T)
            x = self.encoder(x)  # (B x hidden x T / hop)
            states = [
                layer.self_attn.init_state(x.shape[0], x.device, x.dtype) for layer in self.encoder_transformer.layers
            ]
            start = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
            x = self.encoder_transformer(x.transpose(1, 2), start, states).transpose(1, 2)
            if self.downsample is not None:
                x = self.downsample(x)  # (B x hidden x frames)
            codes = self._quantize(x, self.codebooks[: self.num_semantic], self.semantic_proj)
            if k > self.num_semantic:
                codes += self._quantize(x, self.codebooks[self.num_semantic : k], self.acoustic_proj)
        return torch.stack(codes, dim=1)
