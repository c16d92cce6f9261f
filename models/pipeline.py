"""Pipeline stages across nodes, tensor parallel within each: a model group of `nnodes` x `tp` ranks.

Across nodes tensor parallelism would pay two all-reduces per layer over the node-to-node network; a pipeline pays
one send of the hidden state [T, hidden] per stage boundary. So node (stage) s holds a contiguous slice of the layers
(`stage_layers`), split `tp` ways inside the node over its own group (NVLink, or gloo on the CPU) exactly as one-node
tensor parallelism splits them (models/tensor_parallel.py). Stage 0 also holds the embedding and the head (the
engine's rank 0 samples there), the last stage the final norm; its hidden state goes back to stage 0, rank j to rank
j (every rank of a stage holds the same hidden state after its all-reduces). Stages run one after another: no
micro-batches, so a step costs the sum of the stages' times plus a send per boundary (a pipeline for memory, not
for throughput).

Global rank = stage * tp + local rank; global rank 0 is the engine's. Every rank creates every stage's group, in
stage order, then the control group (torch.distributed's new_group is collective over the whole world).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from omnivox.models.decoder import DecoderModel

_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """Where this process sits in a model group spread over nodes (LeaderWorkerSet: a leader pod and workers)."""

    nnodes: int  # nodes (pods) in the group: pipeline stages
    node_rank: int  # this node's stage; 0 is the leader, which serves
    master_addr: str  # the leader's address: the rendezvous store listens there
    master_port: int = 29500


@dataclasses.dataclass(frozen=True)
class Topology:
    tp: int  # ranks per node (tensor parallel within a node)
    stages: int  # nodes

    @property
    def world(self) -> int:
        return self.tp * self.stages

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def ranks_of(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers of `stage`: contiguous, the first `num_layers % stages` stages one more."""
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages (nodes) for a model of {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_groups(topology: Topology) -> list[dist.ProcessGroup]:
    """Every stage's tensor-parallel group (collective: every rank calls it, in the same order)."""
    return [dist.new_group(topology.ranks_of(s)) for s in range(topology.stages)]


def stage_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], layers: range, first: bool, last: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors a stage holds, its layers renumbered from 0 (the stage's ModuleList)."""
    for name, tensor in tensors:
        match = _LAYER.match(name)
        if match is not None:
            index = int(match[2])
            if index in layers:
                yield f"{match[1] or ''}layers.{index - layers.start}.{name[match.end() :]}", tensor
        elif name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight"):
            if first:
                yield name, tensor
        elif name.removeprefix("model.") == "norm.weight":
            if last:
                yield name, tensor
        else:
            yield name, tensor


def keep_stage(model: DecoderModel, layers: range, first: bool, last: bool) -> None:
    """Drop (before allocation: on the meta device) what the stage does not hold."""
    model.layers = nn.ModuleList(model.layers[i] for i in layers)
    if not first:
        model.embed_tokens = None  # type: ignore[assignment]
        model.lm_head = None
    if not last:
        model.norm = None  # type: ignore[assignment]


def set_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Point every collective of a loaded shard at `group` (its stage's; created after loading, when ranks meet)."""
    for module in model.modules():
        if hasattr(module, "group") and module is not model:
            module.group = group


class PipelineStage(nn.Module):
    """One rank's stage, called as the decoder is (`forward` -> the final hidden state on stage 0's ranks)."""

    def __init__(self, shard: DecoderModel, topology: Topology, rank: int) -> None:
        super().__init__()
        self.shard, self.topology, self.rank = shard, topology, rank
        self.stage = topology.stage_of(rank)
        self.first, self.last = self.stage == 0, self.stage == topology.stages - 1
        local = rank % topology.tp
        self.prev = None if self.first else rank - topology.tp
        self.next = None if self.last else rank + topology.tp
        self.leader = local  # stage 0's rank that takes this rank's final hidden state
        self.tail = (topology.stages - 1) * topology.tp + local  # the last stage's rank that sends it

    @property
    def config(self):
        return self.shard.config

    def forward(self, input_ids, positions, kv_caches, meta, embed_rows=None, embed_values=None) -> torch.Tensor:
        shard = self.shard
        hidden = shard.config.hidden_size
        if self.first:  # [T] -> [T, hidden]
            x = shard.embed(input_ids)
            if embed_rows is not None and embed_rows.numel():
                x = x.index_copy(0, embed_rows, embed_values.to(x.dtype))
        else:
            x = torch.empty(input_ids.shape[0], hidden, dtype=self._dtype(), device=input_ids.device)
            dist.recv(x, src=self.prev)
        rope = shard.rotary.tables(positions, x.dtype)
        local = shard.rotary_local.tables(positions, x.dtype) if shard.rotary_local is not None else None
        for layer, kv in zip(shard.layers, kv_caches, strict=True):
            x = layer(x, local if layer.self_attn.local_rope else rope, kv, meta)
        if not self.last:
            dist.send(x.contiguous(), dst=self.next)
            if not self.first:
                return x  # a middle stage: nothing comes back to it
            x = torch.empty_like(x)
            dist.recv(x, src=self.tail)
            return x
        x = shard.norm(x)
        if not self.first:
            dist.send(x.contiguous(), dst=self.leader)
        return x

    def _dtype(self) -> torch.dtype:
        return next(self.shard.parameters()).dtype

    def compute_logits(self, hidden: torch.Tensor, window: tuple[int, int] | None = None) -> torch.Tensor:
        return self.shard.compute_logits(hidden, window)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embed_tokens(ids)
