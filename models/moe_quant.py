"""Quantising a mixture-of-experts layer's experts while its checkpoint streams in (`load_decoder` int8 / int4).

Each expert matrix is quantised as it arrives (one float matrix in memory at a time), then the layer becomes a
QuantizedExperts (models/moe.py) as soon as its last matrix is in. A GGUF at its own precision (mode None) hands each
expert's rows of its stacked ffn_*_exps blocks (models/gguf_checkpoint.py gguf_tensor_parts), kept as they came until
the layer is complete and then served as int4 / int8 (or float) like the dense GGUF matrices (models/loading.py).
"""

from __future__ import annotations

import torch
from torch import nn

from omnivox.models import quant
from omnivox.models.moe import EXPERT_PROJECTIONS, Experts, QuantizedExperts


class PendingExperts(nn.Module):
    """Collects a MoE layer's expert matrices (one expert's at a time, or transformers 5's stacked tensors), each
    quantised as it arrives; `build()` makes the QuantizedExperts. Same interface as loading.py's _PendingLinear."""

    def __init__(self, experts: Experts, mode: str | None) -> None:
        super().__init__()
        if mode not in ("int8", "int4", None):
            raise ValueError(f"experts are quantised to int8 or int4, not {mode!r}")
        self.num_experts, self.inter = experts.num_experts, experts.inter
        self.hidden, self.mode = experts.down_proj.shape[1], mode
        # (expert, "gate" | "up" | "down") -> int8 / int4 blocks; with mode None (a GGUF at its own precision) the
        # value as it came: a GGUF's blocks (loading.GGUFBlocks) or a float matrix, resolved in build()
        self.blocks: dict[tuple[int, str], object] = {}

    def load_part(self, part, kind: str, value) -> None:
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

    def _put(self, expert: int, proj: str, w) -> None:
        want = (self.hidden, self.inter) if proj == "down" else (self.inter, self.hidden)
        if not 0 <= expert < self.num_experts or tuple(w.shape) != want:
            raise ValueError(f"expert {expert} {proj}: shape {tuple(w.shape)}, expected {want} of {self.num_experts}")
        # Rows are quantised independently: gate's blocks then up's are the blocks of the packed [2I, H] matrix.
        self.blocks[(expert, proj)] = w if self.mode is None else _quantized(w, self.mode)

    def missing(self) -> list[str]:
        return [
            f"experts.{e}.{p}_proj.weight"
            for e in range(self.num_experts)
            for p in ("gate", "up", "down")
            if (e, p) not in self.blocks
        ]

    def build(self, device: torch.device, dtype: torch.dtype) -> QuantizedExperts | Experts:
        """The experts at `mode`; with mode None at the GGUF's own precision, gate_up and down each on their own
        (Q4_K_M files keep some ffn_down_exps in Q6_K): int4 if every expert's blocks are 4-bit, int8 if all are
        GGUF blocks, else (a float matrix among them) float Experts as `--quantization none` builds them."""
        b = self.blocks
        modes = {"gate_up": self.mode, "down": self.mode}
        if self.mode is None:
            for group, projs in (("gate_up", ("gate", "up")), ("down", ("down",))):
                kinds = {getattr(b[(e, p)], "native", "none") for e in range(self.num_experts) for p in projs}
                modes[group] = "int4" if kinds == {"int4"} else "none" if "none" in kinds else "int8"
            if "none" in modes.values():
                return self._float(device, dtype)
            b = {key: _quantized(w, modes["gate_up" if key[1] != "down" else "down"]) for key, w in b.items()}
        layers = {m: quant.Int4Linear if m == "int4" else quant.Int8Linear for m in modes.values()}
        gate_up = [
            layers[modes["gate_up"]](torch.cat((b[(e, "gate")], b[(e, "up")])).to(device), self.hidden, None)
            for e in range(self.num_experts)
        ]
        down = [layers[modes["down"]](b[(e, "down")].to(device), self.inter, None) for e in range(self.num_experts)]
        return QuantizedExperts(gate_up, down)

    def _float(self, device: torch.device, dtype: torch.dtype) -> Experts:
        experts = Experts(self.num_experts, self.hidden, self.inter).to(device=device, dtype=dtype)
        for (e, proj), w in self.blocks.items():
            w = w.dequantize() if hasattr(w, "dequantize") else w
            experts.load_expert(e, f"{proj}_proj", w)
        return experts


def _quantized(w, mode: str) -> torch.Tensor:
    """int8 (Q8_0) / int4 (Q4_1) blocks of one expert matrix: a GGUF's blocks converted as loading.py's dense layers
    convert them (Q8_0 / Q4_1 / Q4_0 as stored), a float matrix quantised."""
    if hasattr(w, "as_int8"):  # loading.GGUFBlocks (not imported: loading imports this module)
        return w.as_int4() if mode == "int4" else w.as_int8()
    return (quant.quantize_q8 if mode == "int8" else quant.quantize_q4)(w.float())
