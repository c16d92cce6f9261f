"""Tensor-parallel serving: rank 0 runs the whole engine; ranks 1..N-1 run each step's forward on their shard.

Rank 0 (the serving process) schedules, owns the block pool, samples, and runs the encoders and the codec. Its
ModelRunner drives a `TensorParallelModel`: a stand-in for the decoder whose `forward` first broadcasts exactly what
it was given (input ids, positions, the attention metadata with its slot mapping, decode block tables and lengths,
prefill chunks, and the embedding rows/values of image or audio segments) to the workers, then runs rank 0's shard.
Every worker runs the same forward on its own shard (models/tensor_parallel.py) and its own paged cache, so the
collectives inside (one all-reduce after the embedding, two per layer) meet. `compute_logits` broadcasts the hidden
rows the runner picked (identical on every rank after the last all-reduce: [R, hidden], one broadcast per step next
to the 2L+1 all-reduces of [T, hidden]) and all-gathers the vocabulary shards; rank 0 samples.

Each rank's cache holds its KV heads at the same slots: only rank 0 allocates blocks, the workers' caches take the
shape of rank 0's (announced whenever it changes, e.g. after the CUDA profiling run) and are indexed by the slots
rank 0 sends. Control messages travel pickled over a gloo group on the host (tensors on the CPU, pickled as their raw
bytes; NCCL carries the model's collectives on CUDA), in one order, under one lock: a message and the collectives it
starts are atomic. One message is one broadcast of a fixed buffer: a step's tensors sent by a second collective
(vLLM's broadcast_tensor_dict) measured no faster over gloo (one more round trip per message).

Workers are spawned processes (torch.multiprocessing) running models/tensor_parallel_worker.py; they exit on the stop
message `close()` sends, when the control channel breaks, or when their parent is gone (polled), so a killed server
leaves no orphans. Spawning re-imports the main module in each worker: a script that serves tensor-parallel needs
the `if __name__ == "__main__":` guard (the `omnivox` command has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from omnivox.engine.errors import ModelGroupBroken
from omnivox.models.node_worker import NodeWatch
from omnivox.models.pipeline import NodeGroup, PipelineStage, set_group, stage_groups
from omnivox.models.tensor_parallel import check_world, local_kv_heads
from omnivox.models.tensor_parallel_worker import (
    CONTROL_TIMEOUT,
    Caches,
    Embed,
    Forward,
    GatherKV,
    Logits,
    ShardSpec,
    Stop,
    load_rank,
    portable,
    send,
    without_decode_mask,
    worker_main,
)

log = logging.getLogger(__name__)


# ---- rank 0 --------------------------------------------------------------------------------------------------------
class TensorParallelModel(nn.Module):
    """Rank 0's decoder, as the engine sees it: the shard, plus the workers kept in step with it.

    `config` is this rank's: its attention heads, KV heads and MLP slice (a `world`-th of each), so the runner sizes
    the cache for the heads a rank holds and `kv_cache_gib` means per rank (per GPU)."""

    def __init__(
        self,
        shard: nn.Module,
        control: dist.ProcessGroup,
        workers: list,
        store: Any,
        stage_group: dist.ProcessGroup | None = None,
        watch: NodeWatch | None = None,
    ) -> None:
        """shard: rank 0's DecoderModel shard, or its PipelineStage (several nodes: stage_group is stage 0's)."""
        super().__init__()
        self.shard = shard
        self.pipeline = isinstance(shard, PipelineStage)
        self.world = shard.topology.tp if self.pipeline else dist.get_world_size()  # the tensor-parallel size
        full = shard.config
        self.full_config = full
        layers = shard.shard.layers if self.pipeline else shard.layers
        self.config = dataclasses.replace(
            full,
            num_heads=full.num_heads // self.world,
            num_kv_heads=local_kv_heads(full, self.world),  # one, replicated, with fewer KV heads than ranks
            intermediate_size=full.intermediate_size // self.world,
            num_layers=len(layers),  # a stage's: the runner's cache holds stage 0's layers, each stage its own
        )
        self._control = control
        self._stage_group = stage_group
        self._workers = workers
        self._store = store  # keeps the rendezvous store (and its port) alive as long as the group
        self._watch = watch  # the other nodes' heartbeats (several nodes)
        self._lock = threading.Lock()
        self._cache_key: tuple | None = None
        self._closed = False
        self._broken: Exception | None = None  # what broke the group (a collective failed, a worker died)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def raise_if_broken(self) -> None:
        """Raise when a collective failed or a worker is gone: the group cannot run another step, and the engine's
        own handling (fail the step's requests, serve the rest) would fail every later request too. The engine
        loop calls this after each step and stops (crash-only), so the server goes NOT_SERVING and exits."""
        if self._broken is None and not self._closed:
            dead = [p for p in self._workers if not p.is_alive()]
            if dead:
                self._broken = RuntimeError(f"tensor-parallel worker {dead[0].name} exited ({dead[0].exitcode})")
            elif self._watch is not None and (lost := self._watch.lost()) is not None:
                self._broken = RuntimeError(lost)
        if self._broken is not None:
            raise ModelGroupBroken(f"tensor-parallel group broken: {self._broken}") from self._broken

    @contextlib.contextmanager
    def _step(self):
        """One message and the collectives it starts, atomic; a failure marks the group broken."""
        with self._lock:
            if self._broken is not None:
                raise ModelGroupBroken(f"tensor-parallel group broken: {self._broken}")
            try:
                yield
            except Exception as exc:
                self._broken = exc
                raise ModelGroupBroken(f"tensor-parallel group broken: {exc}") from exc

    def forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs) -> torch.Tensor:
        with self._step():
            k0 = kv_caches[0][0]
            key = (k0.data_ptr(), tuple(k0.shape), k0.dtype, len(kv_caches))
            if key != self._cache_key:  # a new cache (the runner's, after a profiling run's): the workers follow
                send(Caches(len(kv_caches), tuple(k0.shape), k0.dtype), self._control)
                self._cache_key = key
            sent = (without_decode_mask(meta), *args)
            msg = Forward(portable(sent, None), portable(kwargs, None), input_ids.cpu(), positions.cpu())
            send(msg, self._control)
            return self.shard(input_ids, positions, kv_caches, meta, *args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor, window: tuple[int, int] | None = None) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32 (every row on the workers; `window` (lo, hi) keeps columns lo..hi-1)."""
        with self._step():
            hidden = hidden.contiguous()
            send(Logits(hidden.shape[0]), self._control)
            dist.broadcast(hidden, src=0, group=self._stage_group)
            logits = self.shard.compute_logits(hidden)
            return logits if window is None else logits[:, window[0] : window[1]]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        with self._step():
            send(Embed(ids.cpu()), self._control)
            return self.shard.embed_tokens(ids)

    def gather_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's cache joined along the head axis, on the CPU: [slots, all kv heads, head_dim] per layer and
        K/V — what one process would hold, a replicated head once (tests compare it; it copies the whole cache)."""
        if self.pipeline:
            raise NotImplementedError("gather_kv_caches: one node only (a stage holds some layers of the cache)")
        out = []
        with self._step():
            send(GatherKV(), self._control)
            for layer in kv_caches:
                joined = []
                for local in layer:
                    parts = [torch.empty_like(local, device="cpu") for _ in range(self.world)]
                    dist.gather(local.cpu(), parts, dst=0, group=self._control)
                    replicas = max(1, self.world // self.full_config.num_kv_heads)  # ranks holding the same head
                    joined.append(torch.cat(parts[::replicas], dim=1))
                out.append(tuple(joined))
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (they leave their loop and exit) and leave the process group. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._watch is not None:  # the other nodes stop beating once they hear Stop
                self._watch.stop()
            try:
                if self._broken is None:
                    send(Stop(), self._control)
            except Exception:  # a worker already gone: the others are stopped below all the same
                log.exception("tensor-parallel stop message failed")
            deadline = time.monotonic() + (timeout if self._broken is None else 1.0)  # broken: none will hear
            for p in self._workers:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in self._workers:
                if p.is_alive():
                    log.warning("tensor-parallel worker %d did not stop; killing it", p.pid)
                    p.kill()
                    p.join(5)
            if dist.is_initialized():
                dist.destroy_process_group()


# ---- starting ------------------------------------------------------------------------------------------------------
def start_tensor_parallel(
    path: str | Path,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    load_timeout_s: float = 1800.0,
    nodes: NodeGroup | None = None,
) -> TensorParallelModel:
    """Spawn ranks 1..world-1, load rank 0's shard here, join the group; returns rank 0's model for the engine.

    This process becomes rank 0 of the default process group (one tensor-parallel model per process). `nodes`
    (nnodes > 1, this the leader): the group spans nodes, `world` ranks on each, pipeline stages across them
    (models/pipeline.py); the rendezvous store listens on nodes.master_port for the other nodes' ranks
    (models/node_worker.py), which load their own stages meanwhile."""
    nnodes = nodes.nnodes if nodes is not None else 1
    check_world(path, world, device, max_model_len)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group: one tensor-parallel model per process")
    if nnodes == 1:
        # Port 0: the store picks a free port and keeps it bound (no window in which another process could take it).
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        host = "127.0.0.1"
    else:
        assert nodes is not None and nodes.node_rank == 0, "the leader (node rank 0) serves"
        store = dist.TCPStore(
            nodes.master_addr, nodes.master_port, world * nnodes, is_master=True, wait_for_workers=False
        )
        host = nodes.master_addr
    threads = torch.get_num_threads()
    spec = ShardSpec(str(path), world, str(device), dtype, max_model_len, threads, store.port, nnodes, host)
    ctx = mp.get_context("spawn")
    workers, conns = [], []
    try:
        for rank in range(1, world):
            mine, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker_main, args=(rank, spec, os.getpid(), theirs), name=f"omnivox-tp{rank}", daemon=True
            )
            p.start()
            theirs.close()
            workers.append(p)
            conns.append(mine)
        shard = load_rank(spec, 0)
        _wait_loaded(workers, conns, load_timeout_s)
        dist.init_process_group(spec.backend, store=store, rank=0, world_size=world * nnodes)
        stage_group = None
        if nnodes > 1:  # every rank makes every stage's group, then the control group (models/pipeline.py)
            stage_group = stage_groups(spec.topology)[0]
            set_group(shard, stage_group)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except BaseException:
        for p in workers:
            p.kill()
            p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    log.info("tensor parallel: %d ranks (%s), workers %s", world, spec.backend, [p.pid for p in workers])
    watch = None
    if nnodes > 1:
        log.info("pipeline: %d nodes of %d ranks, rendezvous %s:%d", nnodes, world, host, store.port)
        watch = NodeWatch(host, store.port, nnodes)
    return TensorParallelModel(shard, control, workers, store, stage_group, watch)


def _wait_loaded(workers: list, conns: list, timeout_s: float) -> None:
    """Until every worker has loaded its shard; its error, or its death, raised here."""
    deadline = time.monotonic() + timeout_s
    for p, conn in zip(workers, conns, strict=True):
        while not conn.poll(0.1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker {p.name} died while loading (exit code {p.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel worker {p.name} did not load within {timeout_s:.0f} s")
        try:
            answer = conn.recv()
        except EOFError:  # gone without a word (killed; or a main module that re-ran itself in the child)
            p.join(5)
            raise RuntimeError(f"tensor-parallel worker {p.name} died while loading (exit code {p.exitcode})") from None
        if answer != "ready":
            raise ValueError(f"tensor-parallel {answer}")
