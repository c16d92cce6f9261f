"""`omnivox bench --workload images` end to end on a tiny Qwen2.5-VL checkpoint: a server child process, image
questions of two sizes while text streams decode, and the JSON the BENCHMARKS.md section quotes."""

from __future__ import annotations

import json

from support.vision_checkpoints import make_qwen2_5_vl

from omnivox.services.cli import main


def test_bench_images_workload_writes_its_json(tmp_path):
    model = make_qwen2_5_vl(tmp_path / "qwen-vl")
    argv = ["bench", "--workload", "images", "--model", str(model), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    result = json.loads((tmp_path / "out" / "images.json").read_text())
    assert {"started", "commit", "load_average_at_start", "command"} <= result.keys()
    assert set(result["encoder_s"]) == {"224", "224_tokens", "336", "336_tokens", "448", "448_tokens"}
    assert result["itl_alone_ms"]["n"] > 100 and result["itl_with_images_ms"]["p99"] > 0
    assert result["image_requests"] >= 1
    assert all(t > 0 for ts in result["image_ttft_ms"].values() for t in ts)
