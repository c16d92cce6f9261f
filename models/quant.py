"""Quantised linear layers (int8 and 4-bit groups) and `quantize_decoder`, which swaps them into a loaded decoder.

- **int8**: per-output-channel symmetric int8 weights. On CPU through torch's fbgemm dynamic int8 linear
  (`quantized::linear_dynamic` on prepacked weights: activations quantised per call, integer GEMM); measured on a
  1728x576 layer 4.4x faster than float32 `F.linear` at batch 1 and 4.5x at batch 16, ~2 % relative error per layer
  (the activation is quantised per tensor). Elsewhere (CUDA): int8 weights dequantised inside the matmul.
- **int4**: GGUF's Q4_1 block layout byte for byte (groups of 32: fp16 scale d, fp16 offset m, 16 bytes of nibbles;
  5 bits per weight), so a Q4_1 file loads without conversion and Q4_0 / Q4_K convert exactly or nearly. On CPU the
  C kernel `q4_matmul_f32` (models/cpu_kernels.c, llama.cpp's Q4_1 x Q8_1 scheme: int8 activations per group,
  integer dot products); the portable torch path below does the same arithmetic and is tested equal to it.

Memory: a quantised layer holds only its quantised weights (no float copy); `weight_bytes(model)` counts them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models import cpu_kernels
from omnivox.models.layers import Linear, PackedLinear

MODES = ("none", "int8", "int4")
GROUP = 32  # weights per 4-bit group (and activations per int8 group in the 4-bit kernel)
Q4_BLOCK_BYTES = 20  # fp16 d + fp16 m + 16 bytes of nibbles
LARGE_BATCH = 32  # rows from which a 4-bit layer is dequantised for float GEMM (measured crossover, see BENCHMARKS)


# ---------------------------------------------------------------------------------------------------------------------
# int8, per output channel


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], float32 scales [N]): symmetric, scale = max|row| / 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W = int8 rows x per-row scales."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        device = qweight.device
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self._nbytes = qweight.numel() + 4 * scales.numel()
        if device.type == "cpu":
            qw = torch._make_per_channel_quantized_tensor(
                qweight, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0
            )
            # fbgemm copies the weights into its own packed layout; qweight is not kept.
            self._packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else self.bias.detach())
            self.qweight = self.scales = None
        else:
            self._packed = None
            self.register_buffer("qweight", qweight)
            self.register_buffer("scales", scales.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        q, s = quantize_int8(weight)
        return cls(q, s, bias)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self._packed is not None:
            # reduce_range: 7-bit activations, which fbgemm needs on AVX2 without VNNI (no int16 saturation).
            y = torch.ops.quantized.linear_dynamic(x.float(), self._packed, True)
            return y.to(x.dtype)
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


# ---------------------------------------------------------------------------------------------------------------------
# 4-bit groups (Q4_1 blocks)


def quantize_q4(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> Q4_1 blocks uint8 [N, ceil(K/32) * 20]; K is zero-padded to a multiple of 32.

    Per group: m = min, d = (max - min) / 15, q = round((w - m) / d), as llama.cpp's quantize_row_q4_1_ref.
    """
    n, k = weight.shape
    kp = -(-k // GROUP) * GROUP
    w = F.pad(weight.float(), (0, kp - k)).view(n, kp // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)  # [N, G]
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    d32 = d.float()
    inv = torch.where(d32 > 0, 1.0 / d32, torch.zeros_like(d32))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)  # [N, G, 32]
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [N, G, 16]
    head = torch.stack([d, m], dim=-1).view(torch.uint8)  # [N, G, 4]
    return torch.cat([head, nibbles], dim=-1).reshape(n, -1).contiguous()


def q4_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks [N, G * 20] -> (d [N, G] float32, m [N, G] float32, q [N, G, 32] uint8)."""
    n = blocks.shape[0]
    b = blocks.view(n, -1, Q4_BLOCK_BYTES)
    head = b[..., :4].contiguous().view(torch.float16).float()  # [N, G, 2]
    nib = b[..., 4:]
    q = torch.cat([nib & 15, nib >> 4], dim=-1)
    return head[..., 0], head[..., 1], q


def dequantize_q4(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q4_1 blocks -> float32 weight [N, in_features]."""
    d, m, q = q4_parts(blocks)
    w = q.float() * d[..., None] + m[..., None]
    return w.reshape(blocks.shape[0], -1)[:, :in_features]


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (qx [M, G, 32] float holding ints, dx [M, G], sx [M, G]), as the C kernel does."""
    xs = x.float().view(x.shape[0], -1, GROUP)
    dx = xs.abs().amax(-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(xs * inv[..., None])
    return qx, dx, dx * qx.sum(-1)


def q4_matmul_portable(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C kernel's arithmetic in torch: int8 activations per group, exact integer group dots (in float32)."""
    d, m, q = q4_parts(blocks)  # [N, G], [N, G], [N, G, 32]
    qx, dx, sx = quantize_activations_q8(x)  # [M, G, 32], [M, G], [M, G]
    qw = q.float()
    y = sx @ m.T  # [M, N]: the offset term
    for g in range(qw.shape[1]):  # integer dot of each group (sums < 2^24: exact in float32)
        y += (qx[:, g] @ qw[:, g].T) * (dx[:, g, None] * d[None, :, g])
    return y if bias is None else y + bias


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W in Q4_1 blocks (groups of 32 along the input)."""

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.padded_in = -(-in_features // GROUP) * GROUP
        assert blocks.dtype == torch.uint8 and blocks.shape[1] == self.padded_in // GROUP * Q4_BLOCK_BYTES
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(quantize_q4(weight).to(weight.device), weight.shape[1], bias)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.device.type != "cpu":  # no 4-bit kernel off CPU: dequantise in the matmul
            return F.linear(x, dequantize_q4(self.blocks, self.in_features).to(x.dtype), _cast(self.bias, x.dtype))
        xf = x.float()
        if self.padded_in != self.in_features:
            xf = F.pad(xf, (0, self.padded_in - self.in_features))
        if not torch.is_grad_enabled() and cpu_kernels.kernel_available():
            if xf.shape[0] >= LARGE_BATCH:  # float GEMM beats integer group dots here; the float copy is transient
                w = cpu_kernels.q4_dequantize(self.blocks, self.out_features, self.padded_in)
                return F.linear(xf, w, self.bias).to(x.dtype)
            y = cpu_kernels.q4_matmul(xf, self.blocks, self.out_features, self.bias)
        else:
            y = q4_matmul_portable(xf, self.blocks, self.bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {GROUP}"


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class Int8Embedding(nn.Module):
    """Embedding lookup from int8 rows x per-row scales (the tied lm_head's own int8 weights)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [V, H] int8
        self.register_buffer("scales", scales.float())  # [V]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return (self.qweight[ids].float() * self.scales[ids, None]).to(self.dtype)


QuantLinear = Int8Linear | Int4Linear
_FROM_FLOAT: dict[str, Callable[[torch.Tensor, torch.Tensor | None], nn.Module]] = {
    "int8": Int8Linear.from_float,
    "int4": Int4Linear.from_float,
}


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Whole decoder


def quantize_decoder(model: nn.Module, mode: str, quantize_lm_head: bool = False) -> nn.Module:
    """Replace the decoder layers' linear projections of a loaded float model with `mode` layers, in place.

    mode: "none" (no change), "int8" or "int4". quantize_lm_head: also the output projection (int8 in both modes:
    4-bit logits cost too much quality for the bytes saved); for a tied model the embedding then reads the same int8
    rows, and the float embedding matrix is freed. Returns the model.
    """
    check_mode(mode)
    if mode == "none":
        return model
    make = _FROM_FLOAT[mode]
    for name, module in list(model.layers.named_modules()):
        if isinstance(module, Linear | PackedLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.layers.get_submodule(parent), attr, make(module.weight.detach(), _bias(module)))
    if quantize_lm_head:
        quantize_output(model)
    return model


def quantize_output(model: nn.Module) -> None:
    """The lm_head as int8; a tied model's embedding shares its int8 rows."""
    if model.lm_head is None:  # tied
        weight = model.embed_tokens.weight.detach()
        q, s = quantize_int8(weight)
        model.lm_head = Int8Linear(q, s, None)
        model.embed_tokens = Int8Embedding(q, s, weight.dtype)
    elif isinstance(model.lm_head, Linear):
        model.lm_head = Int8Linear.from_float(model.lm_head.weight.detach(), None)


def _bias(module: nn.Module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters, persistent buffers, and fbgemm's packed int8 weights."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
        if isinstance(module, Int8Linear) and module._packed is not None:
            total += module.nbytes
    return total
