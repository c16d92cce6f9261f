"""Quantising a mixture-of-experts layer's experts while its checkpoint streams in (`load_decoder` int8 / int4).

Each expert matrix is quantised as it arrives (one float matrix in memory at a time), then the layer becomes a
QuantizedExperts (models/moe.py) as soon as its last matrix is in.
"""

from __future__ import annotations

import torch
from torch import nn

from omnivox.models import quant
from omnivox.models.moe import EXPERT_PROJECTIONS, Experts, QuantizedExperts


class PendingExperts(nn.Module):
    """Collects a MoE layer's expert matrices (one expert's at a time, or transformers 5's stacked tensors), each
    quantised as it arrives; `build()` makes the QuantizedExperts. Same interface as loading.py's _PendingLinear."""

    def __init__(self, experts: Experts, mode: str) -> None:
        super().__init__()
        if mode not in ("int8", "int4"):
            raise ValueError(f"experts are quantised to int8 or int4, not {mode!r}")
        self.num_experts, self.inter = experts.num_experts, experts.inter
        self.hidden, self.mode = experts.down_proj.shape[1], mode
        self.blocks: dict[tuple[int, str], torch.Tensor] = {}  # (expert, "gate" | "up" | "down") -> blocks

    def load_part(self, part, kind: str, value: torch.Tensor) -> None:
        """kind "expert": part is (expert, checkpoint projection); "gate_up_proj" / "down_proj": stacked [E, ...]."""
        if kind == "expert":
            self._put(part[0], EXPERT_PROJECTIONS[part[1]], value)
        elif kind in ("gate_up_proj", "down_proj") and value.shape[0] == self.num_experts:
            for e in range(self.num_experts):
                if kind == "down_proj":
                    self._put(e, "down", value[e])
                else:
                    self._put(e, "gate", value[e, : self.inter])
                    self._put(e, "up", value[e, self.inter :])
        else:
            raise ValueError(f"experts.{kind}: shape {tuple(value.shape)} is not {self.num_experts} stacked experts")

    def _put(self, expert: int, proj: str, w: torch.Tensor) -> None:
        want = (self.hidden, self.inter) if proj == "down" else (self.inter, self.hidden)
        if not 0 <= expert < self.num_experts or tuple(w.shape) != want:
            raise ValueError(f"expert {expert} {proj}: shape {tuple(w.shape)}, expected {want} of {self.num_experts}")
        # Rows are quantised independently: gate's blocks then up's are the blocks of the packed [2I, H] matrix.
        self.blocks[(expert, proj)] = (quant.quantize_q8 if self.mode == "int8" else quant.quantize_q4)(w.float())

    def missing(self) -> list[str]:
        return [
            f"experts.{e}.{p}_proj.weight"
            for e in range(self.num_experts)
            for p in ("gate", "up", "down")
            if (e, p) not in self.blocks
        ]

    def build(self, device: torch.device, dtype: torch.dtype) -> QuantizedExperts:
        layer = quant.Int4Linear if self.mode == "int4" else quant.Int8Linear
        b = self.blocks
        gate_up = [
            layer(torch.cat((b[(e, "gate")], b[(e, "up")])).to(device), self.hidden, None)
            for e in range(self.num_experts)
        ]
        down = [layer(b[(e, "down")].to(device), self.inter, None) for e in range(self.num_experts)]
        return QuantizedExperts(gate_up, down)
