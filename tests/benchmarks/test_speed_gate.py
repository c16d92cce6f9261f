"""The CI speed gate (benchmarks/speed_gate.py): the embedded default's tokens/s as ratios to transformers float32 in
the same run, at batch 1 and 8 concurrent, held to the committed baseline of this host's class within its measured
noise band. The one measuring test takes tens of seconds (both models load, best of 3 runs each)."""

from __future__ import annotations

import json

import pytest

from omnivox.benchmarks.cpu_flags import cpu_flags
from omnivox.benchmarks.speed_gate import BASELINES, FLOOR, host_class, run_gate, verdicts

BASE = {"host_classes": {"avx512_vnni": {"ratios": {"batch1": 6.0, "batch8": 3.0}, "band": 0.4}}}


def test_verdicts_hold_ratios_to_the_class_baseline_within_its_band():
    got = verdicts({"batch1": 3.7, "batch8": 1.7}, BASE, "avx512_vnni")
    assert [(v["ratio"], round(v["limit"], 6), v["ok"]) for v in got] == [("batch1", 3.6, True), ("batch8", 1.8, False)]


def test_a_class_without_a_baseline_is_held_to_the_floor():
    got = verdicts({"batch1": 2.5, "batch8": 0.9}, BASE, "avx2")
    assert [(v["limit"], v["ok"]) for v in got] == [(FLOOR["batch1"], True), (FLOOR["batch8"], False)]
    assert host_class(["avx", "avx2", "fma"]) == "avx2" and host_class(["avx2", "avx512_vnni"]) == "avx512_vnni"


def test_committed_baselines_record_the_band_and_the_cpu():
    entries = json.loads(BASELINES.read_text())["host_classes"]
    assert entries, "no baseline committed"
    for klass, entry in entries.items():
        assert set(entry["ratios"]) == set(FLOOR) and 0.3 <= entry["band"] < 1
        assert host_class(entry["cpu"]["flags"]) == klass and len(entry["runs"]) >= 3


@pytest.mark.slow
def test_speed_gate(default_gguf, tmp_path):
    result = run_gate(default_gguf, tmp_path / "speed-gate.json")
    saved = json.loads((tmp_path / "speed-gate.json").read_text())
    assert saved["cpu"] == cpu_flags() and saved["host_class"] == host_class(cpu_flags()["flags"])
    failed = [v for v in result["verdicts"] if not v["ok"]]
    report = "; ".join(f"{v['ratio']} {v['value']:.2f}x < {v['limit']:.2f}x ({v['against']})" for v in failed)
    assert not failed, f"speed regressed: {report}; tokens/s {result['tokens_per_s']}"
