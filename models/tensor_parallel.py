"""Tensor parallelism for our decoder (Megatron-style), over torch.distributed (NCCL on CUDA, gloo on CPU).

`shard_decoder(model, group)` turns a loaded `DecoderModel` into this rank's shard, in place:
- q/k/v and gate/up (PackedLinear): column-parallel, each part sliced by rows (whole heads; the intermediate
  dimension), so the attention of this rank's heads and its slice of the MLP need no communication;
- o_proj and down_proj: row-parallel (input columns sliced), one all-reduce each; a bias is added once, after it;
- embedding: vocabulary-parallel (this rank's rows; other tokens give zero rows), one all-reduce;
- lm_head (or the tied embedding): vocabulary-parallel, logits all-gathered so every rank holds the full row
  (sampling is deterministic given the same logits and seed; rank 0 is the one whose tokens count).
So each layer costs two all-reduces of [T, hidden] (docs/scaling.md works out what that costs on NVLink).
Each rank's KV cache holds its own `num_kv_heads / world` heads: allocate it from `local_kv_heads`.

What is not here yet (issue 16): the engine side (rank 0 schedules and broadcasts each step's plan, the others run
it), `omnivox serve --tensor-parallel N`, and loading only this rank's slice of the checkpoint (today every rank
loads the whole model, then drops what it does not own).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel
from omnivox.models.layers import Linear, PackedLinear, linear


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """A clear error when `world` ranks cannot split the heads (or the MLP) evenly."""
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP intermediate size", cfg.intermediate_size),
    ):
        if n % world:
            raise ValueError(f"--tensor-parallel {world} does not divide the model's {what} ({n})")


def local_kv_heads(cfg: ModelConfig, world: int) -> int:
    """KV heads in one rank's cache."""
    check_divisible(cfg, world)
    return cfg.num_kv_heads // world


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols]^T) + b: the input arrives split by columns (this rank's heads/slice)."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        cols = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * cols : (rank + 1) * cols].contiguous())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/world] -> [T, out]
        y = linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; tokens outside them contribute zeros."""

    def __init__(self, full: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        vocab = full.shape[0]
        self.rows = -(-vocab // world)  # ceil: the last shard is padded with zero rows
        self.start = rank * self.rows
        shard = torch.zeros(self.rows, full.shape[1], dtype=full.dtype, device=full.device)
        mine = full.detach()[self.start : self.start + self.rows]
        shard[: mine.shape[0]] = mine
        self.weight = nn.Parameter(shard)
        self.vocab = vocab
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered into the full [N, vocab] row on every rank."""

    def __init__(self, shard: torch.Tensor, vocab: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = shard if isinstance(shard, nn.Parameter) else nn.Parameter(shard)  # [ceil(vocab/world), hidden]
        self.vocab, self.world, self.group = vocab, world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        local = linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=1)[:, : self.vocab]


def _column_shard(packed: PackedLinear, rank: int, world: int) -> PackedLinear:
    """The PackedLinear of this rank: every part's rows split evenly, packed in the same order."""
    parts = {name: rows // world for name, rows in packed.parts.items()}
    out = PackedLinear(packed.weight.shape[1], parts, packed.bias is not None).to(packed.weight)
    with torch.no_grad():
        for name, rows in parts.items():
            start, _ = packed.offsets[name]
            lo = start + rank * rows
            out.load_part(name, "weight", packed.weight[lo : lo + rows])
            if packed.bias is not None:
                out.load_part(name, "bias", packed.bias[lo : lo + rows])
    return out


@torch.no_grad()
def shard_decoder(model: DecoderModel, group: dist.ProcessGroup | None = None) -> DecoderModel:
    """Make `model` (fully loaded, float layers) this rank's tensor-parallel shard, in place; return it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = model.config
    check_divisible(cfg, world)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn.o_proj, Linear) or not isinstance(mlp.down_proj, Linear):
            raise ValueError("tensor parallelism needs float layers (quantised layers are not sharded yet)")
        attn.qkv_proj = _column_shard(attn.qkv_proj, rank, world)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        mlp.gate_up_proj = _column_shard(mlp.gate_up_proj, rank, world)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
        mlp.inter //= world
    full_embedding = model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(full_embedding, rank, world, group)
    if model.lm_head is None:  # tied: the head reads the same vocabulary shard as the embedding
        model.lm_head = VocabParallelHead(model.embed_tokens.weight, cfg.vocab_size, world, group)
    else:
        rows = VocabParallelEmbedding(model.lm_head.weight, rank, world, group).weight  # same padded slicing
        model.lm_head = VocabParallelHead(rows, cfg.vocab_size, world, group)
    return model
