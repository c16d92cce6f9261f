"""Whisper's encoder with 8-bit weights: each linear of its layers as Q8_0 blocks (models/quant.py `Int8Linear`,
computed by the block kernels of models/cpu_kernels.c: on AVX-512 VNNI hosts `vpdpbusd` against activations quantised
to 15 bits per group of 32; the AVX2 many-row kernel elsewhere), the convolutions, norms and attention in float.

Measured on whisper-base, 32 clips of 1.8-6.1 s at the 10 s window (`benchmarks/whisper_window.py --int8`, BENCHMARKS.md
"Whisper short windows"): WER 0.048, float's own (29 of 32 transcripts identical; torch's fbgemm dynamic linears
0.028), at 0.84-0.91x float's encoder time in three runs (one WER run read 1.7x while a test run overlapped it): served
only with `serve --whisper-int8-short-window` (services/parts/whisper_part.py passes it to `WhisperModel.encode`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from omnivox.models import cpu_kernels
from omnivox.models.layers import Linear, PackedLinear
from omnivox.models.quant import Int8Linear


class RowsInt8Linear(nn.Module):
    """An Int8Linear over [..., K] inputs (the block kernels take [M, K] rows): [..., K] -> [..., N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = Int8Linear.from_float(weight.detach(), None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.inner(x.reshape(-1, x.shape[-1])).view(*lead, self.inner.out_features)


def int8_encoder(encoder: nn.Module) -> nn.Module:
    """A copy of a WhisperEncoder whose layers' linears (packed qkv, out_proj, fc1, fc2) hold Q8_0 blocks."""
    out = copy.deepcopy(encoder)
    for layer in out.layers:
        attn = layer.self_attn
        attn.qkv_proj = _int8(attn.qkv_proj)
        attn.out_proj = _int8(attn.out_proj)
        layer.fc1, layer.fc2 = _int8(layer.fc1), _int8(layer.fc2)
    return out.requires_grad_(False)


def int8_encoder_serves(device: torch.device | str) -> bool:
    """The int8 encoder is a speed path only where the C block kernels run (CPU, built); elsewhere (CUDA, or no
    compiler) Int8Linear dequantises in each call or takes its portable torch twin, slower than the float encoder."""
    return torch.device(device).type == "cpu" and cpu_kernels.kernel_available()


def _int8(layer: Linear | PackedLinear) -> RowsInt8Linear:
    return RowsInt8Linear(layer.weight, layer.bias)
