"""`omnivox serve`'s shutdown: SIGTERM to process exit, idle, with the heap frozen before exit (services/grpc_api/server.py
`run`) and without (the same server with `gc.freeze` made a no-op in its process), in interleaved pairs.

    python -m omnivox.benchmarks.serve_exit --model PATH [--pairs 5] [--metrics-port] [--out results.json]

Per run: SIGTERM to the server's `stopped` line (the drain: here no calls, so the servers and engines closing), and
`stopped` to the process gone (the interpreter's teardown). Prints one JSON object with every run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnivox.benchmarks.host import write_results

BOOT = {
    "frozen": "import sys\nfrom omnivox.services.cli import main\nsys.exit(main())",
    "not_frozen": "import gc, sys\ngc.freeze = lambda: None\nfrom omnivox.services.cli import main\nsys.exit(main())",
}


def one_run(variant: str, serve_args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOT[variant], "serve", *serve_args], stderr=subprocess.PIPE, text=True, env=env
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    while not any("serving" in line for _, line in lines):
        if proc.poll() is not None:
            raise RuntimeError("".join(line for _, line in lines))
        time.sleep(0.05)
    time.sleep(1.0)  # idle
    signaled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
    exit_s = time.monotonic() - signaled
    stopped_s = next(t for t, line in lines if "server: stopped" in line) - signaled
    return {
        "variant": variant,
        "rc": rc,
        "sigterm_to_stopped_s": round(stopped_s, 3),
        "teardown_s": round(exit_s - stopped_s, 3),
        "sigterm_to_exit_s": round(exit_s, 3),
        "load1": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="checkpoint folder or .gguf file to serve")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--metrics-port", action="store_true", help="also serve /metrics (its close is in the drain)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    args = ap.parse_args(argv)
    serve_args = ["--port", "0", "--model", str(args.model), "--kv-cache-gib", "0.02", "--threads", "1"]
    serve_args += ["--metrics-port", "0"] if args.metrics_port else []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = list(os.getloadavg())
    runs = [one_run(variant, serve_args) for _ in range(args.pairs) for variant in ("not_frozen", "frozen")]
    medians = {
        key: {v: statistics.median(r[key] for r in runs if r["variant"] == v) for v in BOOT}
        for key in ("sigterm_to_stopped_s", "teardown_s", "sigterm_to_exit_s")
    }
    result = {
        "benchmark": "serve_exit",
        "started": started,
        "model": str(args.model),
        "metrics_port": args.metrics_port,
        "load_average_at_start": load,
        "load_average_at_end": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "median": medians,
        "runs": runs,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        write_results(args.out, result)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
