"""Mimi audio decoding (kyutai/mimi, the codec of Sesame CSM and Moshi): codes -> 24 kHz waveform, streamed.

Our own decoder (codecs/mimi_layers.py) with the weights of a transformers `MimiModel` checkpoint: a Mimi folder
(`config.json` + safetensors, the flat names kyutai publishes and `save_pretrained` writes) or the `codec_model.`
part of a CSM folder. transformers supplies the config (`MimiConfig`: frame rate, latent stride, head size), nothing
else; `MimiModel.decode` is the reference the tests compare against (tests/codecs/test_codec_mimi.py: within 1e-4).

Decoding is stateful: `new_state(batch)` then `decode_chunk(codes, state)` for each run of frames gives exactly the
audio of decoding all the frames at once (the model is causal; see codecs/mimi_layers.py), so a stream emits each
frame's audio once, with no overlap to re-decode and no crossfade. `decode` is one chunk on a fresh state. States of
different streams stack into one batch (`MimiDecodeState.cat`) and split back (`split`): streams at different
positions decode together in one pass (codecs/mimi_streaming.py).

Shapes: codes (B x K x T), K codebooks (the first `num_semantic_quantizers` semantic, the rest acoustic, as in
transformers), T frames of `frame_samples` samples each; audio (B x T*frame_samples) float32.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import MimiConfig

from omnivox.codecs.mimi_layers import (
    DecoderTransformer,
    ResnetBlock,
    State,
    StreamingConv1d,
    StreamingConvTranspose1d,
)


@dataclass
class MimiDecodeState:
    """The carried state of B streams: one dict of batch-first tensors per streaming module, in the decoder's order,
    and each row's next transformer position (frames decoded x latent stride)."""

    modules: list[State]
    start: torch.Tensor  # (B,) int64

    @property
    def batch_size(self) -> int:
        return int(self.start.shape[0])

    @staticmethod
    def cat(states: Sequence[MimiDecodeState]) -> MimiDecodeState:
        """Stack streams' states into one batch (rows in the given order)."""
        if len(states) == 1:
            return states[0]
        modules = [
            {name: torch.cat([s.modules[i][name] for s in states]) for name in states[0].modules[i]}
            for i in range(len(states[0].modules))
        ]
        return MimiDecodeState(modules, torch.cat([s.start for s in states]))

    def split(self) -> list[MimiDecodeState]:
        """One state per row (copies: a stream's state does not keep the batch's tensors alive)."""
        if self.batch_size == 1:
            return [self]
        return [
            MimiDecodeState(
                [{name: t[row : row + 1].clone() for name, t in m.items()} for m in self.modules],
                self.start[row : row + 1].clone(),
            )
            for row in range(self.batch_size)
        ]


class SeanetDecoder(nn.Module):
    """transformers' `MimiDecoder` (SEANet): conv, then per ratio ELU + transposed conv + residual blocks, ELU, conv."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        scale = 2 ** len(config.upsampling_ratios)
        nf = config.num_filters
        layers: list[nn.Module] = [StreamingConv1d(config.hidden_size, scale * nf, config.kernel_size)]
        for ratio in config.upsampling_ratios:
            dim = scale * nf
            layers += [nn.ELU(), StreamingConvTranspose1d(dim, dim // 2, kernel_size=2 * ratio, stride=ratio)]
            for j in range(config.num_residual_layers):
                layers.append(
                    ResnetBlock(
                        dim // 2,
                        dim // 2 // config.compress,
                        config.residual_kernel_size,
                        config.dilation_growth_rate**j,
                        config.use_conv_shortcut,
                    )
                )
            scale //= 2
        layers += [nn.ELU(), StreamingConv1d(nf, config.audio_channels, config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def streaming_modules(self) -> list[nn.Module]:
        out: list[nn.Module] = []
        for layer in self.layers:
            if isinstance(layer, ResnetBlock):
                out += layer.streaming_modules()
            elif not isinstance(layer, nn.ELU):
                out.append(layer)
        return out

    def forward(self, x: torch.Tensor, states: list[State]) -> torch.Tensor:  # (B x hidden x T) -> (B x C x T*hop)
        i = 0
        for layer in self.layers:
            if isinstance(layer, nn.ELU):
                x = layer(x)
            elif isinstance(layer, ResnetBlock):
                n = len(layer.streaming_modules())
                x = layer(x, states[i : i + n])
                i += n
            else:
                x = layer(x, states[i])
                i += 1
        return x


class MimiDecoder(nn.Module):
    """Mimi codes -> audio, streamed. One decode at a time per instance (a lock); inference only."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        if not config.use_causal_conv or config.trim_right_ratio != 1.0 or config.pad_mode != "constant":
            raise ValueError("only causal Mimi decoders (constant padding, trim_right_ratio 1) stream exactly")
        if config.audio_channels != 1:
            raise ValueError(f"Mimi with {config.audio_channels} audio channels: only mono is served")
        self.config = config
        self.latent_stride = int(config.latent_stride) if config.frame_rate != config.encodec_frame_rate else 1
        self.upsample = (
            StreamingConvTranspose1d(
                config.hidden_size,
                config.hidden_size,
                kernel_size=2 * self.latent_stride,
                stride=self.latent_stride,
                groups=config.upsample_groups,
                bias=False,
            )
            if self.latent_stride > 1
            else None
        )
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Mimi rope_type {rope.get('rope_type')!r} is not supported")
        self.decoder_transformer = DecoderTransformer(
            {**config.to_dict(), "head_dim": config.head_dim, "rope_theta": rope.get("rope_theta", 10000.0)}
        )
        self.decoder = SeanetDecoder(config)
        k, dim = config.codebook_size, config.codebook_dim
        self.num_semantic = config.num_semantic_quantizers
        self.codebooks = nn.Parameter(torch.zeros(config.num_quantizers, k, dim), requires_grad=False)  # (Q x K x D)
        vq = config.vector_quantization_hidden_dimension
        self.semantic_proj = nn.Conv1d(vq, config.hidden_size, 1, bias=False) if vq != config.hidden_size else None
        self.acoustic_proj = nn.Conv1d(vq, config.hidden_size, 1, bias=False) if vq != config.hidden_size else None
        self.frame_samples = self.latent_stride * math.prod(config.upsampling_ratios)
        self._lock = threading.Lock()
        self.eval()

    # --- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls,
        config: dict | MimiConfig,
        tensors: dict[str, torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MimiDecoder:
        """Build from a Mimi config and its checkpoint's tensors (flat names: `decoder.layers.0.conv.weight`...);
        fails naming the first missing tensor."""
        config = config if isinstance(config, MimiConfig) else MimiConfig(**config)
        model = cls(config)
        state = {}
        for name in model.state_dict():
            if name == "codebooks" or name.endswith("_proj.weight") and name.split("_")[0] in ("semantic", "acoustic"):
                continue  # from the quantizer's tensors, below
            if name not in tensors:
                raise ValueError(f"Mimi checkpoint lacks {name}")
            state[name] = tensors[name]
        books = []
        groups = [
            ("semantic", range(model.num_semantic)),
            ("acoustic", range(config.num_quantizers - model.num_semantic)),
        ]
        for group, indices in groups:
            base = f"quantizer.{group}_residual_vector_quantizer"
            for j in indices:
                embed_sum = tensors[f"{base}.layers.{j}.codebook.embed_sum"].float()  # (K x D)
                usage = tensors[f"{base}.layers.{j}.codebook.cluster_usage"].float()  # (K,)
                books.append(embed_sum / usage.clamp(min=1e-5)[:, None])  # transformers' MimiEuclideanCodebook.embed
            proj = getattr(model, f"{group}_proj")
            if proj is not None:
                state[f"{group}_proj.weight"] = tensors[f"{base}.output_proj.weight"]
        state["codebooks"] = torch.stack(books)
        model.load_state_dict(state, strict=True)
        return model.to(device=device or "cpu", dtype=dtype or torch.float32)

    @classmethod
    def from_folder(
        cls, path: str | Path, prefix: str = "", device: torch.device | str | None = None, dtype=None
    ) -> MimiDecoder:
        """A Mimi folder (config.json of model_type mimi), or a CSM folder with `prefix="codec_model."` (its
        config.json's `codec_config`)."""
        path = Path(path)
        return cls.from_tensors(read_mimi_config(path), read_tensors(path, prefix), device=device, dtype=dtype)

    # --- decoding ------------------------------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return int(self.config.sampling_rate)

    @property
    def num_codebooks(self) -> int:
        return int(self.config.num_quantizers)

    @property
    def codebook_size(self) -> int:
        return int(self.config.codebook_size)

    @property
    def device(self) -> torch.device:
        return self.codebooks.device

    def _streaming_modules(self) -> list[nn.Module]:
        head = [self.upsample] if self.upsample is not None else []
        return head + list(self.decoder_transformer.layers) + self.decoder.streaming_modules()

    def new_state(self, batch: int = 1) -> MimiDecodeState:
        """Fresh state for `batch` streams (each at position 0)."""
        dtype = self.codebooks.dtype
        modules = [
            (m.self_attn if hasattr(m, "self_attn") else m).init_state(batch, self.device, dtype)
            for m in self._streaming_modules()
        ]
        return MimiDecodeState(modules, torch.zeros(batch, dtype=torch.int64, device=self.device))

    @contextmanager
    def streaming(self, batch: int = 1) -> Iterator[MimiStream]:
        """moshi's `with module.streaming(batch):`, as an object: `stream.decode(codes)` chunk after chunk."""
        yield MimiStream(self, self.new_state(batch))

    def _latent(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B x K x T) -> (B x hidden x T): transformers' MimiSplitResidualVectorQuantizer.decode."""
        books = self.codebooks[: codes.shape[1]]  # (K x codebook_size x D)
        embedded = torch.stack([F.embedding(codes[:, i], books[i]) for i in range(codes.shape[1])])  # (K x B x T x D)
        semantic = embedded[: self.num_semantic].sum(0).transpose(1, 2)  # (B x D x T)
        if self.semantic_proj is not None:
            semantic = self.semantic_proj(semantic)
        if codes.shape[1] <= self.num_semantic:
            return semantic
        acoustic = embedded[self.num_semantic :].sum(0).transpose(1, 2)
        if self.acoustic_proj is not None:
            acoustic = self.acoustic_proj(acoustic)
        return semantic + acoustic

    def check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or not self.num_semantic <= codes.shape[1] <= self.num_codebooks:
            raise ValueError(
                f"codes must be (B x K x T) with {self.num_semantic} <= K <= {self.num_codebooks}, got {tuple(codes.shape)}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must be in [0, {self.codebook_size})")

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, state: MimiDecodeState) -> torch.Tensor:
        """The next T frames of each of the state's B streams: codes (B x K x T) -> audio (B x T*frame_samples);
        `state` advances by T frames. Codes are not checked here (`check_codes`)."""
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"{codes.shape[0]} rows of codes for a state of {state.batch_size} streams")
        with self._lock:
            if codes.shape[-1] == 0:
                return torch.zeros(codes.shape[0], 0, device=self.device)
            x = self._latent(codes.to(self.device, torch.int64))  # (B x hidden x T)
            i = 0
            if self.upsample is not None:
                x = self.upsample(x, state.modules[0])  # (B x hidden x T*stride)
                i = 1
            n = len(self.decoder_transformer.layers)
            x = self.decoder_transformer(x.transpose(1, 2), state.start, state.modules[i : i + n]).transpose(1, 2)
            state.start = state.start + x.shape[-1]
            audio = self.decoder(x, state.modules[i + n :])  # (B x 1 x T*frame_samples)
        return audio[:, 0].float()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """One-shot: codes (B x K x T) -> audio (B x T*frame_samples), a chunk on a fresh state."""
        self.check_codes(codes)
        return self.decode_chunk(codes, self.new_state(codes.shape[0]))


class MimiStream:
    """B streams decoded chunk by chunk (`MimiDecoder.streaming`)."""

    def __init__(self, decoder: MimiDecoder, state: MimiDecodeState) -> None:
        self.decoder, self.state = decoder, state

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (B x K x T) -> (B x T*frame_samples)
        self.decoder.check_codes(codes)
        return self.decoder.decode_chunk(codes, self.state)


def read_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors named `prefix...` of every safetensors file in `folder`, with the prefix dropped."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors files")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = f.get_tensor(name)
    return out


def read_mimi_config(path: Path) -> dict:
    """The Mimi config of a Mimi folder (config.json of model_type mimi) or of a CSM folder (its `codec_config`),
    without the keys transformers adds on save."""
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "mimi":
        config = config.get("codec_config") or {}
    if config.get("model_type") != "mimi":
        raise ValueError(f"{path}: no Mimi config (model_type mimi, or a codec_config of one)")
    return {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype")}
