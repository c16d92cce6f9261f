"""`omnivox serve` past one node: --nnodes / --node-rank / --master-addr / --master-port, a model group of pods.

The defaults come from the variables LeaderWorkerSet sets in every pod of a group (LWS_GROUP_SIZE, LWS_WORKER_INDEX,
LWS_LEADER_ADDRESS), so one command line serves the leader and the workers alike (deploy/overlays/lws). Node rank 0
(the leader) serves gRPC with the engine's rank 0; the others run only their ranks' worker loop
(models/node_worker.py) and exit non-zero when the group breaks.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from omnivox.services.cli._common import CliError

if TYPE_CHECKING:
    from omnivox.models.pipeline import NodeGroup

DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary rendezvous port


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise CliError(f"${name} is {value!r}, not a number") from None


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model groups over several nodes (pipeline stages across nodes, --tensor-parallel within)")
    g.add_argument("--nnodes", type=int, help="nodes (pods) in the model group (default: $LWS_GROUP_SIZE, else 1)")
    g.add_argument(
        "--node-rank", type=int, help="this node's rank, 0 = the leader (default: $LWS_WORKER_INDEX, else 0)"
    )
    g.add_argument("--master-addr", help="the leader's address, where ranks meet (default: $LWS_LEADER_ADDRESS)")
    g.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"the rendezvous port (default {DEFAULT_MASTER_PORT})",
    )


def node_group(args: argparse.Namespace) -> NodeGroup | None:
    """The group this process belongs to, None for one node; CliError naming the flag when it cannot be."""
    nnodes = args.nnodes if args.nnodes is not None else _env_int("LWS_GROUP_SIZE", 1)
    rank = args.node_rank if args.node_rank is not None else _env_int("LWS_WORKER_INDEX", 0)
    if nnodes < 1 or not 0 <= rank < nnodes:
        raise CliError(f"--nnodes {nnodes} / --node-rank {rank}: need nnodes >= 1 and 0 <= node rank < nnodes")
    if nnodes == 1:
        return None
    addr = args.master_addr or os.environ.get("LWS_LEADER_ADDRESS")
    if not addr:
        raise CliError("--nnodes > 1 needs --master-addr (or $LWS_LEADER_ADDRESS): the leader's address")
    if not 1 <= args.master_port <= 65535:
        raise CliError(f"--master-port must be in [1, 65535], got {args.master_port}")
    if len(args.models) != 1:
        raise CliError("--nnodes > 1 serves exactly one --model (one process group per server)")
    from omnivox.models.pipeline import NodeGroup

    return NodeGroup(nnodes, rank, addr, args.master_port)


def run_worker_node(args: argparse.Namespace, nodes: NodeGroup) -> int:
    """A worker node: its ranks' loop only, no gRPC; the exit status of the group's end."""
    import logging

    import torch

    from omnivox.models.node_worker import run_worker_node as run_ranks

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return run_ranks(args.models[0].expanduser(), args.tensor_parallel, nodes, device, dtype, args.max_model_len)
