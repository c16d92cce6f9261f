"""benchmarks/gpu.sh fails loudly: a server that cannot start, or a budget spent, is a failed run, not a skipped row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

from omnivox.benchmarks.main import own_systems_failed, write_partial

ROOT = REPO_ROOT


def _gpu_sh(out: Path, *args: str, budget_s: int = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "BUDGET_S": str(budget_s)}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=budget_s + 60,
    )


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_dry_run_fails_when_the_omnivox_server_cannot_start(tmp_path):
    # `serve --dtype bogus` exits at once with an argparse error: the benchmark used to record omnivox as skipped and
    # gpu.sh exited 0 with a table of peers only. The checkpoint gpu.sh would build is made here, in this process (its
    # own interpreter's start and imports: ~5 s); gpu.sh's build step runs in test_benchmarks_e2e's dry run.
    import torch

    from omnivox.benchmarks.make_random_checkpoint import make_random_checkpoint

    make_random_checkpoint(tmp_path / "gpu" / "checkpoint", "tiny", torch.float32)
    proc = _gpu_sh(tmp_path / "gpu", "--", "--systems", "omnivox", "--server-arg=--dtype=bogus")
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "FAILED: omnivox skipped" in proc.stderr, proc.stderr[-2000:]
    assert "exited with code" in proc.stderr
    result = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert "omnivox" in result["skipped"] and not result["levels"]


@pytest.mark.timeout(60)
def test_budget_spent_before_the_benchmark_fails(tmp_path):
    proc = _gpu_sh(tmp_path / "gpu", budget_s=0)
    assert proc.returncode != 0
    assert "budget" in proc.stderr


def test_partial_results_and_own_system_verdict(tmp_path):
    result = {"levels": [{"system": "hf", "concurrency": 1}], "skipped": {"llama.cpp server": "no GGUF"}}
    write_partial(result, tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written.pop("host")["cpu_flags"]  # every results file records the CPU it ran on (benchmarks/host.py)
    assert written == result | {"partial": True}
    assert own_systems_failed(result) == []  # a peer missing here is fine
    result["skipped"]["omnivox engine (in-process)"] = "boom"
    assert own_systems_failed(result) == ["omnivox engine (in-process) skipped: boom"]


@pytest.mark.timeout(120)
def test_gpu_smoke_runs_on_cpu(tmp_path):
    """Stage 1 of benchmarks/gpu_check.sh, on the CPU: every check passes and the JSON holds each one."""
    from omnivox.benchmarks.gpu_smoke import main as smoke

    out = tmp_path / "smoke.json"
    assert smoke(["--device", "cpu", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["host"]["cpu_flags"] and written["device"] == "cpu"  # the host record, as every results file
    records = {r["check"]: r for r in written["checks"]}
    assert all(r["ok"] for r in records.values()), records
    assert records["meta build, llama3 rope"]["devices"] == ["meta"]
    assert records["load + generate, float32, defaults"]["tokens_equal"]
    assert records["16 streams on the engine thread, bfloat16"]["tokens"] == 16 * 48


def test_gpu_check_script_parses_and_names_its_stages():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for needle in ("gpu_smoke", "OMNIVOX_TEST_DEVICE=cuda", "benchmarks/gpu.sh", "step failed"):
        assert needle in text


def _gpu_check(out: Path, python: str, stages: str = "1 2 3 4") -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": python, "STAGES": stages}
    script = ROOT / "benchmarks" / "gpu_check.sh"
    return subprocess.run(["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_gpu_check_dry_run_and_every_named_test_exists(tmp_path):
    """The prepared GPU call's plumbing on the CPU: the link-farm environment imports, gpu_smoke imports, stage 3's
    tests collect, gpu.sh parses, and every test file the script names exists (a renamed test would otherwise cost a
    GPU run). Stage 2 is left out here only to save its ~15 s of imports; `--dry-run` runs it too."""
    import re

    named = set(re.findall(r"tests/[\w/]*test_\w+\.py", (ROOT / "benchmarks" / "gpu_check.sh").read_text()))
    assert len(named) >= 10 and all((ROOT / t).is_file() for t in named), sorted(named)
    proc = _gpu_check(tmp_path, sys.executable, stages="1 3 4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    for stage in ("1 llama3-rope", "3 parity+twin", "4 gpu.sh"):
        assert any(line.startswith(stage) and "rc=0" in line for line in lines), lines
    assert sum(" collected in " in line for line in lines) == 1 and lines[-1] == "all stages passed"


@pytest.mark.timeout(120)
def test_gpu_check_fails_loudly(tmp_path):
    # A python without our packages: the run stops at the environment, naming what is missing.
    proc = _gpu_check(tmp_path / "env", "false")
    assert proc.returncode == 1 and "environment broken" in proc.stdout and "FAILED: environment" in proc.stdout
    # A stage that fails (here: pytest exits 3) makes the whole call fail, named on the last line. The stand-in
    # answers the environment check itself (the real imports, ~6 s, pass in the dry-run test above).
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *pytest*) exit 3;; esac\necho "environment: a stand-in"\n')
    fake.chmod(0o755)
    proc = _gpu_check(tmp_path / "stage", str(fake), stages="2")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "FAILED: 2 service+speech tests (cuda) (rc=3)"
