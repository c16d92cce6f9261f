"""Tensor parallelism for our decoder (Megatron-style), over torch.distributed (NCCL on CUDA, gloo on CPU).

`shard_decoder(model, group)` turns a loaded `DecoderModel` into this rank's shard, in place:
- q/k/v and gate/up (PackedLinear): column-parallel, each part sliced by rows (whole heads; the intermediate
  dimension), so the attention of this rank's heads and its slice of the MLP need no communication;
- o_proj and down_proj: row-parallel (input columns sliced), one all-reduce each; a bias is added once, after it;
- mixture-of-experts layers (models/moe.py): the router replicated, every expert's intermediate dimension sliced
  like a dense MLP's (gate / up rows, down columns; no expert parallelism), one all-reduce of the weighted sum (and
  one for Qwen2-MoE's shared expert, a row-parallel down_proj like a dense MLP's);
- embedding: vocabulary-parallel (this rank's rows; other tokens give zero rows), one all-reduce;
- lm_head (or the tied embedding): vocabulary-parallel, logits all-gathered so every rank holds the full row
  (sampling is deterministic given the same logits and seed; rank 0 is the one whose tokens count).
So each layer costs two all-reduces of [T, hidden] (docs/scaling.md works out what that costs on NVLink).
Each rank's KV cache holds its own `num_kv_heads / world` heads: allocate it from `local_kv_heads`. With fewer KV
heads than ranks (GQA / MQA at a large world; `world` a multiple of them), each KV head is replicated on the
`world / num_kv_heads` ranks whose query heads read it, as vLLM does: every rank holds one KV head.

`load_shard(path, rank, world)` builds the same shard straight from a checkpoint: the model is allocated at the
shard's sizes and each checkpoint tensor is sliced as it streams in, so a rank holds its shard plus one tensor, never
the whole model. The engine side (rank 0 schedules, the other ranks run each step) is engine/tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel, split_fused_projections
from omnivox.models.layers import Linear, PackedLinear, linear
from omnivox.models.moe import Experts, SparseMoeBlock


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """A clear error when `world` ranks cannot split the heads (or the MLP) evenly. KV heads fewer than the ranks
    are replicated, which needs `world` to be a multiple of them."""
    sizes = [("attention heads", cfg.num_heads), ("MLP intermediate size", cfg.intermediate_size)]
    if cfg.moe is not None:  # each expert is sharded like a dense MLP (no expert parallelism)
        sizes.append(("expert intermediate size", cfg.moe.expert_intermediate_size))
        if cfg.moe.shared_expert_intermediate_size:
            sizes.append(("shared expert intermediate size", cfg.moe.shared_expert_intermediate_size))
    for what, n in sizes:
        if n % world:
            raise ValueError(f"--tensor-parallel {world} does not divide the model's {what} ({n})")
    kv = cfg.num_kv_heads
    if kv % world and world % kv:
        raise ValueError(
            f"--tensor-parallel {world} does not divide the model's KV heads ({kv}), nor is it a multiple of them"
        )


def check_world(path: str | os.PathLike, world: int, device: torch.device, max_model_len: int | None = None) -> None:
    """ValueError, with the reason in one line, when `world` ranks cannot serve the checkpoint on `device`."""
    from omnivox.models.checkpoint import load_hf_config

    if world < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {world}")
    check_divisible(ModelConfig.from_hf(load_hf_config(path), max_model_len), world)
    if device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        if world > have:
            raise ValueError(f"--tensor-parallel {world} needs {world} GPUs from {device}; {max(have, 0)} available")
    elif device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {device.type}")


def local_kv_heads(cfg: ModelConfig, world: int) -> int:
    """KV heads in one rank's cache (one, replicated, when the model has fewer than `world`)."""
    check_divisible(cfg, world)
    return max(1, cfg.num_kv_heads // world)


def kv_head_rows(rows: int, kv_heads: int, rank: int, world: int) -> slice:
    """This rank's rows of a k_proj / v_proj output of `rows` rows (`kv_heads` heads): its `kv_heads / world`
    heads, or with fewer heads than ranks the one head its query heads read (rank r's query heads are a
    world-th of all, and a KV head serves world / kv_heads consecutive ranks)."""
    per_head = rows // kv_heads
    if kv_heads >= world:
        n = rows // world
        return slice(rank * n, (rank + 1) * n)
    head = rank * kv_heads // world
    return slice(head * per_head, (head + 1) * per_head)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, cols]^T) + b: the input arrives split by columns (this rank's heads/slice)."""

    def __init__(self, local: nn.Linear, group: dist.ProcessGroup | None) -> None:
        """local: the layer whose weight [out, in/world] is already this rank's columns (its bias is the full one)."""
        super().__init__()
        self.weight = local.weight
        self.bias = local.bias
        self.group = group

    @classmethod
    def from_full(cls, full: nn.Linear, rank: int, world: int, group: dist.ProcessGroup | None) -> RowParallelLinear:
        cols = full.in_features // world
        local = nn.Linear(cols, full.out_features, bias=full.bias is not None, device="meta")
        local.weight = nn.Parameter(full.weight.detach()[:, rank * cols : (rank + 1) * cols].contiguous())
        if full.bias is not None:
            local.bias = nn.Parameter(full.bias.detach().clone())
        return cls(local, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/world] -> [T, out]
        y = linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class AllReducedExperts(nn.Module):
    """A MoE layer's experts holding this rank's slice of every expert's intermediate dimension (gate / up rows,
    down columns): each rank's weighted sum is partial, one all-reduce completes it."""

    def __init__(self, experts: Experts, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.inner, self.group = experts, group

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.inner(x, experts, weights)
        dist.all_reduce(y, group=self.group)
        return y


def _expert_gate_up_rows(gate_up: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's [E, 2I/world, H] of stacked experts' gate_up [E, 2I, H]: its gate rows, then its up rows."""
    inter = gate_up.shape[1] // 2
    n = inter // world
    gate, up = gate_up[:, rank * n : (rank + 1) * n], gate_up[:, inter + rank * n : inter + (rank + 1) * n]
    return torch.cat((gate, up), dim=1)


def _expert_down_cols(down: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's [E, H, I/world] of stacked experts' down [E, H, I] (the columns its gate / up rows feed)."""
    n = down.shape[2] // world
    return down[:, :, rank * n : (rank + 1) * n]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; tokens outside them contribute zeros."""

    def __init__(self, shard: torch.Tensor, vocab: int, rank: int, group: dist.ProcessGroup | None) -> None:
        """shard: [ceil(vocab / world), hidden], this rank's rows (`vocab_rows` slices them from the full matrix)."""
        super().__init__()
        self.rows = shard.shape[0]
        self.start = rank * self.rows
        self.weight = shard if isinstance(shard, nn.Parameter) else nn.Parameter(shard)
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


def _column_shard(packed: PackedLinear, rank: int, world: int, kv_heads: int = 0) -> PackedLinear:
    """The PackedLinear of this rank: every part's rows split evenly (k_proj / v_proj by `kv_head_rows` when
    `kv_heads` is given), packed in the same order."""
    cuts = {}
    for name, rows in packed.parts.items():
        if kv_heads and name in ("k_proj", "v_proj"):
            cuts[name] = kv_head_rows(rows, kv_heads, rank, world)
        else:
            cuts[name] = slice(rank * (rows // world), (rank + 1) * (rows // world))
    parts = {name: cut.stop - cut.start for name, cut in cuts.items()}
    out = PackedLinear(packed.weight.shape[1], parts, packed.bias is not None).to(packed.weight)
    with torch.no_grad():
        for name, cut in cuts.items():
            start, _ = packed.offsets[name]
            rows = slice(start + cut.start, start + cut.stop)
            out.load_part(name, "weight", packed.weight[rows])
            if packed.bias is not None:
                out.load_part(name, "bias", packed.bias[rows])
    return out


@torch.no_grad()
def shard_decoder(model: DecoderModel, group: dist.ProcessGroup | None = None) -> DecoderModel:
    """Make `model` (fully loaded, float layers) this rank's tensor-parallel shard, in place; return it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = model.config
    check_divisible(cfg, world)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dense = [mlp] if not isinstance(mlp, SparseMoeBlock) else [m for m in (mlp.shared_expert,) if m is not None]
        if not isinstance(attn.o_proj, Linear) or not all(isinstance(m.down_proj, Linear) for m in dense):
            raise ValueError("tensor parallelism needs float layers (quantised layers are not sharded yet)")
        attn.qkv_proj = _column_shard(attn.qkv_proj, rank, world, cfg.num_kv_heads)
        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, rank, world, group)
        attn.num_heads //= world
        attn.num_kv_heads = local_kv_heads(cfg, world)
        for m in dense:  # the dense MLP, or a MoE layer's shared expert
            m.gate_up_proj = _column_shard(m.gate_up_proj, rank, world)
            m.down_proj = RowParallelLinear.from_full(m.down_proj, rank, world, group)
            m.inter //= world
        if isinstance(mlp, SparseMoeBlock):
            experts = mlp.experts
            gate_up = _expert_gate_up_rows(experts.gate_up_proj.detach(), rank, world)
            down = _expert_down_cols(experts.down_proj.detach(), rank, world)
            experts.gate_up_proj = nn.Parameter(gate_up.contiguous())
            experts.down_proj = nn.Parameter(down.contiguous())
            experts.inter //= world
            mlp.experts = AllReducedExperts(experts, group)
    embedding = vocab_rows(model.embed_tokens.weight.detach(), rank, world)
    head = None if model.lm_head is None else vocab_rows(model.lm_head.weight.detach(), rank, world)
    return _vocab_parallel(model, embedding, head, rank, world, group)


def _local_moe(cfg: ModelConfig, world: int):
    """One rank's MoE sizes: a world-th of every expert's (and the shared expert's) intermediate dimension."""
    if cfg.moe is None:
        return None
    shared = cfg.moe.shared_expert_intermediate_size
    return dataclasses.replace(
        cfg.moe,
        expert_intermediate_size=cfg.moe.expert_intermediate_size // world,
        shared_expert_intermediate_size=shared // world if shared else None,
    )


def vocab_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] matrix: ceil(vocab / world) of them, the last shard padded with zeros."""
    rows = -(-full.shape[0] // world)
    shard = torch.zeros(rows, *full.shape[1:], dtype=full.dtype, device=full.device)
    mine = full[rank * rows : (rank + 1) * rows]
    shard[: mine.shape[0]] = mine
    return shard


def _vocab_parallel(
    model: DecoderModel,
    embedding: torch.Tensor,
    head: torch.Tensor | None,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
) -> DecoderModel:
    """Install the vocabulary-parallel embedding and head (head None: tied, it reads the embedding's shard)."""
    vocab = model.config.vocab_size
    model.embed_tokens = VocabParallelEmbedding(embedding, vocab, rank, group)
    model.lm_head = VocabParallelHead(model.embed_tokens.weight if head is None else head, vocab, world, group)
    return model


def _slice_for_rank(
    tensors: Iterable[tuple[str, torch.Tensor]], rank: int, world: int, kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors cut to this rank's part, as they stream in (the same cuts shard_decoder makes)."""
    for name, tensor in tensors:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in ("k_proj", "v_proj"):  # column-parallel by whole KV heads (replicated when fewer than ranks)
            tensor = tensor[kv_head_rows(tensor.shape[0], kv_heads, rank, world)]
        elif module in ("q_proj", "gate_proj", "up_proj", "w1", "w3"):  # column-parallel: output rows (Mixtral w1/w3)
            rows = tensor.shape[0] // world
            tensor = tensor[rank * rows : (rank + 1) * rows]
        elif module in ("o_proj", "down_proj", "w2") and parts[-1] == "weight":  # row-parallel: input columns
            cols = tensor.shape[1] // world
            tensor = tensor[:, rank * cols : (rank + 1) * cols]
        elif module == "experts" and parts[-1] == "gate_up_proj":  # stacked experts [E, 2I, H]: gate and up rows
            tensor = _expert_gate_up_rows(tensor, rank, world)
        elif module == "experts" and parts[-1] == "down_proj":  # [E, H, I]: input columns
            tensor = _expert_down_cols(tensor, rank, world)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = vocab_rows(tensor, rank, world)
        yield name, tensor.contiguous()


@torch.no_grad()
def load_shard(
    path,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    group: dist.ProcessGroup | None = None,
    layers: range | None = None,
    first: bool = True,
    last: bool = True,
) -> DecoderModel:
    """This rank's shard of the checkpoint at `path` (the model shard_decoder makes from the whole one), allocated at
    the shard's sizes and filled tensor by tensor: peak memory is the shard plus the largest checkpoint tensor.
    No collective runs here: the process group need not exist yet (it must by the first forward).

    `layers` (a pipeline stage, models/pipeline.py): only those layers, renumbered from 0; the embedding and head
    only when `first`, the final norm only when `last`; nothing else is ever allocated (built on the meta device)."""
    from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config
    from omnivox.models.decoder import make_rotaries
    from omnivox.models.pipeline import keep_stage, stage_tensors

    cfg = ModelConfig.from_hf(load_hf_config(path), max_model_len)
    check_divisible(cfg, world)
    local = dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=local_kv_heads(cfg, world),
        intermediate_size=cfg.intermediate_size // world,
        vocab_size=-(-cfg.vocab_size // world),  # the embedding and head rows of this rank
        moe=_local_moe(cfg, world),
    )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if layers is None:
            with torch.device(device):  # allocated in place at its dtype: no float32 copy of the shard
                model = DecoderModel(local)
        else:  # a stage: built bare, cut to its layers, then given memory; the rotary tables computed again
            with torch.device("meta"):
                model = DecoderModel(local)
            keep_stage(model, layers, first, last)
            model.to_empty(device=device)
            with torch.device(device):
                model.rotary, model.rotary_local = make_rotaries(local)
    finally:
        torch.set_default_dtype(prev)
    model.rotary.to(torch.float32)
    tensors = split_fused_projections(cfg, iter_checkpoint_tensors(path))  # the whole model's rows, before slicing
    if layers is not None:
        tensors = stage_tensors(tensors, layers, first, last)
    model.load_weights(_slice_for_rank(tensors, rank, world, cfg.num_kv_heads))
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            mlp.experts = AllReducedExperts(mlp.experts, group)
            mlp = mlp.shared_expert
        if mlp is not None:
            mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    model.config = cfg  # the whole model's: vocabulary, context, heads as the checkpoint has them
    if not first:
        return model
    head = None if model.lm_head is None else model.lm_head.weight
    return _vocab_parallel(model, model.embed_tokens.weight, head, rank, world, group)
