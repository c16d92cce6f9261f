"""Building blocks of the decoder: RMSNorm, rotary embedding, and linear layers that pack checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models import cpu_kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except one float32 row on CPU (batch-1 decode), which goes through the C matrix-vector kernel."""
    if (
        x.shape[0] == 1
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and cpu_kernels.kernel_available()
    ):
        return cpu_kernels.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) computed through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers: normalise in float32, cast back, then scale.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from transformers' rope parameter functions
    (default, linear, llama3, yarn, longrope: all are a fixed inv_freq plus an attention scale).

    Only one half of each table is kept, cos and sin side by side (`cos_sin` [P, 2, D/2]): rotate_half's tables
    repeat the same D/2 frequencies in both halves, so `tables` widens the rows a step looks up instead. At Gemma 3's
    128k context with 256-dim heads the whole float32 tables took 512 MiB (cos and sin, local and global rope); half
    of that now. The lookup costs +6.5 us at one row and -5 us at 128 (one gather and one cat for both tables)."""

    def __init__(
        self,
        hf_config,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,  # Gemma 3: "sliding_attention" / "full_attention", each its own parameters
        rotary_dim: int | None = None,  # partial rotary (Phi-4-mini): the leading dims that rotate; None: head_dim
    ) -> None:
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        dim = rotary_dim or head_dim
        # The tables are computed on the CPU in float32, whatever device the model is being built under (transformers'
        # rope functions return CPU tensors: mixing them with tables made under `torch.device("cuda")` crashed the
        # Llama 3 load), then moved to the device the module is built on (the default device: cuda, cpu or meta).
        target = torch.get_default_device()
        cpu = torch.device("cpu")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=cpu) / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' (NTK scaling that changes with length) is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # longrope: transformers picks the long factors for a forward whose sequence passes the original length
            # and the short ones otherwise, so keys cached with one set meet queries rotated with the other. One set
            # serves every position here, chosen by the served length as vLLM does: long when it passes the original
            # length (equal to transformers for prompts longer than that), else short (equal for every sequence).
            seq_len = max_positions if rope_type == "longrope" else None
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            with torch.device(cpu):  # their own aranges follow the default device
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, cpu, seq_len, **kwargs)
            if inv_freq.numel() * 2 != dim:
                raise ValueError(f"rope {rope_type!r} gives {inv_freq.numel() * 2} rotated dims, the model {dim}")
        t = torch.arange(max_positions, dtype=torch.float, device=cpu)
        freqs = torch.outer(t, inv_freq.to(cpu, torch.float))  # [P, D/2]: the half both halves of a row repeat
        cos_sin = torch.stack((freqs.cos(), freqs.sin()), dim=1) * scaling  # [P, 2, D/2]
        self.register_buffer("cos_sin", cos_sin.to(target), persistent=False)
        # M-RoPE (Qwen2.5-VL): frequency band j takes its angle from position row axis[j] (0 temporal, 1 height,
        # 2 width), `mrope_section` bands per row (the same split in both halves of D: one half is stored).
        section = params.get("mrope_section")
        if section is not None:
            if sum(section) != dim // 2:
                raise ValueError(f"mrope_section {section} does not cover head_dim / 2 = {dim // 2}")
            axis = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(section)])
            self.register_buffer("mrope_axis", axis, persistent=False)  # [D/2]
        else:
            self.mrope_axis = None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D] in dtype: looked up once per step, shared by every layer.

        positions: [T], or [3, T] M-RoPE positions (temporal, height, width rows) for a config with mrope_section.
        1-D positions on an M-RoPE config are the text case: all three rows equal, which is the plain table.
        The rows are looked up in the stored half and widened to D ([c, c]) here, after the lookup: T rows, not P.
        """
        if positions.dim() == 1:
            rows = self.cos_sin.index_select(0, positions)  # [T, 2, D/2]
        else:
            if self.mrope_axis is None:
                raise ValueError("3-D positions need a config with rope_parameters['mrope_section']")
            t = positions.shape[1]
            index = self.mrope_axis.view(1, 1, 1, -1).expand(1, t, 2, -1)  # [1, T, 2, D/2]: the row each band reads
            rows = self.cos_sin[positions].gather(0, index).squeeze(0)  # [3, T, 2, D/2] -> [T, 2, D/2]
        rows = rows.to(dtype)
        rows = torch.cat((rows, rows), dim=-1).unsqueeze(2)  # [T, 2, 1, D]
        return rows[:, 0], rows[:, 1]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, H, D], k: [T, KVH, D]; rotate_half convention (first half / second half), as transformers does.
    Tables narrower than D (partial rotary, [T, 1, R]) rotate the leading R dims and pass the rest through."""
    r = cos.shape[-1]
    if r != q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PackedLinear(nn.Module):
    """Several checkpoint projections of the same input stored as one matrix, computed in one matmul.

    `parts` maps each checkpoint name suffix (e.g. "q_proj") to its number of output rows, in packing order.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.parts = dict(parts)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in parts.items():
            self.offsets[name] = (start, rows)
            start += rows
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.zeros(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        start, rows = self.offsets[part]
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {part}.bias but the model expects none")
        if tensor.shape[0] != rows or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{part}.{kind}: shape {tuple(tensor.shape)} does not fit ({rows}, {target.shape[1:]})")
        with torch.no_grad():
            target[start : start + rows].copy_(tensor)
