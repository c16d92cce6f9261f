"""Quantised linear layers (8-bit and 4-bit groups of 32) and `quantize_decoder`, which swaps them into a decoder.

Both keep GGUF's own block layouts byte for byte, so a GGUF's Q8_0 / Q4_1 tensors load without conversion:
- **int8**: Q8_0 blocks (fp16 scale d, 32 x int8; 8.5 bits per weight), weight = d * q.
- **int4**: Q4_1 blocks (fp16 scale d, fp16 offset m, 16 bytes of nibbles; 5 bits per weight), weight = d * q + m.
  Q4_0 converts exactly (m = -8 d), Q4_K to within half a level.
On CPU, below LARGE_BATCH rows, the C kernels in models/cpu_kernels.c compute integer dot products against
activations quantised per group of 32 to **int16**, accumulated in float32 per group. llama.cpp quantises activations
to int8 here (Q8_0 / Q8_1); on the embedded SmolLM2-135M that flipped the first answer token of "What is the capital
of France?" ("The" and "L" 0.08 logits apart in float; int8 activations at the lm_head put "L" first, and the engine
answered "L'Étoile, ...") and 3 % of teacher-forced tokens. int16 activations are within ~1e-5 of float ones at the
same speed (the loops are bound by unpacking weights, not by the activation width).
From VNNI_MIN_ROWS rows (3: decode steps of several requests, prefill chunks), on CPUs with AVX-512 VNNI, the
kernel in models/block_kernels_vnni.c unpacks 16 rows of weights at a time and multiplies them with `vpdpbusd` against
activations quantised to 15 bits per group (two int8 halves; `act_bits=8`, one half, is llama.cpp's Q8_1, ~1.5x as
fast and measurably worse, see `set_act_bits`): ~2.2x the int16 kernels at 16 rows and ~1.7x float32 GEMM at 128.
On AVX2 hosts without VNNI, block layers take models/block_kernels_avx2.c from AVX2_MIN_ROWS rows instead (the same
tiles and activations with `vpmaddubsw` + `vpmaddwd`, as llama.cpp's AVX2 path). Where no many-row kernel serves,
from LARGE_BATCH rows (prefill) a layer is dequantised into a transient float32 matrix for torch's float GEMM. The portable torch path does the kernels' arithmetic and is tested
equal to them. Off CPU (CUDA) a layer is dequantised inside each matmul (correct; not a speed path).

torch's fbgemm dynamic int8 linear (`quantized::linear_dynamic`, per-channel weights) was measured first: 4.4x faster
than float32 at batch 1 on a 1728x576 layer, but it quantises the activations with one scale per call (7 bits), and on
SmolLM2-135M that raised perplexity by 58 % (+15 % with 8-bit activations); per-group activation scales cost nothing
measurable in quality (see BENCHMARKS.md, "Quantised weights").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models import cpu_kernels
from omnivox.models.config import NotApplicable
from omnivox.models.layers import Linear, PackedLinear
from omnivox.models.moe import FLOAT_ROUTERS, Experts, QuantizedExperts

log = logging.getLogger(__name__)

MODES = ("none", "int8", "int4")
GROUP = 32  # weights per group (and activations per int16 group in the kernels)
ACT_LEVELS = 32767.0  # activations: int16 per group of 32 (see the module docstring for why not int8)
Q4_BLOCK_BYTES = 20  # fp16 d + fp16 m + 16 bytes of nibbles
Q8_BLOCK_BYTES = 34  # fp16 d + 32 x int8
LARGE_BATCH = 32  # rows from which a layer is dequantised for float GEMM (measured crossover, see BENCHMARKS)
# Rows from which the VNNI kernel serves (where built), per block kind. Measured on the embedded SmolLM2 (weights
# streamed from memory; one thread; CPU ms): its 30 Q4_1 layers at 2 / 3 / 4 / 6 rows took 11.7 / 15.5 / 20 / 29.5
# with the int16 kernels and 13.3 / 14.9 / 16.6 / 20.7 with VNNI; the Q8_0 lm_head 2.0 / 2.8 / 3.5 / 5.2 against
# 2.3 / 2.4 / 2.7 / 3.3. (Before the kernel prefetched the next tile's rows, it crossed over only at 6 / 8 rows.)
VNNI_MIN_ROWS = {"q4": 3, "q8": 3}
# Rows from which the AVX2 many-row kernel (block_kernels_avx2.c; hosts without VNNI) serves, per block kind.
# Measured with the x86-64-v3 build on SmolLM2-135M's shapes (one thread, CPU ms, a machine shared by ~10 jobs:
# noisy): its 30 Q4_1 layer sets at 3 / 16 / 32 / 128 rows took 47 / 99 / 189 / 795 with the int16 kernels,
# 43 / 64 / 122 / 394 with this kernel and 262 / 175 / 207 / 426 dequantised for float GEMM (MKL limited to AVX2).
# Q8_0 (15-bit activations as int16, one `vpmaddwd` pass): the lm_head at 3 / 8 / 16 / 31 rows 9.1 / 13.2 / 17.3 /
# 31.9 int16 against 8.6 / 12.1 / 16.9 / 25.7 here; 24 Q8_0 layers at 32 / 128 rows 33.4 / 143 int16, 36.2 / 88.5
# float GEMM, 27.8 / 89.8 here: even below 16 rows, so from 16.
AVX2_MIN_ROWS: dict[str, int | None] = {"q4": 3, "q8": 16}
MANY_MIN_ROWS: dict[str, dict[str, int | None]] = {"vnni": VNNI_MIN_ROWS, "avx2": AVX2_MIN_ROWS}


def many_row_kernel_for(kind: str, rows: int) -> str | None:
    """The many-row kernel ("vnni" / "avx2") a `kind` block layer takes for `rows` rows on this CPU, or None."""
    many = cpu_kernels.many_row_kernel()
    start = MANY_MIN_ROWS[many][kind] if many else None
    return many if start is not None and rows >= start else None


ACT_BITS = (8, 15)  # activation precisions of the VNNI kernel: 127 or 127 * 128 levels per group of 32
# `serve --activation-bits`: 16 = the default (int16 groups; 15 bits in the VNNI kernel), 8 = ACT_BITS 8 (Q8_1).
ACTIVATION_BITS = (8, 16)


def _padded(k: int) -> int:
    return -(-k // GROUP) * GROUP


# ---------------------------------------------------------------------------------------------------------------------
# Block formats: quantise, unpack, dequantise


def quantize_q8(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> Q8_0 blocks uint8 [N, ceil(K/32) * 34]; K zero-padded to a multiple of 32.

    Per group: d = max|w| / 127, q = round(w / d), as llama.cpp's quantize_row_q8_0_ref.
    """
    n, k = weight.shape
    w = F.pad(weight.float(), (0, _padded(k) - k)).view(n, -1, GROUP)
    d = (w.abs().amax(-1) / 127.0).half()  # [N, G]
    d32 = d.float()
    inv = torch.where(d32 > 0, 1.0 / d32, torch.zeros_like(d32))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)  # [N, G, 32]
    return torch.cat([d[..., None].view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()


def q8_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [N, G * 34] -> (d [N, G] float32, q [N, G, 32] int8)."""
    b = blocks.view(blocks.shape[0], -1, Q8_BLOCK_BYTES)
    return b[..., :2].contiguous().view(torch.float16).float().squeeze(-1), b[..., 2:].contiguous().view(torch.int8)


def dequantize_q8(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q8_0 blocks -> float32 weight [N, in_features]."""
    d, q = q8_parts(blocks)
    return (q.float() * d[..., None]).reshape(blocks.shape[0], -1)[:, :in_features]


def quantize_q4(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> Q4_1 blocks uint8 [N, ceil(K/32) * 20]; K is zero-padded to a multiple of 32.

    Per group: m = min, d = (max - min) / 15, q = round((w - m) / d), as llama.cpp's quantize_row_q4_1_ref.
    """
    n, k = weight.shape
    w = F.pad(weight.float(), (0, _padded(k) - k)).view(n, -1, GROUP)
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
    b = blocks.view(blocks.shape[0], -1, Q4_BLOCK_BYTES)
    head = b[..., :4].contiguous().view(torch.float16).float()  # [N, G, 2]
    nib = b[..., 4:]
    return head[..., 0], head[..., 1], torch.cat([nib & 15, nib >> 4], dim=-1)


def dequantize_q4(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q4_1 blocks -> float32 weight [N, in_features]."""
    d, m, q = q4_parts(blocks)
    return (q.float() * d[..., None] + m[..., None]).reshape(blocks.shape[0], -1)[:, :in_features]


def _act_levels(act_bits: int) -> float:
    """Largest activation level per group: 16 bits for the int16 kernels, 15 or 8 for the VNNI kernel."""
    return {16: ACT_LEVELS, 15: 127.0 * 128.0, 8: 127.0}[act_bits]


def quantize_activations(x: torch.Tensor, act_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (qx [M, G, 32] float holding integer values, dx [M, G], sx [M, G]), as the C kernels
    do: per group of 32, dx = max|x| / levels (32767 for int16), qx = round(x / dx), sx = the group's sum of x (the
    Q4_1 offset term)."""
    xs = x.float().view(x.shape[0], -1, GROUP)
    dx = xs.abs().amax(-1) / _act_levels(act_bits)
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(xs * inv[..., None]), dx, xs.sum(-1)


def block_matmul_portable(
    kind: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, act_bits: int = 16
) -> torch.Tensor:
    """The C kernels' arithmetic in torch: activations per group (int16, or the VNNI kernel's 15 / 8 bits), exact
    integer group dots (in float64)."""
    qx, dx, sx = quantize_activations(x, act_bits)  # [M, G, 32], [M, G], [M, G]
    if kind == "q4":
        d, m, q = q4_parts(blocks)  # [N, G], [N, G], [N, G, 32]
        y = sx @ m.T  # [M, N]: the offset term
    else:
        d, q = q8_parts(blocks)
        y = torch.zeros(x.shape[0], blocks.shape[0])
    qw, qx = q.double(), qx.double()
    for g in range(qw.shape[1]):  # integer dot of each group (up to 127 * 32767 * 32 > 2^24: exact in float64)
        y += (qx[:, g] @ qw[:, g].T).float() * (dx[:, g, None] * d[None, :, g])
    return y if bias is None else y + bias


# ---------------------------------------------------------------------------------------------------------------------
# Layers


class BlockLinear(nn.Module):
    """y = x W^T (+ b) with W held as GGUF blocks of 32 along the input (`blocks` uint8 [N, K / 32 * bytes])."""

    kind = ""  # "q4" or "q8": the C kernel and block layout
    block_bytes = 0

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.padded_in = _padded(in_features)
        if blocks.dtype != torch.uint8 or blocks.shape[1] != self.padded_in // GROUP * self.block_bytes:
            raise ValueError(f"{self.kind} blocks {tuple(blocks.shape)} do not hold {in_features} inputs")
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.act_bits = 15  # activations of the many-row VNNI kernel (ACT_BITS); int16 below VNNI_MIN_ROWS

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:  # [N, in_features] float32
        fn = dequantize_q4 if self.kind == "q4" else dequantize_q8
        return fn(self.blocks, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.device.type != "cpu":  # no block kernel off CPU: dequantise in the matmul
            return F.linear(x, self.dequantize().to(x.dtype), _cast(self.bias, x.dtype))
        xf = x.float()
        if self.padded_in != self.in_features:
            xf = F.pad(xf, (0, self.padded_in - self.in_features))
        many = many_row_kernel_for(self.kind, xf.shape[0])  # by the build this CPU runs
        if torch.is_grad_enabled() or not cpu_kernels.kernel_available():
            bits = self.act_bits if many else 16
            return block_matmul_portable(self.kind, xf, self.blocks, self.bias, bits).to(x.dtype)
        if many:
            n, bits = self.out_features, self.act_bits
            return cpu_kernels.block_matmul_many(self.kind, xf, self.blocks, n, self.bias, bits, kernel=many).to(
                x.dtype
            )
        if xf.shape[0] >= LARGE_BATCH:  # float GEMM beats integer group dots here; the float copy is transient
            w = cpu_kernels.block_dequantize(self.kind, self.blocks, self.out_features, self.padded_in)
            return F.linear(xf, w, self.bias).to(x.dtype)
        return cpu_kernels.block_matmul(self.kind, xf, self.blocks, self.out_features, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} groups of {GROUP}"


class Int8Linear(BlockLinear):
    """8-bit weights: Q8_0 blocks."""

    kind, block_bytes = "q8", Q8_BLOCK_BYTES

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return cls(quantize_q8(weight).to(weight.device), weight.shape[1], bias)


class Int4Linear(BlockLinear):
    """4-bit weights: Q4_1 blocks."""

    kind, block_bytes = "q4", Q4_BLOCK_BYTES

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(quantize_q4(weight).to(weight.device), weight.shape[1], bias)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class Int8Embedding(nn.Module):
    """Embedding lookup that dequantises only the rows asked for, from a tied output layer's Q8_0 blocks (shared)."""

    def __init__(self, output: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.output = [output]  # a list: not a submodule, so the shared blocks are not counted twice
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        out = self.output[0]
        rows = out.blocks.index_select(0, ids.flatten())
        return dequantize_q8(rows, out.in_features).to(self.dtype).view(*ids.shape, -1)


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
        parent, _, attr = name.rpartition(".")
        if isinstance(module, Experts):  # one quantised layer per expert matrix
            gate_up = [make(w, None) for w in module.gate_up_proj.detach()]
            down = [make(w, None) for w in module.down_proj.detach()]
            setattr(model.layers.get_submodule(parent), attr, QuantizedExperts(gate_up, down))
        elif isinstance(module, Linear | PackedLinear) and not name.endswith(FLOAT_ROUTERS):
            setattr(model.layers.get_submodule(parent), attr, make(module.weight.detach(), _bias(module)))
    if quantize_lm_head:
        quantize_output(model)
    return model


def quantize_output(model: nn.Module) -> None:
    """The lm_head as int8; a tied model's embedding reads the same blocks."""
    if model.lm_head is None:  # tied
        weight = model.embed_tokens.weight.detach()
        model.lm_head = Int8Linear.from_float(weight)
        model.embed_tokens = Int8Embedding(model.lm_head, weight.dtype)
    elif isinstance(model.lm_head, Linear):
        model.lm_head = Int8Linear.from_float(model.lm_head.weight.detach())


def set_act_bits(model: nn.Module, act_bits: int) -> None:
    """The VNNI kernel's activation precision (ACT_BITS) for every quantised decoder layer (not the lm_head, which
    keeps 15 bits: 8-bit activations there flip near-tied logits, see the module docstring)."""
    if act_bits not in ACT_BITS:
        raise ValueError(f"act_bits must be one of {ACT_BITS}, got {act_bits}")
    for module in model.layers.modules():
        if isinstance(module, BlockLinear):
            module.act_bits = act_bits
    model.__dict__.pop("_fused_decode", None)  # the fused step's table copies act_bits: rebuild it


def check_activation_bits(bits: int, float_weights: str | None = None) -> None:
    """ValueError naming activation_bits unless bits is 8 or 16, and 8 only where the weights may be quantised
    (float_weights: why they will be float, or None)."""
    if isinstance(bits, bool) or bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits (--activation-bits) must be 8 or 16, got {bits!r}")
    if bits == 8 and float_weights is not None:
        raise NotApplicable(
            "activation_bits", f"activation_bits 8 (--activation-bits 8) needs quantised weights: {float_weights}"
        )


def apply_activation_bits(model: nn.Module, bits: int) -> None:
    """`serve --activation-bits`: 8 runs the decoder layers' VNNI kernel with 8-bit activations (set_act_bits; on
    the embedded SmolLM2 Q4_1 ~1.25x the tokens/s at 16 concurrent, perplexity +1.08 %, see BENCHMARKS.md), 16 the
    default. ValueError when 8 meets float decoder layers: "auto" is float for a safetensors folder or off CPU, and
    Whisper or tensor-parallel models are float only. Where no VNNI kernel runs, 8 changes nothing (a warning)."""
    check_activation_bits(bits)
    layers = getattr(model, "layers", None)
    blocks = [m for m in layers.modules() if isinstance(m, BlockLinear)] if layers is not None else []
    if not blocks:
        if bits == 8:
            raise NotApplicable(
                "activation_bits",
                "activation_bits 8 (--activation-bits 8) needs quantised weights: this model's decoder layers are float",
            )
        return
    set_act_bits(model, 8 if bits == 8 else 15)
    if bits == 8 and not (blocks[0].blocks.device.type == "cpu" and cpu_kernels.many_row_kernel()):
        log.warning("activation_bits 8: no many-row block kernel (VNNI, AVX2) runs here, so activations keep 16 bits")


def _bias(module: nn.Module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters and persistent buffers (quantised blocks included)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
    return total
