"""A benchmark run's results as JSON, a Markdown table and a PNG plot."""

from __future__ import annotations

import math
from pathlib import Path

from omnivox.benchmarks.host import write_results

COLUMNS = [  # (header, key, format)
    ("system", "system", "{}"),
    ("conc.", "concurrency", "{}"),
    ("reqs", "num_requests", "{}"),
    ("err", "num_errors", "{}"),
    ("total TPS", "total_tps", "{:.1f}"),
    ("per-user TPS (mean)", "per_user_tps_mean", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("latency p50 s", "latency_p50_s", "{:.2f}"),
    ("latency p99 s", "latency_p99_s", "{:.2f}"),
    ("prefix hit", "prefix_cache_hit_rate", "{:.0%}"),
]


def _cell(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def markdown_table(levels: list[dict]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    for row in levels:
        lines.append("| " + " | ".join(_cell(fmt, row.get(key)) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def markdown_report(result: dict) -> str:
    out = [f"# Benchmark {result['started']}", ""]
    quant = result.get("quantization", "none")
    weights = result["dtype"] if quant == "none" else f"{result['dtype']} activations, weights {quant}"
    if result.get("activation_bits", 16) != 16:
        weights += f", {result['activation_bits']}-bit activations in the quantised kernels"
    out.append(f"Model: `{result['model']}` ({weights}); machine: {result['machine']}.")
    if result.get("commit"):
        out.append(f"omnivox commit: {result['commit']}.")
    if result.get("load_average_at_start"):
        load = result["load_average_at_start"]
        out.append(f"Load average at start (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.")
    w = result["workload"]
    out.append(
        f"Workload: seed {result['spec']['seed']}, prompts {w['prompt_tokens']['min']}–{w['prompt_tokens']['max']} tokens"
        f" (mean {w['prompt_tokens']['mean']:.0f}), outputs {w['output_tokens']['min']}–{w['output_tokens']['max']}"
        f" tokens (ignore_eos), greedy; requests per level: up to {result['requests_per_level']}"
        f" (no new request after {result.get('level_seconds', float('inf')):.0f} s in a level; `reqs` = sent)."
    )
    out += ["", markdown_table(result["levels"]), ""]
    if result.get("floor"):
        f = result["floor"]
        out.append(
            f"Floor: {f['weight_bytes'] / 1e6:.0f} MB of weights per decode step / {f['bandwidth_gb_s']:.1f} GB/s "
            f"measured = {f['itl_floor_ms']:.1f} ms batch-1 ITL."
        )
        if "decode_tps_ceiling" in f:
            out.append(
                f"Compute roof: {result['matmul']['gflop_per_s']:.0f} GFLOP/s measured ({result['matmul']['dtype']} matmul)"
                f" caps total TPS at {f['decode_tps_ceiling']:.0f} tok/s for pure decode, and at"
                f" {f['workload_tps_ceiling_no_cache']:.0f} tok/s for this workload's prefill + decode (no prefix cache)."
            )
        for name, ratio in f.get("itl_over_floor", {}).items():
            out.append(f"- {name}: batch-1 ITL p50 = {ratio:.2f}x the floor")
        out.append("")
    if result.get("skipped"):
        out.append("Skipped:")
        out += [f"- {name}: {why}" for name, why in result["skipped"].items()]
        out.append("")
    if result.get("targets"):
        out.append("Targets:")
        out += [f"- {t['target']}: {t['verdict']}" for t in result["targets"]]
        out.append("")
    return "\n".join(out)


def plot(levels: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems: dict[str, list[dict]] = {}
    for row in levels:
        systems.setdefault(row["system"], []).append(row)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for name, rows in systems.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in rows]
        ax1.plot(x, [r["total_tps"] for r in rows], marker="o", label=name)
        ax2.plot(x, [r["itl_p99_ms"] for r in rows], marker="o", label=name)
    ticks = sorted({r["concurrency"] for r in levels})
    for ax, ylabel in ((ax1, "total TPS (tokens/s, all users)"), (ax2, "p99 ITL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def write_all(result: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "png": out_dir / "results.png"}
    write_results(paths["json"], result)
    paths["markdown"].write_text(markdown_report(result) + "\n")
    plot(result["levels"], paths["png"], f"{Path(result['model']).name} ({result['dtype']}), {result['machine']}")
    return paths
