"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), computed as transformers does.

Routing (transformers' Qwen3MoeTopKRouter / MixtralTopKRouter / Qwen2MoeTopKRouter): router logits = gate(x); softmax
over all experts in float32; the top_k largest probabilities, renormalised to sum 1 when norm_topk_prob (Mixtral
always). Each chosen expert is a SiLU-gated MLP; a token's output is the weighted sum of its experts' outputs
(Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x))).

The experts are stacked at load into two tensors, gate_up_proj [E, 2I, H] and down_proj [E, H, I] (transformers 5's
own layout and names, so a checkpoint saved that way loads as is). The forward groups the (token, expert) pairs by
expert with one stable sort and runs each hit expert once on its rows (a python loop over the experts hit, never
over tokens), then scatters the weighted rows back with one index_add_; a single row skips the grouping. The experts
hit are read on the host, so MoE steps are never captured in CUDA graphs (engine/runner.py). Quantised (int8 / int4
at load, models/moe_quant.py), each expert's two matrices become their own block layers (QuantizedExperts); the
routers stay float.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.models.config import ModelConfig
from omnivox.models.layers import Linear, linear

# Per-expert checkpoint names (Mixtral's block_sparse_moe is renamed to mlp first, models/decoder.py):
# mlp.experts.{i}.gate_proj / up_proj / down_proj (Qwen) or w1 / w3 / w2 (Mixtral).
_EXPERT_NAME = re.compile(r"^(?P<module>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
EXPERT_PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# Routers stay float when the layers are quantised (as vLLM keeps them): an int8 router would pick other experts.
FLOAT_ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")


class GroupedExperts(nn.Module):
    """The grouped forward of E SiLU-gated MLPs; subclasses hold the weights and run one expert on its rows."""

    num_experts: int
    inter: int

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        raise NotImplementedError

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts [T, k] chosen expert ids; weights [T, k] their routing weights -> [T, H]."""
        if x.shape[0] == 1:  # one row (a batch-1 decode step): nothing to group
            return self._one_row(x, experts[0], weights[0])
        k = experts.shape[1]
        by_expert, order = torch.sort(experts.reshape(-1), stable=True)  # [T*k] pairs grouped by expert
        # One host read per layer: the experts hit and their row counts (at most min(T*k, E) of each; transformers'
        # loop reads which experts were hit too). Experts no token chose cost nothing.
        hit, counts = (t.tolist() for t in torch.unique_consecutive(by_expert, return_counts=True))
        tokens = order // k
        rows = x.index_select(0, tokens)  # [T*k, H]
        outs, start = [], 0
        for e, n in zip(hit, counts, strict=True):
            outs.append(self.expert(e, rows[start : start + n]))
            start += n
        if not outs:  # no rows
            return torch.zeros_like(x)
        scaled = torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)  # in weights' dtype
        return torch.zeros_like(x).index_add_(0, tokens, scaled.to(x.dtype))

    def _one_row(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped path's arithmetic for one row, without its sort, gathers and scatter: each chosen expert in
        ascending id order (the order the grouped path adds them in), scaled, rounded to x's dtype, summed."""
        out = None
        for j, e in sorted(enumerate(experts.tolist()), key=lambda pair: pair[1]):
            y = (self.expert(e, x) * weights[j]).to(x.dtype)
            out = y if out is None else out + y
        return out


class Experts(GroupedExperts):
    """E SiLU-gated MLPs stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.loaded_parts: set[tuple[int, str]] = set()  # (expert, "gate" | "up" | "down") copied by load_expert

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint matrix into its slot; proj is a checkpoint name (gate_proj, w1, ...)."""
        part = EXPERT_PROJECTIONS[proj]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} {proj}: the config has {self.num_experts} experts")
        i = self.inter
        target = {"gate": self.gate_up_proj[expert, :i], "up": self.gate_up_proj[expert, i:]}.get(part)
        target = self.down_proj[expert] if target is None else target
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {proj}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        self.loaded_parts.add((expert, part))

    def missing(self, prefix: str, param: str) -> list[str]:
        """Per-expert tensors of `param` (gate_up_proj / down_proj) not loaded, as names under `prefix`."""
        parts = ("gate", "up") if param == "gate_up_proj" else ("down",)
        return [
            f"{prefix}.{e}.{p}_proj.weight"
            for e in range(self.num_experts)
            for p in parts
            if (e, p) not in self.loaded_parts
        ]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = linear(rows, self.gate_up_proj[e])
        return linear(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :], self.down_proj[e])


class QuantizedExperts(GroupedExperts):
    """Each expert's gate_up [2I, H] and down [H, I] as its own block-quantised layer (models/quant.py Int8Linear /
    Int4Linear): `serve --quantization int8 / int4` of a MoE model. The routers stay float (FLOAT_ROUTERS)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.num_experts, self.inter = len(gate_up), gate_up[0].out_features // 2

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up[e](rows)
        return self.down[e](F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :])


class SparseMoeBlock(nn.Module):
    """The MoE MLP: router `gate` [E, H], the experts, and (Qwen2-MoE) a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob, self.float32_weights = moe.top_k, moe.norm_topk_prob, moe.float32_weights
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] expert ids, [T, k] weights) for rows x [T, H]: float32 weights for Mixtral, x's dtype for Qwen."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.float32_weights else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self.experts(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_tensor(name: str) -> tuple[str, int, str] | None:
    """(module of the Experts, expert index, checkpoint projection) of a per-expert checkpoint name without its
    "model." prefix (`layers.0.mlp.experts.3.w1.weight` -> ("layers.0.mlp.experts", 3, "w1")), else None."""
    m = _EXPERT_NAME.match(name)
    if m is None or not m["module"].endswith(".experts"):
        return None
    return m["module"], int(m["expert"]), m["proj"]
