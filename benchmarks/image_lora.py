"""A small LoRA on the language side of the embedded image model (benchmarks/train_image_model.py): rank-r updates of
the attention and MLP projections of every SmolLM2 layer, trained beside the projector and merged into the text weights when
the LLaVA folder is assembled (models/vision/llava_assembly.py `merge_adapter`), so the served folder is a standard
LLaVA checkpoint with no adapter code.

Why: with the LM frozen, only the projector learned (run 2: 449 steps), and the answers that need the LM to find one
object among 64 image rows and read another property of it did not come from the image (held-out colour 23.7 % of 93,
left/right 46 % of 147: chance is 20 % / 50 %), although a linear probe reads the colour under a shape's centre from
the DINOv2 row at 97 % and its left/right half at 98 % (1801 shapes, 30 % held out).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from omnivox.models.vision.llava_assembly import ADAPTER_PREFIX  # lora.<module path under the LM's .model>.lora_A/_B

# The attention projections and the MLP's: the MLP reads the question-dependent part of the answer off a row.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    """base(x) + scale * x A^T B^T, with B = 0 at the start (the model begins as the frozen one)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T.to(x.dtype)) @ self.lora_B.T.to(x.dtype) * self.scale


def add_lora(decoder: nn.Module, rank: int, alpha: float | None = None) -> dict[str, LoraLinear]:
    """Wrap each LORA_TARGETS projection of `decoder` (the causal LM's `.model`) in place; {module path: wrapper}."""
    wrapped: dict[str, LoraLinear] = {}
    for name, module in list(decoder.named_modules()):
        for target in LORA_TARGETS:
            child = getattr(module, target, None)
            if isinstance(child, nn.Linear):
                lora = LoraLinear(child, rank, alpha if alpha is not None else 2.0 * rank)
                setattr(module, target, lora)
                wrapped[f"{name}.{target}"] = lora
    return wrapped


def adapter_state(loras: dict[str, LoraLinear]) -> dict[str, torch.Tensor]:
    """float16 A and scale * B per module: the merged update of `weight` is B @ A (models/vision/llava_assembly.py)."""
    out = {}
    for name, lora in loras.items():
        out[f"{ADAPTER_PREFIX}{name}.lora_A"] = lora.lora_A.detach().to(torch.float16).contiguous()
        out[f"{ADAPTER_PREFIX}{name}.lora_B"] = (lora.lora_B.detach() * lora.scale).to(torch.float16).contiguous()
    return out


def load_adapter(loras: dict[str, LoraLinear], state: dict[str, torch.Tensor]) -> None:
    """The inverse of `adapter_state` (continue a run); modules the state lacks keep B = 0."""
    with torch.no_grad():
        for name, lora in loras.items():
            a, b = state.get(f"{ADAPTER_PREFIX}{name}.lora_A"), state.get(f"{ADAPTER_PREFIX}{name}.lora_B")
            if a is not None and b is not None:
                lora.lora_A.copy_(a.float())
                lora.lora_B.copy_(b.float() / lora.scale)
