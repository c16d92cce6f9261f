"""Faster CPU forms of the SNAC decoder's convolutions: the same weights and arithmetic up to float rounding.

Measured on this machine (one thread, float32, the full-size 24 kHz decoder, a 12-frame window; profile of
`SnacDecoder.decode` with torch.profiler): the depthwise 7-tap convolutions (dilations 1, 3, 9) took ~40 % of the time
because oneDNN runs them at ~1 GFLOP/s on (1 x C x 1 x T) layouts; the first transposed convolution (1024 -> 512,
kernel 16, stride 8) ~10 %; the pointwise convolutions go through the slow im2col path.

- `ShiftedDepthwise`: a depthwise convolution as k shifted multiply-adds (`addcmul_` over the padded input):
  64 ch x 24576 steps 13.9 -> 3.6 ms, 128 x 12288 7.7 -> 2.2 ms, 512 x 384 1.07 -> 0.30 ms; max difference 3e-6.
- `MatmulConvTranspose`: a transposed convolution whose kernel is a multiple of its stride as one matmul followed by
  an overlap-add of kernel/stride shifted pieces: 1024 -> 512 at 48 steps 28.4 -> 13.4 ms (used only where the input
  has >= 1024 channels: for the later, longer layers it measured 5-10 % slower than oneDNN).
- `Pointwise`: a 1x1 convolution as a matmul. Measured within 5 % of oneDNN at 128-512 channels (these are
  compute-bound GEMMs, ~40 GMAC/s on one core) and slower with the batched bias, so it is off (`POINTWISE`).

Whole decoder, one 12-frame window: 269 -> 219 ms (0.26 -> 0.21 s per second of audio), max difference 6e-8.
A fused Snake (torch.compile of x + sin(ax)^2 / a) measured 2-4x faster than the eager one per call, but compiling
takes ~25 s per process here; the Snake and these depthwise convolutions now run as C kernels where a compiler exists
(codecs/codec_kernels.py: ~6x and 3-4x), the torch forms here being their fallback.

bf16 weights were measured too (depthwise 2x faster through oneDNN, pointwise up to 2x) but change the audio by
~1e-2 relative, 10^4 times the float32 differences here, so they are not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.codecs.codec_kernels import depthwise_conv

MATMUL_TRANSPOSE_MIN_CHANNELS = 1024
POINTWISE = False


class ShiftedDepthwise(nn.Module):
    """A depthwise Conv1d (groups == channels, stride 1) as `kernel_size` shifted multiply-adds."""

    def __init__(self, conv: nn.Conv1d, c_kernel: bool = True) -> None:
        super().__init__()
        self.c_kernel = c_kernel  # one C pass where it applies (codecs/codec_kernels.py), else the torch form below
        self.weight = nn.Parameter(conv.weight.detach()[:, 0, :].clone(), requires_grad=False)  # (C x K)
        bias = conv.bias.detach() if conv.bias is not None else torch.zeros(conv.out_channels)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)  # (C,)
        self.dilation = int(conv.dilation[0])
        self.padding = int(conv.padding[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C x T)
        fused = depthwise_conv(x, self.weight, self.bias, self.dilation, self.padding) if self.c_kernel else None
        if fused is not None:
            return fused
        k, d = self.weight.shape[1], self.dilation
        xp = F.pad(x, (self.padding, self.padding))
        out_len = xp.shape[-1] - d * (k - 1)
        w = self.weight.to(x.dtype)
        out = torch.addcmul(self.bias.to(x.dtype)[:, None], w[:, 0:1], xp[..., 0:out_len])
        for j in range(1, k):
            out.addcmul_(w[:, j : j + 1], xp[..., j * d : j * d + out_len])
        return out  # (B x C x T_out)


class Pointwise(nn.Module):
    """A 1x1 Conv1d as a batched matrix product."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach()[:, :, 0].clone(), requires_grad=False)  # (C_out x C_in)
        bias = conv.bias.detach() if conv.bias is not None else torch.zeros(conv.out_channels)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C_in x T) -> (B x C_out x T)
        w = self.weight.to(x.dtype)
        b = self.bias.to(x.dtype)[:, None]
        return torch.baddbmm(b.expand(x.shape[0], -1, x.shape[-1]), w.expand(x.shape[0], -1, -1), x)


class MatmulConvTranspose(nn.Module):
    """A ConvTranspose1d with kernel = m * stride (no dilation, no output padding, groups 1) as one matmul and an
    overlap-add of m shifted pieces."""

    def __init__(self, conv: nn.ConvTranspose1d) -> None:
        super().__init__()
        c_in, c_out, k = conv.weight.shape
        s = int(conv.stride[0])
        self.stride, self.m, self.c_out = s, k // s, c_out
        self.padding = int(conv.padding[0])
        # (C_in x C_out x m x s) -> (C_in x m*C_out*s): output columns grouped by overlap piece.
        w = conv.weight.detach().reshape(c_in, c_out, self.m, s).permute(0, 2, 1, 3).reshape(c_in, -1)
        self.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        bias = conv.bias.detach() if conv.bias is not None else torch.zeros(c_out)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)

    @staticmethod
    def applies(conv: nn.ConvTranspose1d) -> bool:
        k, s = conv.kernel_size[0], conv.stride[0]
        return (
            conv.groups == 1
            and conv.dilation[0] == 1
            and conv.output_padding[0] == 0
            and k % s == 0
            and conv.in_channels >= MATMUL_TRANSPOSE_MIN_CHANNELS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C_in x T) -> (B x C_out x (T-1)*s + k - 2p)
        batch, _, steps = x.shape
        m, s, c = self.m, self.stride, self.c_out
        y = torch.matmul(x.transpose(1, 2), self.weight.to(x.dtype)).view(batch, steps, m, c, s)
        out = x.new_zeros(batch, steps + m - 1, c, s)
        for j in range(m):
            out[:, j : j + steps] += y[:, :, j]
        out = out.permute(0, 2, 1, 3).reshape(batch, c, (steps + m - 1) * s)
        length = out.shape[-1]
        return out[..., self.padding : length - self.padding] + self.bias.to(x.dtype)[:, None]


def speed_up_convs(module: nn.Module, c_kernels: bool = True) -> int:
    """Replace the decoder's convolutions in place with the forms above where they apply; returns how many.
    c_kernels=False: the depthwise ones stay in torch (no C kernel), as benchmarks/codec.py compares."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if type(child) is nn.Conv1d and child.stride[0] == 1 and child.padding_mode == "zeros":
                if child.groups == child.in_channels == child.out_channels and child.groups > 1:
                    new = ShiftedDepthwise(child, c_kernels)
                elif POINTWISE and child.groups == 1 and child.kernel_size[0] == 1 and child.padding[0] == 0:
                    new = Pointwise(child)
            elif type(child) is nn.ConvTranspose1d and MatmulConvTranspose.applies(child):
                new = MatmulConvTranspose(child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced
