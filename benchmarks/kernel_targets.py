"""The embedded default (Q4_1 GGUF) served in-process on each CPU kernel path, side by side in one run: the native
build, the AVX2 build (x86-64-v3) with its many-row kernel (block_kernels_avx2.c), and the AVX2 build without it (the
int16 kernels and float GEMM every AVX2 host ran before), the AVX2 build with a mixed-step budget (`avx2-budget`:
`serve --max-step-ms`'s, measured from the engine's own steps at load, engine/step_budget.py), transformers'
float32 generate (`hf`, the yardstick `omnivox bench` runs) and llama.cpp on the same GGUF (`llamacpp-server`, its
OpenAI server, and `llamacpp`, in-process at concurrency 1: `omnivox bench`'s peers, benchmarks/systems/llamacpp.py).
Rounds alternate the settings so that a shared machine's load falls on all of them; the figures are `omnivox bench`'s
(benchmarks/metrics.py), per level and round.

    python -m omnivox.benchmarks.kernel_targets [--concurrency 1,16] [--level-seconds 20] [--rounds 2]
        [--settings avx2,avx2-budget,hf,llamacpp-server,llamacpp] [--step-ms 300] [--out F]

To emulate an AVX2 host on a newer CPU, run it with MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 (torch's float GEMM and transformers on the AVX2 host's instructions too) and a
llama-cpp-python built for AVX2 only (GGML_NATIVE=OFF, no AVX-512): the results record those variables and
llama.cpp's own system info line (`llama_cpp_system_info`), which names the instruction sets it was built with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.main import default_model, git_commit
from omnivox.benchmarks.metrics import summarize
from omnivox.benchmarks.systems.hf_generate import HFGenerate
from omnivox.benchmarks.systems.hf_loading import load_tokenizer
from omnivox.benchmarks.systems.llamacpp import LlamaCppInProcess, LlamaCppServer
from omnivox.benchmarks.systems.omnivox_engine import OmnivoxEngineInProcess
from omnivox.benchmarks.workload import WorkloadSpec, make_workload
from omnivox.engine.step_budget import hold_step_ms
from omnivox.models import cpu_kernels, quant

# name -> (kernel target, whether the AVX2 many-row kernel serves Q4_1 layers from quant.AVX2_MIN_ROWS rows, whether
# the engine holds the --step-ms budget, `serve --activation-bits`: 16 the default, 8 llama.cpp's Q8_1 activations
# in the many-row kernel, +0.40 % perplexity on AVX2 in benchmarks/kernel_quality.py); "hf" is transformers' generate in float32 on torch's own kernels, the
# llama.cpp peers run the GGUF on llama.cpp's kernels (our kernel target does not touch them).
SETTINGS = {
    "native": ("native", True, False, 16),
    "avx2": ("x86-64-v3", True, False, 16),
    "avx2-before": ("x86-64-v3", False, False, 16),
    "avx2-budget": ("x86-64-v3", True, True, 16),
    "avx2-a8": ("x86-64-v3", True, False, 8),
    "hf": ("native", True, False, 16),
    "llamacpp-server": ("native", True, False, 16),
    "llamacpp": ("native", True, False, 16),
}
PEERS = ("hf", "llamacpp-server", "llamacpp")


def llama_cpp_system_info() -> str | None:
    """llama.cpp's own line of the instruction sets its build uses ("AVX2 = 1 | AVX512 = 0 | ..."), or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build(name: str, model: str, step_ms: float) -> tuple[object, dict]:
    """The setting's system, started; what it was given (the budget's tokens)."""
    if name in PEERS:
        system = {"hf": lambda: HFGenerate(model, torch.float32, "cpu"), "llamacpp-server": lambda: LlamaCppServer(model),
                  "llamacpp": lambda: LlamaCppInProcess(model)}[name]()  # fmt: skip
        system.start()
        return system, {}
    system = OmnivoxEngineInProcess(model, "float32", quantization="auto", activation_bits=SETTINGS[name][3])
    system.start()  # the fused decode table reads the routing at load
    if not SETTINGS[name][2]:
        return system, {}
    hold = hold_step_ms(system.engine, step_ms)
    system.hold = hold  # its budget moves with the measured mixed steps: recorded per level
    return system, {"step_ms": step_ms, "mixed_step_tokens_start": hold.budget.mixed_step_tokens}


def run(
    model: str, settings: list[str], levels: list[int], level_seconds: float, rounds: int, spec: WorkloadSpec,
    step_ms: float = 300.0,
):  # fmt: skip
    requests = make_workload(spec, load_tokenizer(model))
    avx2_q4 = quant.AVX2_MIN_ROWS["q4"]
    rows = []
    for round_index in range(rounds):
        for name in settings:
            target, avx2_rows, _, _ = SETTINGS[name]
            cpu_kernels.use_target(target)
            quant.AVX2_MIN_ROWS["q4"] = avx2_q4 if avx2_rows else None
            system, given = build(name, model, step_ms)
            try:
                for c in [c for c in levels if system.levels is None or c in system.levels]:
                    reqs = requests[: max(4, 2 * c)]
                    traces = system.run(reqs, c, lambda n: None, time.perf_counter() + level_seconds)
                    row = summarize(name, c, traces).to_dict() | {
                        "round": round_index,
                        "kernel_target": "llama.cpp" if name.startswith("llamacpp") else target,
                        **given,
                    }
                    if hasattr(system, "hold"):  # where the budget ended the level
                        row |= {
                            "mixed_step_tokens": system.hold.budget.mixed_step_tokens,
                            "step_scale": system.hold.scale,
                        }
                    rows.append(row)
                    print(
                        f"round {round_index} {name:12s} @ {c:3d}: {row['total_tps']:6.1f} tok/s, ITL p50 "
                        f"{row['itl_p50_ms']:6.1f} ms p99 {row['itl_p99_ms']:7.1f} ms, TTFT p50 {row['ttft_p50_ms']:7.0f} ms",
                        flush=True,
                    )
            finally:
                system.close()
    quant.AVX2_MIN_ROWS["q4"] = avx2_q4
    cpu_kernels.use_target("native")
    return rows


def _ratio(tps: float, at: dict, peer: str) -> str:
    return f"{tps / at[(peer, 16)]['total_tps']:.2f}x" if (peer, 16) in at else "-"


def targets_table(paths: list[Path]) -> str:
    """Issue 33's AVX2-host targets, one row per results file (round 0 of each), as two Markdown tables: the default
    build (`avx2`, 15-bit activations) and `avx2-a8`, each with and without the budget: total TPS at 16 against the
    llama.cpp server and transformers, ITL p99 and TTFT p50 at 16, batch-1 ITL p50 against llama.cpp in-process."""

    def level(at: dict, name: str, c: int, key: str, fmt: str) -> str:
        row = at.get((name, c))
        return "-" if row is None else fmt.format(row[key])

    out = []
    for base in ("avx2", "avx2-a8"):
        head = (f"| run | load 1 min | {base} TPS@16 | / llama.cpp server | / transformers | ITL p99@16 | TTFT p50@16 | "
                "with budget: ITL p99@16 | TTFT p50@16 | TPS@16 | ITL p50@1 | / llama.cpp in-process |")  # fmt: skip
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        for path in paths:
            result = json.loads(path.read_text())
            at = {(r["system"], r["concurrency"]): r for r in result["levels"] if r["round"] == 0}
            if (base, 16) not in at:
                continue
            tps = at[(base, 16)]["total_tps"]
            b = f"{base}-budget"
            one = at.get((base, 1), {}).get("itl_p50_ms")
            peer = at.get(("llamacpp", 1), {}).get("itl_p50_ms")
            cells = [
                path.stem.rsplit("-", 1)[-1], f"{result['load_average_before'][0]:.1f}", f"{tps:.1f}",
                _ratio(tps, at, "llamacpp-server"), _ratio(tps, at, "hf"), level(at, base, 16, "itl_p99_ms", "{:.0f} ms"),
                level(at, base, 16, "ttft_p50_ms", "{:.0f} ms"), level(at, b, 16, "itl_p99_ms", "{:.0f} ms"),
                level(at, b, 16, "ttft_p50_ms", "{:.0f} ms"), level(at, b, 16, "total_tps", "{:.1f}"),
                "-" if one is None else f"{one:.1f} ms", "-" if None in (one, peer) else f"{one / peer:.2f}x",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Q4_1 / Q8_0 GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"subset of {list(SETTINGS)}")
    ap.add_argument("--concurrency", type=_int_list, default=[1, 16])
    ap.add_argument("--level-seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-tokens", default="16,48", help="LOW,HIGH output tokens per request")
    ap.add_argument("--step-ms", type=float, default=300.0, help="avx2-budget's target step time (serve --max-step-ms)")
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded in the results file)")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--targets", nargs="+", type=Path, metavar="RESULTS", help="print the targets of these runs, run none"
    )
    args = ap.parse_args(argv)
    if args.targets:
        print(targets_table(args.targets))
        return 0
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # llama.cpp's n_threads and n_threads_batch read it
    low, high = _int_list(args.output_tokens)
    spec = WorkloadSpec(num_requests=max(4, 2 * max(args.concurrency)), output_tokens=(low, high))
    model = args.model or default_model()
    settings = [s for s in args.settings.split(",") if s]
    start = time.time()
    load_before = os.getloadavg()
    rows = run(model, settings, args.concurrency, args.level_seconds, args.rounds, spec, args.step_ms)
    result = {
        "model": Path(model).name,
        "commit": git_commit(),
        "threads": args.threads,
        "level_seconds": args.level_seconds,
        "settings": {name: SETTINGS[name] for name in settings},
        "wall_s": math.ceil(time.time() - start),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch_isa_env": {
            k: os.environ.get(k) for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        },
        "llama_cpp_system_info": llama_cpp_system_info() if any(s.startswith("llamacpp") for s in settings) else None,
        "note": "measured on a machine shared with other jobs (see the load averages): compare the settings, which "
        "alternate round by round, not the absolute numbers. " + args.note,
        "levels": rows,
    }
    if args.out:
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
