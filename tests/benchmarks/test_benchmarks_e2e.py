"""The benchmark end to end: a real omnivox server process and a transformers peer on a tiny random checkpoint, then
benchmarks/gpu.sh --dry-run (so that the GPU script cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.checkpoints import make_checkpoint
from support.paths import REPO_ROOT

from omnivox.benchmarks.main import main

ROOT = REPO_ROOT


@pytest.mark.timeout(240)
def test_dry_run_through_the_real_server_writes_json_markdown_and_png(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", family="llama")
    out = tmp_path / "results"
    code = main(
        [
            "--model", str(ckpt), "--concurrency", "1,3", "--min-requests", "3", "--requests-per-slot", "1",
            "--prompt-words", "3,9", "--output-tokens", "3,7", "--shared-prefix-words", "6", "--bandwidth-mib", "8",
            "--systems", "omnivox,omnivox-engine,hf,llamacpp-server", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    rows = {(r["system"], r["concurrency"]): r for r in result["levels"]}
    systems = ("omnivox", "omnivox engine (in-process)", "transformers generate (float32)")
    assert set(rows) == {(s, c) for s in systems for c in (1, 3)}
    expected_tokens = {1: None, 3: None}
    for (system, c), row in rows.items():
        assert row["num_errors"] == 0 and row["num_requests"] == 3, row
        assert row["total_tps"] > 0 and row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"]
        # ignore_eos: every system produced exactly the tokens the workload asked for.
        if expected_tokens[c] is None:
            expected_tokens[c] = row["output_tokens"]
        assert row["output_tokens"] == expected_tokens[c], (system, c)
    assert 3 * 3 <= expected_tokens[3] <= 3 * 7
    # omnivox reports its prefix cache; every prompt shares 6 words, so later requests hit it.
    assert rows[("omnivox", 3)]["prefix_cache_hit_rate"] > 0
    assert rows[("omnivox engine (in-process)", 3)]["prefix_cache_hit_rate"] > 0
    assert rows[("transformers generate (float32)", 3)]["prefix_cache_hit_rate"] is None
    # The llama.cpp peer has no GGUF for this checkpoint: reported as skipped, not dropped.
    assert "llama.cpp server" in result["skipped"]
    assert result["floor"]["weight_bytes"] > 0 and result["floor"]["bandwidth_gb_s"] > 0
    assert "omnivox" in result["floor"]["itl_over_floor"]
    assert result["floor"]["decode_tps_ceiling"] > result["floor"]["workload_tps_ceiling_no_cache"] > 0
    md = (out / "results.md").read_text()
    assert "| omnivox | 3 | 3 | 0 |" in md and "Skipped:" in md and "Targets:" in md
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_script_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "gpu"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()
    table = [line for line in last if line.startswith(("omnivox ", "transformers generate"))]
    assert len(table) == 4, proc.stdout  # omnivox and transformers at concurrency 1 and 2: the short table, last
    assert last[-1] == table[-1]
    result = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert all(r["num_errors"] == 0 for r in result["levels"])
