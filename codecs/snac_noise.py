"""Noise for SNAC's noise-injection layers, as a pure function of position (codecs/snac.py puts it in the decoder).

snac's decoder blocks add `x + randn * linear(x)` with noise drawn from the global RNG. `InjectedNoise` replaces each
such block and draws from a `NoiseSource` instead. The default, `PositionalNoise`, is a hash of (seed, layer, absolute
time step), so the noise at a time step does not depend on the window, the batch or the call order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
from snac.layers import NoiseBlock
from torch import nn

if TYPE_CHECKING:
    from omnivox.codecs.snac import SnacDecoder


class NoiseSource(Protocol):
    """Noise for the decoder's noise-injection layers.

    `noise(layer, start_steps, num_steps, dtype, device)` returns a tensor (B x 1 x T) for the `layer`-th noise block;
    row b covers that layer's time steps [start_steps[b], start_steps[b] + num_steps).
    """

    def __call__(
        self, layer: int, start_steps: torch.Tensor, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors holding values in [0, 2^32); no product exceeds 2^60."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _hash32_int(x: int) -> int:
    """`_hash32` on one Python int: the same bits, no tensor, no device sync (usable inside a CUDA graph capture)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class PositionalNoise:
    """Standard normal noise that is a pure function of (seed, layer, absolute time step) (Box-Muller on a hash)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def __call__(
        self, layer: int, start_steps: torch.Tensor, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        salt = _hash32_int((self.seed * 131 + layer * 7919 + 12345) & _MASK32)  # no .item(): graph-capturable
        steps = start_steps.to(device=device, dtype=torch.int64)[:, None] + torch.arange(num_steps, device=device)
        key = (steps * 2) & _MASK32  # (B x T)
        u1 = _hash32(key ^ salt)
        u2 = _hash32(((key + 1) & _MASK32) ^ salt)
        u1 = (u1.to(torch.float32) + 0.5) * 2.0**-32  # in (0, 1): log is finite
        u2 = (u2.to(torch.float32) + 0.5) * 2.0**-32
        normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return normal.to(dtype)[:, None, :]  # (B x 1 x T)


class InjectedNoise(nn.Module):
    """Replaces snac's NoiseBlock: `x + noise * linear(x)` with noise from a NoiseSource (or none)."""

    def __init__(self, block: NoiseBlock, layer: int, owner: SnacDecoder) -> None:
        super().__init__()
        self.linear = block.linear
        self.layer = layer
        self._owner = [owner]  # a list, so that the owner is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C x T)
        owner = self._owner[0]
        if owner.noise is None:
            return x
        upsample = owner._steps_per_latent[self.layer]
        start = owner._call_start_latent * upsample  # (B,)
        noise = owner.noise(self.layer, start, x.shape[-1], x.dtype, x.device)
        # one fused pass: `x + noise * linear(x)` broadcast (B x 1 x T) over the channels at ~1/10 the speed here
        # (2 x 128 x 18432, one thread: 26.8 vs 2.8 ms); the same value up to the fused multiply-add's rounding
        return torch.addcmul(x, noise, self.linear(x))
