"""The benchmark's own arithmetic: metrics on known timestamps, the seeded workload, the bandwidth floor's byte count."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from support.checkpoints import make_tokenizer

from omnivox.benchmarks.bandwidth import kv_bytes_per_step, measure_bandwidth, measure_matmul, weight_bytes_per_step
from omnivox.benchmarks.main import evaluate_targets
from omnivox.benchmarks.metrics import RequestTrace, percentile, summarize
from omnivox.benchmarks.report import markdown_table
from omnivox.benchmarks.workload import WorkloadSpec, make_workload


def test_percentile_matches_numpy_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    import numpy as np

    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_metrics_on_known_timestamps():
    # Request 0: sent at 0, tokens at 1.0, 1.5, 2.0, 2.5 (TTFT 1.0, ITL 0.5 x3, per-user 3 tok / 1.5 s = 2 tok/s).
    # Request 1: sent at 0.5, tokens at 2.0, 2.1, 2.1 (one chunk of two: ITL 0.1 and 0), TTFT 1.5, per-user 2/0.1.
    a = RequestTrace(index=0, send_time=0.0, token_times=[1.0, 1.5, 2.0, 2.5], prompt_tokens=10, cached_tokens=0)
    b = RequestTrace(index=1, send_time=0.5, prompt_tokens=10, cached_tokens=8)
    b.add_tokens(1, 2.0)
    b.add_tokens(2, 2.1)
    failed = RequestTrace(index=2, send_time=0.0, error="UNAVAILABLE: draining")
    m = summarize("x", 2, [a, b, failed])
    assert (m.num_requests, m.num_errors, m.output_tokens) == (3, 1, 7)
    assert m.duration_s == pytest.approx(2.5)  # first send 0.0 .. last token 2.5
    assert m.total_tps == pytest.approx(7 / 2.5)
    assert m.ttft_p50_ms == pytest.approx(1250.0)
    assert m.ttft_p99_ms == pytest.approx(1000 * (1.0 + 0.5 * 0.99))
    itl = sorted([0.5, 0.5, 0.5, 0.1, 0.0])
    assert m.itl_p50_ms == pytest.approx(1000 * percentile(itl, 50))
    assert m.itl_p50_ms == pytest.approx(500.0)
    assert m.itl_p99_ms == pytest.approx(500.0)
    assert m.per_user_tps_mean == pytest.approx((2.0 + 20.0) / 2)
    assert m.latency_p50_s == pytest.approx((2.5 + 1.6) / 2)
    assert m.prefix_cache_hit_rate == pytest.approx(8 / 20)


def test_metrics_without_cache_figures_or_tokens():
    m = summarize("x", 1, [RequestTrace(index=0, send_time=0.0, token_times=[1.0])])
    assert m.prefix_cache_hit_rate is None  # the system does not report it: never shown as 0 %
    assert math.isnan(m.per_user_tps_mean)  # one token: no rate after the first
    empty = summarize("x", 1, [RequestTrace(index=0, send_time=0.0, error="boom")])
    assert empty.num_errors == 1 and empty.output_tokens == 0 and math.isnan(empty.total_tps)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path, 384)
    return transformers.AutoTokenizer.from_pretrained(path)


def test_workload_is_reproducible_and_within_ranges(tokenizer):
    spec = WorkloadSpec(num_requests=20, prompt_words=(3, 9), output_tokens=(5, 11), shared_prefix_words=4, seed=7)
    a, b = make_workload(spec, tokenizer), make_workload(spec, tokenizer)
    assert a == b and [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(5 <= r.max_tokens <= 11 for r in a)
    assert len({r.max_tokens for r in a}) > 1 and len({len(r.prompt_token_ids) for r in a}) > 1  # varied
    words = [r.prompt_text.split() for r in a]
    assert all(7 <= len(w) <= 13 for w in words)
    assert len({tuple(w[:4]) for w in words}) == 1  # the shared prefix
    # The ids are what a chat server feeds the model: the chat template applied to the text (the tiny tokenizer's
    # ChatML template, tests/support/checkpoints.py, written out here rather than rendered by the call the workload makes).
    templated = f"<|im_start|>user\n{a[0].prompt_text}<|im_end|>\n<|im_start|>assistant\n"
    assert a[0].templated_text == templated
    assert a[0].prompt_token_ids == tokenizer.encode(templated, add_special_tokens=False)
    other = make_workload(WorkloadSpec(**{**spec.__dict__, "seed": 8}), tokenizer)
    assert [r.prompt_text for r in other] != [r.prompt_text for r in a]


def test_workload_spec_names_the_bad_field():
    with pytest.raises(ValueError, match="output_tokens"):
        WorkloadSpec(output_tokens=(10, 5))
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadSpec(num_requests=0)


@pytest.mark.parametrize(
    "family,tied",
    [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)],
)
def test_weight_bytes_per_step_counts_every_weight_a_decode_step_reads(family, tied):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    config = cls[family](
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        **({"head_dim": 24} if family == "qwen3" else {}),
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    params = {n: p.numel() for n, p in model.named_parameters()}  # tied: the embedding appears once
    total = sum(params.values())
    # The embedding lookup reads one row, not the matrix: drop it unless it doubles as the lm_head (tied).
    expected = total if tied else total - params["model.embed_tokens.weight"]
    assert weight_bytes_per_step(config, 2) == 2 * expected
    head_dim = 24 if family == "qwen3" else 64 // 4
    assert kv_bytes_per_step(config, 10, 2) == 2 * 3 * 2 * head_dim * 10 * 2  # K and V, layers, kv heads, tokens


def test_bandwidth_measurement_is_a_positive_rate():
    bw = measure_bandwidth(torch.float32, matrix_mib=8, repeats=2)
    assert bw.matrix_bytes >= 8 * 2**20 - 4096 * 4 and bw.gb_per_s > 0.1
    mm = measure_matmul(torch.float32, size=128, repeats=2)
    assert mm.gflop_per_s > 0.01 and mm.seconds_per_pass > 0


def _row(system, c, tps, ttft, itl50, itl99):
    return {
        "system": system,
        "concurrency": c,
        "total_tps": tps,
        "ttft_p50_ms": ttft,
        "itl_p50_ms": itl50,
        "itl_p99_ms": itl99,
        "num_requests": 4,
        "num_errors": 0,
    }


def test_targets_report_ratios_and_misses():
    levels = [
        _row("omnivox", 1, 20, 100, 12.0, 20),
        _row("omnivox", 16, 400, 250, 30, 90),
        _row("omnivox", 64, 900, 900, 60, 300),
        _row("llama.cpp server (Q4_1)", 64, 80, 1, 1, 1),
        _row("transformers generate (float32)", 64, 200, 1, 1, 1),
    ]
    by = {t["target"]: t for t in evaluate_targets(levels, {"itl_floor_ms": 10.0})}
    assert by["batch-1 ITL p50 / bandwidth floor <= 1.3"]["value"] == pytest.approx(1.2)
    assert by["batch-1 ITL p50 / bandwidth floor <= 1.3"]["verdict"].startswith("met")
    assert by["total TPS at 64 / llama.cpp server >= 10"]["verdict"].startswith("met")  # 11.25x
    assert by["total TPS at 64 / transformers static batch >= 3"]["verdict"].startswith("met")  # 4.5x
    assert by["p99 ITL at 64 < 250 ms"]["verdict"].startswith("missed: 300.00 ms")
    assert by["TTFT p50 at 16 / TTFT p50 at 1 < 3"]["value"] == pytest.approx(2.5)
    table = markdown_table(levels)
    assert table.count("\n") == len(levels) + 1 and "| omnivox | 64 |" in table


def test_closed_loop_keeps_concurrency_and_stops_at_the_deadline():
    import threading
    import time

    from omnivox.benchmarks.systems.base import run_closed_loop
    from omnivox.benchmarks.workload import BenchRequest

    requests = [BenchRequest(index=i, prompt_text="", prompt_token_ids=[1], max_tokens=1) for i in range(40)]
    lock, active, peak = threading.Lock(), [0], [0]

    def one(req):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        t = time.perf_counter()
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return RequestTrace(index=req.index, send_time=t, token_times=[time.perf_counter()])

    done = []
    traces = run_closed_loop(requests, 3, one, done.append)
    assert [t.index for t in traces] == list(range(40)) and sum(done) == 40 and peak[0] == 3
    traces = run_closed_loop(requests, 3, one, done.append, deadline=time.perf_counter() + 0.05)
    assert 3 <= len(traces) < 40  # the first wave always goes; nothing starts after the deadline
    assert [t.index for t in traces] == list(range(len(traces)))
