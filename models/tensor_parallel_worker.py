"""A rank of a tensor-parallel decoder (ranks 1..N-1): load its shard, then run what rank 0 sends, until stopped.

Rank 0 (engine/tensor_parallel.py) sends, over a gloo control group on the host, one message per call it makes on
its own shard: the cache shape (`Caches`, whenever rank 0's cache changes), a forward pass with every argument the
runner built (`Forward`: ids, positions, attention metadata, embedding rows/values; tensors travel on the CPU), the
logits of hidden rows that follow as a broadcast (`Logits`), an embedding lookup (`Embed`), a gather of the cache
(`GatherKV`, for tests) and `Stop`. A worker holds no scheduling state: its cache is indexed by the slots it is sent.

This module imports only models/, not the engine package: a spawned rank's imports took 6.7 s instead of 11.9 s on
this busy machine. A worker exits on `Stop`, when the control channel breaks (rank 0 gone: its socket closes), or
when its parent process is gone (polled once a second), so a killed server leaves no orphans.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omnivox.models.attention import paged_block_mask
from omnivox.models.pipeline import PipelineStage, Topology, set_group, stage_groups, stage_layers
from omnivox.models.tensor_parallel import load_shard

# A worker waits on the control channel between requests for as long as the server idles: gloo's default 30-minute
# timeout would end an idle server's workers, so the control group waits (practically) forever. A dead peer still
# breaks the wait at once (its socket closes).
CONTROL_TIMEOUT = timedelta(days=3650)
_PARENT_POLL_S = 1.0


# ---- messages (rank 0 -> workers) ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Caches:
    num_layers: int
    shape: tuple[int, ...]  # one K (or V) tensor: [slots, local kv heads, head_dim]
    dtype: torch.dtype


@dataclasses.dataclass
class Forward:
    args: tuple  # the decoder's arguments after kv_caches (metadata, embedding rows/values), tensors on the CPU
    kwargs: dict
    input_ids: torch.Tensor
    positions: torch.Tensor


@dataclasses.dataclass
class Logits:
    rows: int  # hidden rows [rows, hidden] follow as a broadcast on the model's group


@dataclasses.dataclass
class Embed:
    ids: torch.Tensor


@dataclasses.dataclass
class GatherKV:
    pass


@dataclasses.dataclass
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class _FlexMask:
    """A FlexAttention block mask travels as what rebuilds it (its mask_mod is a closure: not picklable)."""

    rows: int
    num_cache_blocks: int


def portable(obj: Any, device: torch.device | None) -> Any:
    """A copy of obj (tensors, lists, tuples, dicts, dataclasses such as AttentionMetadata) with every tensor moved
    to `device` (None: the CPU, for pickling) and a flex block mask turned into a _FlexMask."""
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(obj, torch.Tensor):
        return obj.to(device or "cpu")
    if isinstance(obj, BlockMask):
        rows = obj.kv_num_blocks.shape[0]
        return _FlexMask(rows, obj.seq_lengths[1] // obj.BLOCK_SIZE[1])
    if isinstance(obj, list | tuple):
        return type(obj)(portable(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: portable(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, portable(getattr(obj, f.name), device))
        return out
    return obj


def without_decode_mask(meta: Any) -> Any:
    """A shallow copy of the metadata without its dense decode mask ([decodes, 1, 1, max_blocks * block_size] bool:
    128 KiB for 64 requests at 2k tokens), which the worker rebuilds from the decode lengths it carries anyway."""
    if getattr(meta, "decode_mask", None) is None or getattr(meta, "decode_lens", None) is None:
        return meta
    out = copy.copy(meta)
    out.decode_mask = None
    return out


def rebuild_masks(meta: Any) -> None:
    """On a worker: the masks left out of the message, from the tables and lengths the metadata carries (built as
    the runner builds them)."""
    if getattr(meta, "decode_mask", 1) is None and getattr(meta, "decode_lens", None) is not None:
        lens, tables = meta.decode_lens, meta.decode_block_tables
        span = torch.arange(tables.shape[1] * meta.block_size, device=lens.device)
        meta.decode_mask = (span[None, :] < lens[:, None]).view(lens.shape[0], 1, 1, -1)
    spec = getattr(meta, "decode_block_mask", None)
    if isinstance(spec, _FlexMask):
        meta.decode_block_mask = paged_block_mask(
            meta.decode_block_tables, meta.decode_lens, meta.block_size, spec.num_cache_blocks, spec.rows
        )


# One broadcast of a fixed-size buffer carries a message's length and, when it fits, the message itself: one gloo
# round trip per message where broadcast_object_list takes two (its size, then its bytes). A step's messages are a
# few KiB (decode of 64 requests: ~6 KiB); only large embedding segments take the second broadcast.
_INLINE_BYTES = 64 * 1024


def _tensor_from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles a CPU tensor as its raw bytes (a uint8 numpy array), dtype and shape. torch's own pickling of a
    tensor goes through torch.save of its storage: ~40 us per tensor each way, so a decode step's message (ids,
    positions, slots, block tables, lengths) cost ~0.5 ms to pickle and as much to load, under load, on the step's
    critical path (rank 0 sends, the worker must read it before its forward's first all-reduce)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
            return _tensor_from_bytes, (flat.numpy(), obj.dtype, tuple(obj.shape))
        return NotImplemented


def dumps(msg: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return out.getvalue()


def send(msg: Any, group: dist.ProcessGroup) -> None:
    data = dumps(msg)
    buf = torch.zeros(8 + _INLINE_BYTES, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    inline = len(data) <= _INLINE_BYTES
    if inline:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    if not inline:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)


def receive(group: dist.ProcessGroup) -> Any:
    buf = torch.empty(8 + _INLINE_BYTES, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    n = int(buf[:8].view(torch.int64))
    if n <= _INLINE_BYTES:
        data = buf[8 : 8 + n]
    else:
        data = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


# ---- workers -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What every rank loads, and how the ranks meet. Ranks are global: node (stage) * world + local rank."""

    path: str
    world: int  # ranks per node: the tensor-parallel size
    device: str  # rank 0's device; local rank r takes cuda:(index + r) on CUDA, the CPU on the CPU
    dtype: torch.dtype
    max_model_len: int | None
    threads: int  # torch threads per rank on the CPU
    store_port: int
    nnodes: int = 1  # pipeline stages, one per node (models/pipeline.py)
    store_host: str = "127.0.0.1"  # the rendezvous store: the leader's address

    @property
    def topology(self) -> Topology:
        return Topology(self.world, self.nnodes)

    def device_of(self, rank: int) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cuda":
            return torch.device("cuda", (dev.index or 0) + rank % self.world)
        return dev

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"


def _exit_with_parent(parent: int) -> None:
    while True:  # reparented (the server died, even by SIGKILL): nothing will ever send again
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(_PARENT_POLL_S)


def join_group(
    spec: ShardSpec, rank: int, shard: nn.Module | None = None
) -> tuple[Any, dist.ProcessGroup, dist.ProcessGroup | None]:
    """Meet the other ranks: (store, control group, this rank's stage group; None on one node: the default group).
    A stage's shard gets its collectives pointed at its stage group."""
    topology = spec.topology
    store = dist.TCPStore(spec.store_host, spec.store_port, topology.world, is_master=False, wait_for_workers=False)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=topology.world)
    group = None
    if spec.nnodes > 1:
        group = stage_groups(topology)[topology.stage_of(rank)]
        if shard is not None:
            set_group(shard, group)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return store, control, group


def load_rank(spec: ShardSpec, rank: int) -> nn.Module:
    """Global rank `rank`'s part: its tensor-parallel shard of all layers, or (several nodes) of its stage's."""
    device, local = spec.device_of(rank), rank % spec.world
    if spec.nnodes == 1:
        return load_shard(spec.path, local, spec.world, device, spec.dtype, spec.max_model_len).eval()
    from omnivox.models.checkpoint import load_hf_config
    from omnivox.models.config import ModelConfig

    topology = spec.topology
    stage = topology.stage_of(rank)
    cfg = ModelConfig.from_hf(load_hf_config(spec.path), spec.max_model_len)
    layers = stage_layers(cfg.num_layers, stage, spec.nnodes)
    first, last = stage == 0, stage == spec.nnodes - 1
    shard = load_shard(spec.path, local, spec.world, device, spec.dtype, spec.max_model_len, None, layers, first, last)
    return PipelineStage(shard.eval(), topology, rank)


def worker_main(rank: int, spec: ShardSpec, parent: int, conn) -> None:
    """A worker process: load this rank's shard, say so, join the group, then run what rank 0 sends until stopped."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        torch.set_num_threads(spec.threads)
        device = spec.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shard = load_rank(spec, rank)
    except BaseException as exc:  # told to rank 0, which raises it as the load error
        conn.send(f"rank {rank}: {type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    conn.close()
    _store, control, group = join_group(spec, rank, shard)
    try:
        serve_rank(shard, control, device, group)
    finally:
        dist.destroy_process_group()


def _num_layers(shard: nn.Module) -> int:
    return len(shard.shard.layers if isinstance(shard, PipelineStage) else shard.layers)


@torch.inference_mode()
def serve_rank(shard: nn.Module, control: dist.ProcessGroup, device: torch.device, group=None) -> None:
    """Run what rank 0 sends until Stop. `group`: the stage group (several nodes); logits and embedding lookups
    happen on stage 0 only, where the head and the embedding are."""
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    dtype = next(shard.parameters()).dtype
    on_first_stage = not isinstance(shard, PipelineStage) or shard.first
    while True:
        msg = receive(control)
        if isinstance(msg, Stop):
            return
        if isinstance(msg, Caches):
            caches = []  # the old cache goes first: two would not fit a GPU sized for one
            caches = [  # this rank's layers (a stage's), at rank 0's slots
                (
                    torch.zeros(msg.shape, dtype=msg.dtype, device=device),
                    torch.zeros(msg.shape, dtype=msg.dtype, device=device),
                )
                for _ in range(_num_layers(shard))
            ]
        elif isinstance(msg, Forward):
            meta, *args = portable(msg.args, device)
            rebuild_masks(meta)
            ids, positions = msg.input_ids.to(device), msg.positions.to(device)
            shard(ids, positions, caches, meta, *args, **portable(msg.kwargs, device))
        elif isinstance(msg, Logits):
            if on_first_stage:
                hidden = torch.empty(msg.rows, shard.config.hidden_size, dtype=dtype, device=device)
                dist.broadcast(hidden, src=0, group=group)
                shard.compute_logits(hidden)
        elif isinstance(msg, Embed):
            if on_first_stage:
                shard.embed_tokens(msg.ids.to(device))
        elif isinstance(msg, GatherKV):
            for layer in caches:
                for local in layer:
                    dist.gather(local.cpu(), None, dst=0, group=control)
        else:
            raise RuntimeError(f"tensor-parallel worker: unknown message {msg!r}")
