"""The long load-and-fault run: `omnivox serve` in a child process, every workload of benchmarks/load_fault.py
from this one (loopback only), the server's memory and file descriptors sampled from /proc, its state read from
/metrics. Prints one JSON report with a pass/fail per check.

    python -m omnivox.benchmarks.make_random_checkpoint --shape qwen2.5-0.5b --out /tmp/qwen-random
    python -m omnivox.benchmarks.load_fault_suite --model /tmp/qwen-random --soak-seconds 1800 --out report.json

tests/ops/test_ops_load_fault.py is the bounded CI version of the same checks (a 12 s soak instead of 30 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.load_fault import ResourceSampler, cancels, overload, slow_readers, soak
from omnivox.v1 import generation_pb2_grpc

RSS_SLOPE_LIMIT_MIB_PER_MIN = 40.0
FD_SLOPE_LIMIT_PER_MIN = 5.0


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC address, metrics URL) once it serves."""
    cmd = [sys.executable, "-m", "omnivox.services.cli", "serve", "--model", model, "--port", "0"]
    cmd += ["--metrics-port", "0", "--max-queue", "32", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = metrics = None
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        if m := re.search(r"metrics on (\S+)", line):
            metrics = m.group(1)
        if m := re.search(r"serving .* on (\S+)$", line.strip()):
            address = m.group(1)
            break
    if address is None or metrics is None:
        raise SystemExit(f"omnivox serve did not start (exit {proc.wait()})")
    # Keep reading its log (one JSON line per RPC): a full pipe would block the server's writes.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    return proc, address, metrics


def engine_state(metrics_url: str) -> dict[str, float]:
    """Running, waiting and KV usage summed over models, from /metrics."""
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for name, key in (
        ("omnivox_num_requests_running", "running"),
        ("omnivox_num_requests_waiting", "waiting"),
        ("omnivox_kv_cache_usage_perc", "kv_usage"),
    ):
        out[key] = sum(float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} (\S+)$", body, re.M))
    return out


def idle_within(metrics_url: str, seconds: float) -> tuple[bool, dict[str, float]]:
    deadline = time.monotonic() + seconds
    while True:
        state = engine_state(metrics_url)
        if not any(state.values()) or time.monotonic() > deadline:
            return not any(state.values()), state
        time.sleep(0.05)


async def run(address: str, metrics_url: str, pid: int, soak_seconds: float) -> dict:
    report: dict = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        o = await overload(stub, 300, 32, ramp_s=1.0)
        o["pass"] = set(o["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"} and o["rejection_p99_ms"] < 50
        report["overload"] = o
        c = await cancels(stub, 500, 500, 64)
        c["idle"], c["state_after_2s"] = idle_within(metrics_url, 2.0)
        c["pass"] = c["idle"]
        report["cancels"] = c
        base = await slow_readers(stub, 8, 0, 48, 0.25)
        loaded = await slow_readers(stub, 8, 8, 48, 0.25)
        report["slow_readers"] = {
            "baseline": base,
            "with_slow_readers": loaded,
            "pass": loaded["gap_p99_ms"] <= 2 * base["gap_p99_ms"] + 5,
        }
        with ResourceSampler(pid, interval_s=1.0) as sampler:
            s = await soak(stub, soak_seconds, 16)
        s["rss_mib_per_min"], s["fds_per_min"] = sampler.slopes_per_min()
        s["rss_mib_start"], s["rss_mib_end"] = sampler.samples[0][1], sampler.samples[-1][1]
        s["pass"] = s["rss_mib_per_min"] < RSS_SLOPE_LIMIT_MIB_PER_MIN and s["fds_per_min"] < FD_SLOPE_LIMIT_PER_MIN
        report["soak"] = s
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.load_fault_suite")
    p.add_argument("--model", required=True, help="checkpoint folder or .gguf for `omnivox serve`")
    p.add_argument("--soak-seconds", type=float, default=1800.0)
    p.add_argument("--out", type=Path, help="write the JSON report here too")
    p.add_argument("serve_args", nargs="*", help="more `omnivox serve` flags, after --")
    args = p.parse_args(argv)
    proc, address, metrics_url = start_server(args.model, args.serve_args)
    try:
        report = asyncio.run(run(address, metrics_url, proc.pid, args.soak_seconds))
        signaled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        report["sigterm"] = {"exit": rc, "seconds": time.monotonic() - signaled, "pass": rc == 0}
    finally:
        if proc.poll() is None:
            proc.kill()
    report["pass"] = all(v.get("pass", True) for v in report.values() if isinstance(v, dict))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        write_results(args.out, report, indent=1)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
