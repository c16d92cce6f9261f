"""`omnivox bench`: omnivox's gRPC server against its peers, on one model, one machine, in one run.

    python -m omnivox.benchmarks --model PATH [--concurrency 1,4,16,64] [--systems omnivox,hf,hf-cb,llamacpp-server,llamacpp]

Writes results.json, results.md and results.png to --out (default bench-results/) and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omnivox.benchmarks import report
from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.metrics import summarize
from omnivox.benchmarks.systems.base import SystemUnavailable
from omnivox.benchmarks.workload import WorkloadSpec, describe, make_workload

if TYPE_CHECKING:
    from omnivox.benchmarks.systems.base import System

# torch and the peers are imported where used, so that `omnivox --help` stays fast.
ALL_SYSTEMS = ("omnivox", "omnivox-engine", "hf", "hf-cb", "llamacpp-server", "llamacpp")
DTYPES = ("float32", "bfloat16", "float16")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with LOW <= HIGH, got {text!r}")
    return values[0], values[1]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omnivox bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared by `python -m omnivox.benchmarks` and `omnivox bench`)."""
    ap.add_argument("--model", help="checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--address", help="benchmark an omnivox server already running here instead of starting one")
    ap.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64], help="levels, e.g. 1,4,16,64")
    ap.add_argument("--requests-per-slot", type=int, default=2, help="requests per level = this x concurrency ...")
    ap.add_argument("--min-requests", type=int, default=4, help="... but at least this many")
    ap.add_argument(
        "--level-seconds",
        type=float,
        default=120.0,
        help="after this long a level sends no new request (the first wave always goes): bounds a slow peer",
    )
    ap.add_argument("--prompt-words", type=_range, default=(16, 96), help="LOW,HIGH words per prompt (seeded)")
    ap.add_argument("--output-tokens", type=_range, default=(16, 64), help="LOW,HIGH output tokens (seeded)")
    ap.add_argument("--shared-prefix-words", type=int, default=24, help="words every prompt starts with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of omnivox and the peers")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (peers and bandwidth; the server picks its own)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated subset of {ALL_SYSTEMS}")
    ap.add_argument("--gguf", help="GGUF file for the llama.cpp peers (default: --model when it is a .gguf)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `omnivox serve` (repeat)")
    ap.add_argument(
        "--quantization",
        choices=("none", "auto", "int8", "int4"),
        default="auto",
        help="weights of both omnivox systems, as `omnivox serve --quantization` (whose default is also auto: a GGUF "
        "at its own bit widths on CPU, float elsewhere); none = float",
    )
    ap.add_argument(
        "--activation-bits",
        type=int,
        choices=(8, 16),
        default=16,
        help="activations of both omnivox systems' quantised kernels, as `omnivox serve --activation-bits`",
    )
    ap.add_argument(
        "--threads",
        type=int,
        help="CPU threads for every system (torch intra-op, `omnivox serve --threads`, llama.cpp n_threads); default:"
        " all cores but one, as `omnivox serve` does (on a shared machine 1 is steadier)",
    )
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="matrix size for the bandwidth measurement")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--no-progress", action="store_true")


def machine_description(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    from omnivox.native.kernel_build import cpu_model

    cpu = cpu_model() or platform.processor() or "CPU"
    return f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__} with {torch.get_num_threads()} threads"


def git_commit() -> str | None:
    """The omnivox commit measured (with `+dirty` when the work tree has changes), or None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def default_model() -> str:
    try:
        from omnivox.services.parts.defaults import ensure_default_model
    except ImportError as e:
        raise SystemExit(f"--model: not given and the embedded default is unavailable ({e})") from None
    return str(ensure_default_model())


def make_systems(
    args: argparse.Namespace, model: str, names: list[str], kv_tokens: int
) -> list[System | tuple[str, str]]:
    """The systems to run, in order; a peer that cannot be built here is (name, reason). `kv_tokens`: the KV cache
    the workload needs at its highest concurrency (for peers that must be told)."""
    import torch

    dtype = getattr(torch, args.dtype)
    out: list = []
    for name in names:
        if name == "omnivox":
            from omnivox.benchmarks.systems.omnivox_grpc import OmnivoxGrpc

            out.append(
                OmnivoxGrpc(
                    model=model,
                    address=args.address,
                    server_args=[
                        *("--dtype", args.dtype, "--device", args.device, "--threads", str(args.threads)),
                        *("--quantization", args.quantization, "--activation-bits", str(args.activation_bits)),
                        *args.server_arg,
                    ],
                    log_path=args.out / "omnivox-server.log",
                )
            )
        elif name == "omnivox-engine":
            from omnivox.benchmarks.systems.omnivox_engine import OmnivoxEngineInProcess

            out.append(OmnivoxEngineInProcess(model, args.dtype, args.device, args.quantization, args.activation_bits))
        elif name == "hf":
            from omnivox.benchmarks.systems.hf_generate import HFGenerate

            out.append(HFGenerate(model, dtype, args.device))
        elif name == "hf-cb":
            from omnivox.benchmarks.systems.hf_continuous import HFContinuousBatching

            out.append(HFContinuousBatching(model, dtype, args.device, kv_tokens=kv_tokens))
        elif name in ("llamacpp-server", "llamacpp"):
            from omnivox.benchmarks.systems import llamacpp

            gguf = args.gguf or (model if model.endswith(".gguf") else None)
            if gguf is None:
                out.append((llamacpp.display_name(name), "no GGUF file for this model (give --gguf)"))
            elif name == "llamacpp-server":
                out.append(llamacpp.LlamaCppServer(gguf, log_path=args.out / "llamacpp-server.log"))
            else:
                out.append(llamacpp.LlamaCppInProcess(gguf))
        else:
            raise SystemExit(f"--systems: unknown system {name!r}; choose from {ALL_SYSTEMS}")
    return out


def evaluate_targets(levels: list[dict], floor: dict | None) -> list[dict]:
    """The issue's targets, each with the measured ratio and a verdict (met / missed by how much / not measurable)."""
    by = {(r["system"], r["concurrency"]): r for r in levels}
    omni = {c: r for (s, c), r in by.items() if s == "omnivox"}
    targets = []

    def add(target: str, value: float | None, limit: float, below: bool, unit: str = "x") -> None:
        if value is None:
            verdict = "not measured"
        elif (value <= limit) if below else (value >= limit):
            verdict = f"met: {value:.2f}{unit} ({'<=' if below else '>='} {limit}{unit})"
        else:
            factor = value / limit if below else limit / value
            verdict = f"missed: {value:.2f}{unit} vs {limit}{unit} ({factor:.1f}x off)"
        targets.append({"target": target, "value": value, "limit": limit, "verdict": verdict})

    if floor and 1 in omni:
        add("batch-1 ITL p50 / bandwidth floor <= 1.3", omni[1]["itl_p50_ms"] / floor["itl_floor_ms"], 1.3, True)
    top = max(omni) if omni else None
    if top is not None:
        peer_rows = {s: r for (s, c), r in by.items() if c == top and s != "omnivox"}
        server = next((r for s, r in peer_rows.items() if s.startswith("llama.cpp server")), None)
        static = next((r for s, r in peer_rows.items() if s.startswith("transformers generate (")), None)
        t = omni[top]["total_tps"]
        add(f"total TPS at {top} / llama.cpp server >= 10", t / server["total_tps"] if server else None, 10, False)
        add(
            f"total TPS at {top} / transformers static batch >= 3",
            t / static["total_tps"] if static else None,
            3,
            False,
        )
        add(f"p99 ITL at {top} < 250 ms", omni[top]["itl_p99_ms"], 250, True, " ms")
    if 1 in omni and 16 in omni:
        add("TTFT p50 at 16 / TTFT p50 at 1 < 3", omni[16]["ttft_p50_ms"] / omni[1]["ttft_p50_ms"], 3, True)
    return targets


def run(args: argparse.Namespace) -> dict:
    import torch
    from tqdm import tqdm

    from omnivox.benchmarks.bandwidth import measure_bandwidth, measure_matmul, weight_bytes_per_step
    from omnivox.benchmarks.systems.hf_loading import load_config, load_tokenizer

    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) - 1)
    if args.threads < 1:
        raise SystemExit(f"--threads: must be >= 1, got {args.threads}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server and llama.cpp processes inherit it
    torch.set_num_threads(args.threads)
    try:
        import matplotlib  # noqa: F401 - the plot is written last: fail before the run, not after it
    except ImportError:
        raise SystemExit("omnivox bench needs matplotlib for its plot: pip install 'omnivox[bench]'") from None
    model = args.model or default_model()
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    levels_wanted = sorted(set(args.concurrency))
    per_level = {c: max(args.min_requests, args.requests_per_slot * c) for c in levels_wanted}
    spec = WorkloadSpec(
        num_requests=max(per_level.values()),
        prompt_words=args.prompt_words,
        output_tokens=args.output_tokens,
        shared_prefix_words=args.shared_prefix_words,
        seed=args.seed,
    )
    tokenizer = load_tokenizer(model)
    requests = make_workload(spec, tokenizer)
    config = load_config(model)
    dtype = getattr(torch, args.dtype)

    result: dict = {
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "activation_bits": args.activation_bits,
        "machine": machine_description(args.device),
        "load_average_at_start": list(os.getloadavg()),
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "spec": spec.__dict__ | {"prompt_words": list(spec.prompt_words), "output_tokens": list(spec.output_tokens)},
        "workload": describe(requests),
        "requests_per_level": per_level,
        "level_seconds": args.level_seconds,
        "levels": [],
        "skipped": {},
    }

    if args.bandwidth_mib > 0:
        bw = measure_bandwidth(dtype, args.bandwidth_mib, device=args.device)
        result["load_average_after_bandwidth"] = list(os.getloadavg())
        wbytes = weight_bytes_per_step(config, torch.empty((), dtype=dtype).element_size())
        result["bandwidth"] = bw.to_dict()
        result["floor"] = {
            "weight_bytes": wbytes,
            "bandwidth_gb_s": bw.gb_per_s,
            "itl_floor_ms": 1e3 * wbytes / (bw.gb_per_s * 1e9),
            "itl_over_floor": {},
        }
        # The compute roof: a token costs ~2 FLOPs per weight it passes through, prefill and decode alike, so at high
        # concurrency total TPS <= matmul rate / (2 x weights x (output + uncached prompt tokens) / output tokens).
        # (Reduced-precision matmuls without hardware support are slow on CPU: a smaller matrix keeps this short.)
        size = 8192 if args.device.startswith("cuda") else 1024 if dtype == torch.float32 else 384
        mm = measure_matmul(dtype, size=size, repeats=3, device=args.device)
        w = result["workload"]
        flop_per_token = 2 * wbytes / torch.empty((), dtype=dtype).element_size()
        result["matmul"] = mm.to_dict()
        result["floor"]["decode_tps_ceiling"] = mm.gflop_per_s * 1e9 / flop_per_token
        result["floor"]["workload_tps_ceiling_no_cache"] = result["floor"]["decode_tps_ceiling"] * (
            w["output_tokens"]["mean"] / (w["output_tokens"]["mean"] + w["prompt_tokens"]["mean"])
        )
        print(
            f"bandwidth {bw.gb_per_s:.1f} GB/s ({args.dtype} mv); floor {result['floor']['itl_floor_ms']:.1f} ms/step"
        )

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    kv_tokens = max(levels_wanted) * (longest + 16) * 5 // 4
    write_partial(result, args.out)
    for system in make_systems(args, model, names, kv_tokens):
        if isinstance(system, tuple):
            result["skipped"][system[0]] = system[1]
            print(f"skipped {system[0]}: {system[1]}")
            continue
        t0 = time.perf_counter()
        try:
            system.start()
        except SystemUnavailable as e:
            result["skipped"][system.name] = str(e)
            print(f"skipped {system.name}: {e}")
            system.close()
            write_partial(result, args.out)
            continue
        try:
            for c in levels_wanted:
                if system.levels is not None and c not in system.levels:
                    continue
                reqs = requests[: per_level[c]]
                with tqdm(total=len(reqs), desc=f"{system.name} @ {c}", disable=args.no_progress, leave=False) as bar:
                    traces = system.run(reqs, c, bar.update, time.perf_counter() + args.level_seconds)
                row = summarize(system.name, c, traces).to_dict()
                errors = sorted({t.error for t in traces if t.error})
                if errors:
                    row["errors"] = errors[:5]
                result["levels"].append(row)
                write_partial(result, args.out)  # a run killed by its timeout keeps every level it finished
                print(
                    f"{system.name} @ {c}: {row['total_tps']:.1f} tok/s total, TTFT p50 {row['ttft_p50_ms']:.0f} ms,"
                    f" ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms, errors {row['num_errors']}"
                )
        finally:
            system.close()
        print(f"{system.name}: {time.perf_counter() - t0:.0f} s")

    if "floor" in result:
        for row in result["levels"]:
            if row["concurrency"] == 1 and row["itl_p50_ms"] == row["itl_p50_ms"]:
                result["floor"]["itl_over_floor"][row["system"]] = row["itl_p50_ms"] / result["floor"]["itl_floor_ms"]
    result["targets"] = evaluate_targets(result["levels"], result.get("floor"))
    return result


def write_partial(result: dict, out_dir: Path) -> None:
    """results.json as it stands (marked partial); the final write_all replaces it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    write_results(tmp, result | {"partial": True})
    tmp.replace(out_dir / "results.json")


def own_systems_failed(result: dict) -> list[str]:
    """Why the run must fail though it finished: an omnivox system that did not run (its server died while starting,
    say) is the failure a benchmark of omnivox exists to catch, not a peer to skip."""
    return [f"{name} skipped: {why}" for name, why in result["skipped"].items() if name.startswith("omnivox")]


def main(argv: list[str] | None = None) -> int:
    return run_and_report(build_parser().parse_args(argv))


def run_and_report(args: argparse.Namespace) -> int:
    """Run the benchmark, write its files, print the report; exit code 1 when any request failed or an omnivox
    system was skipped."""
    import torch

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        result = run(args)
    finally:  # --threads applies to this run only (it matters when called in-process, e.g. from tests)
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    paths = report.write_all(result, args.out)
    print()
    print(report.markdown_report(result))
    print(f"wrote {paths['json']}, {paths['markdown']}, {paths['png']}")
    failed = [r for r in result["levels"] if r["num_errors"]]
    own = own_systems_failed(result)
    for line in own:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed or own else 0


if __name__ == "__main__":
    sys.exit(main())
