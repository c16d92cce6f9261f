"""Tensor parallelism on one machine: decode step time at TP 1 and TP N, the time rank 0 spends in control messages,
and the peak memory of loading one rank's shard against the whole model.

    python -m omnivox.benchmarks.tensor_parallel [--model PATH] [--world 2] [--device cpu] [--batch 8]

Without --model, a random 8-layer, 512-wide Llama (128 MiB of float32) is made in a temporary folder. On the CPU each
rank gets `--threads` torch threads (default 1): compare TP N against TP 1 at the same threads per process, and know
that N processes also use N times the cores. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from omnivox.benchmarks.host import with_host
from omnivox.engine import Engine, SamplingParams

MID = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def make_mid(out: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MID)).save_pretrained(out)
    return out


def decode_step_ms(model: Path, world: int, device: str, batch: int, new_tokens: int) -> dict:
    """Mean decode step (ms) of `batch` greedy requests after their prefill, and rank 0's control time per step."""
    import omnivox.engine.tensor_parallel as tp

    spent = [0.0]
    send = tp.send

    def timed(msg, group) -> None:  # the message and the wait for the workers to take it
        t = time.perf_counter()
        send(msg, group)
        spent[0] += time.perf_counter() - t

    tp.send = timed
    try:
        engine = Engine.from_pretrained(model, device=device, dtype="float32", kv_cache_gib=0.25, tensor_parallel=world)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request([1, *range(10 + i, 40 + i)], params)
        while engine.num_steps < 4:  # prefill and the first decodes: warm
            engine.step()
        spent[0], n0, t0 = 0.0, engine.num_steps, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        steps = engine.num_steps - n0
        out = {"step_ms": 1e3 * (time.perf_counter() - t0) / steps, "control_ms": 1e3 * spent[0] / steps}
        engine.shutdown()
    finally:
        tp.send = send
    return out


def load_peak_mib(model: Path, world: int) -> float:
    """Peak resident memory added by loading rank 0's shard (world > 1) or the whole model, in a fresh process
    (Linux: the high-water mark is reset through /proc/self/clear_refs after the imports)."""
    code = (
        "import torch\n"
        "from omnivox.models.tensor_parallel import load_shard\n"
        "from omnivox.engine.loading import load_model\n"
        "def kib(key):\n"
        "    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(key))\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = kib('VmRSS:')\n"
        f"path, world = {str(model)!r}, {world}\n"
        "cpu = torch.device('cpu')\n"
        "m = load_shard(path, 0, world, cpu, torch.float32) if world > 1 else load_model(path, cpu, torch.float32)\n"
        "print((kib('VmHWM:') - base) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a checkpoint folder (default: a random 8-layer 512-wide Llama)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on the CPU")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_mid(Path(tmp) / "mid")
        result = {
            "model": str(args.model or "random llama 8x512"),
            "device": args.device,
            "batch": args.batch,
            "threads_per_rank": args.threads,
            "load_avg_1m": os.getloadavg()[0],
            "tp1": decode_step_ms(model, 1, args.device, args.batch, args.new_tokens),
            f"tp{args.world}": decode_step_ms(model, args.world, args.device, args.batch, args.new_tokens),
            "load_peak_mib": {
                "whole": load_peak_mib(model, 1),
                f"shard_of_{args.world}": load_peak_mib(model, args.world),
            },
        }
    print(json.dumps(with_host(result)))


if __name__ == "__main__":
    main()
