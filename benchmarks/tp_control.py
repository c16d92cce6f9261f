"""Tensor parallelism's per-step control message over gloo, 2 processes on the host: what one decode step's Forward
message (ids, positions, slots, block tables, lengths of `--batch` requests) costs rank 0, sent three ways.

    python -m omnivox.benchmarks.tp_control [--batch 16 64] [--rounds 5] [--out results.json]

Each iteration sends the message and then meets the worker in a 1-element all_reduce (as the forward's first
collective would), so the worker's unpickling is inside the time; the all_reduce alone is the baseline, subtracted.
Variants, interleaved round by round: `torch_pickle` (the send before: tensors through torch's storage pickling),
`bytes` (models/tensor_parallel_worker.send: tensors pickled as their raw bytes, one broadcast) and `tensor_dict`
(vLLM's broadcast_tensor_dict shape: the pickled skeleton in a small buffer, the int64 tensors in a second, flat
broadcast). Prints one JSON line: median microseconds per message of each round.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import pickle
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omnivox.benchmarks.host import write_results
from omnivox.models.attention import AttentionMetadata
from omnivox.models.tensor_parallel_worker import _INLINE_BYTES, Forward, dumps, receive, send

ITERATIONS = 200
HEADER = 4096


def decode_message(batch: int, blocks: int = 10, block_size: int = 16) -> Forward:
    lens = torch.arange(batch) + blocks * block_size - batch
    tables = torch.arange(batch * blocks).view(batch, blocks)
    meta = AttentionMetadata(block_size, tables[:, 0] * block_size + lens % block_size, batch, tables, None, lens, [])
    return Forward((meta, None, None), {}, torch.arange(batch) + 100, lens - 1)


def torch_pickle_send(msg, group) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    buf = torch.zeros(8 + _INLINE_BYTES, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)


def _skeleton(obj, tensors: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", len(tensors) - 1)
    if isinstance(obj, list | tuple):
        return type(obj)(_skeleton(x, tensors) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _skeleton(getattr(obj, f.name), tensors))
        return out
    return obj


def tensor_dict_send(msg, group) -> None:
    tensors: list[torch.Tensor] = []
    data = pickle.dumps((_skeleton(msg, tensors), [t.numel() for t in tensors]))
    buf = torch.zeros(8 + HEADER, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    dist.broadcast(torch.cat([t.reshape(-1) for t in tensors]), src=0, group=group)


def tensor_dict_receive(group) -> None:
    buf = torch.empty(8 + HEADER, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    skeleton, sizes = pickle.loads(buf[8 : 8 + int(buf[:8].view(torch.int64))].numpy().tobytes())
    flat = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(flat, src=0, group=group)
    flat.split(sizes)  # the worker's tensors (the skeleton refilled from them: not timed)


VARIANTS = {
    "torch_pickle": (torch_pickle_send, receive),
    "bytes": (send, receive),
    "tensor_dict": (tensor_dict_send, tensor_dict_receive),
}


def _rank(rank: int, port: int, batches: list[int], rounds: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    one = torch.zeros(1)
    out: dict = {}
    for batch in batches:
        msg = decode_message(batch)
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name in ("baseline", *VARIANTS):
                samples = []
                for _ in range(ITERATIONS):
                    dist.barrier()
                    t = time.perf_counter()
                    if name != "baseline":
                        sender, receiver = VARIANTS[name]
                        sender(msg, group) if rank == 0 else receiver(group)
                    dist.all_reduce(one)
                    samples.append(time.perf_counter() - t)
                times.setdefault(name, []).append(statistics.median(samples[20:]) * 1e6)
        base = statistics.median(times.pop("baseline"))
        out[batch] = {
            "baseline_all_reduce_us": round(base),
            **{f"{k}_us": [round(v - base) for v in vs] for k, vs in times.items()},
            **{f"{k}_median_us": round(statistics.median(vs) - base) for k, vs in times.items()},
        }
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.batch, args.rounds, results)) for r in range(2)]
    for p in procs:
        p.start()
    by_batch = results.get(timeout=1800)
    for p in procs:
        p.join(60)
    out = {
        "benchmark": "tp_control",
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg_1m": os.getloadavg()[0],
        "message_bytes": {
            b: {"torch_pickle": len(pickle.dumps(decode_message(b))), "bytes": len(dumps(decode_message(b)))}
            for b in args.batch
        },
        "by_batch": by_batch,
    }
    print(json.dumps(out))
    if args.out:
        write_results(args.out, out, indent=1)


if __name__ == "__main__":
    main()
