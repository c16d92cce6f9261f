"""The nodes of a model group past the leader (LeaderWorkerSet's worker pods), and the leader's watch on them.

A worker node (`omnivox serve --node-rank R`, R > 0) serves no gRPC: `run_worker_node` runs its local ranks
R * tp .. R * tp + tp - 1 (the first in this process, the others spawned as on the leader) until the leader sends
Stop, and returns non-zero when the group breaks: the leader gone (its sockets close, the control receive raises),
or one of this node's ranks dead. LeaderWorkerSet's RecreateGroupOnPodRestart then restarts the whole group, the
only way a group with a lost rank can serve again.

The leader cannot wait for a collective to fail to learn that a node is gone: an idle server runs none. So each
worker node's main process adds 1 to its counter in the rendezvous store every BEAT_S, and the leader's `NodeWatch`
calls a node lost when its counter has not moved for LOST_AFTER_S (no clocks compared across machines); the engine
polls it while idle (engine/engine.py) and stops, crash-only, so the server exits non-zero within seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omnivox.models.pipeline import NodeGroup
from omnivox.models.tensor_parallel_worker import ShardSpec, join_group, load_rank, serve_rank, worker_main

log = logging.getLogger(__name__)

BEAT_S = 0.5
LOST_AFTER_S = 3.0  # six beats missed: a busy host delays a thread by tens of ms, not seconds
STORE_WAIT = timedelta(minutes=30)  # a worker pod may start long before its leader's store listens


def beat_key(node: int) -> str:
    return f"omnivox/heartbeat/{node}"


class NodeWatch:
    """On the leader: the other nodes' heartbeats, read every BEAT_S in a thread of its own."""

    def __init__(self, host: str, port: int, nnodes: int) -> None:
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
        self._seen = {node: (-1, time.monotonic()) for node in range(1, nnodes)}
        self._lost: str | None = None
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="omnivox-node-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(BEAT_S):
            now = time.monotonic()
            for node, (count, since) in self._seen.items():
                try:
                    value = self._store.add(beat_key(node), 0)
                except Exception as exc:  # noqa: BLE001 - the store is the leader's own: unreachable means broken
                    self._lost = f"the rendezvous store stopped answering: {exc}"
                    return
                if value != count:
                    self._seen[node] = (value, now)
                elif now - since > LOST_AFTER_S:
                    self._lost = f"node {node} lost: no heartbeat for {now - since:.1f} s"
                    log.critical("model group broken: %s", self._lost)
                    return

    def lost(self) -> str | None:
        """Why the group is broken (a node stopped beating), or None."""
        return self._lost

    def stop(self) -> None:
        self._stopped.set()


def _beat(store: dist.TCPStore, node: int, stopping: threading.Event) -> None:
    while not stopping.is_set():
        try:
            store.add(beat_key(node), 1)
        except Exception:  # noqa: BLE001 - the leader (and its store) is gone
            if stopping.wait(2.0):  # a Stop being handled: the leader closes its store right after
                return
            log.critical("the leader's rendezvous store is gone: exiting")
            os._exit(1)
        time.sleep(BEAT_S)


def _watch_children(children: list, stopping: threading.Event) -> None:
    while not stopping.wait(BEAT_S):
        dead = [p for p in children if not p.is_alive()]
        if dead:
            log.critical("rank process %s exited (%s): the model group is broken", dead[0].name, dead[0].exitcode)
            os._exit(1)


def run_worker_node(
    path: str | Path,
    tp: int,
    nodes: NodeGroup,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
) -> int:
    """Run this node's ranks of the group until the leader stops it (0) or the group breaks (1)."""
    assert nodes.node_rank > 0, "node rank 0 is the leader: it serves (services/grpc_api/server.py)"
    spec = ShardSpec(
        str(path), tp, str(device), dtype, max_model_len, torch.get_num_threads(), nodes.master_port, nodes.nnodes,
        nodes.master_addr,
    )  # fmt: skip
    first = nodes.node_rank * tp
    stopping = threading.Event()
    store = dist.TCPStore(nodes.master_addr, nodes.master_port, is_master=False, timeout=STORE_WAIT)
    threading.Thread(target=_beat, args=(store, nodes.node_rank, stopping), daemon=True).start()
    ctx = mp.get_context("spawn")
    children, conns = [], []
    for rank in range(first + 1, first + tp):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=worker_main, args=(rank, spec, os.getpid(), theirs), name=f"omnivox-r{rank}", daemon=True
        )
        p.start()
        theirs.close()
        children.append(p)
        conns.append(mine)
    device = spec.device_of(first)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = load_rank(spec, first)
    for p, conn in zip(children, conns, strict=True):
        answer = conn.recv() if conn.poll(1800) else f"{p.name}: no answer while loading"
        if answer != "ready":
            log.critical("rank failed to load: %s", answer)
            return 1
    threading.Thread(target=_watch_children, args=(children, stopping), daemon=True).start()
    log.info(
        "node %d of %d: ranks %d..%d loaded, joining the group", nodes.node_rank, nodes.nnodes, first, first + tp - 1
    )
    try:
        _store, control, group = join_group(spec, first, shard)
        serve_rank(shard, control, device, group)
    except Exception as exc:  # noqa: BLE001 - a broken group: the leader or a peer gone
        log.critical("model group broken (%s): exiting", exc)
        stopping.set()
        for p in children:
            p.terminate()
        # Not a return: the interpreter's exit then destroys the broken gloo group with its threads still running,
        # and std::terminate aborted the process (exit -6, not 1; test_a_lost_leader_ends_the_worker_node_non_zero
        # failed so at load 10).
        logging.shutdown()
        os._exit(1)
    finally:
        stopping.set()
    log.info("stopped by the leader")
    for p in children:
        p.join(10)
    dist.destroy_process_group()
    return 0
