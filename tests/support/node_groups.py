"""Shared by the multi-node tests: a free port, and a node of a model group as a real `omnivox serve` process tree
configured only through the variables LeaderWorkerSet sets (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

OMNIVOX = [sys.executable, "-m", "omnivox.services.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lws_env(nnodes: int, worker_index: int) -> dict[str, str]:
    """What LeaderWorkerSet puts in a pod of the group (the leader's address: loopback here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LWS_")}
    env.update(
        LWS_GROUP_SIZE=str(nnodes), LWS_WORKER_INDEX=str(worker_index), LWS_LEADER_ADDRESS="127.0.0.1",
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    return env


class NodeTree:
    """`omnivox serve ARGS` as node `worker_index` of an `nnodes` group, in a session of its own (killpg kills the
    whole tree: the node's main process and the ranks it spawned); its output is collected on a thread."""

    def __init__(self, nnodes: int, worker_index: int, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*OMNIVOX, "serve", *args], env=lws_env(nnodes, worker_index), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def kill_tree(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def text(self) -> str:
        return "".join(self.log)


def processes_in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (a NodeTree's: its pid), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry.name))
    return out
