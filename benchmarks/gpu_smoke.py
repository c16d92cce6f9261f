"""Stage 1 of benchmarks/gpu_check.sh: the first CUDA load of a tiny Llama with Llama 3 rope scaling, and what the
CUDA path chose (decode attention, graph buckets, KV size), checked against the CPU engine.

    python -m omnivox.benchmarks.gpu_smoke --out smoke.json [--device cuda]

Every check is recorded (ok, seconds, details or the error) and the JSON ({"host": the CPU's record, "device": what
ran it, "checks": [...]}, written by benchmarks/host.py write_results) is rewritten after each one, so a run cut
short keeps what it saw. Exit status 1 when any check failed. Runs on CPU too (--device cpu), which the tests use.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from omnivox.benchmarks.host import write_results

ROOT = Path(__file__).resolve().parents[1]
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPTS = [[1, 5, 9, 33, 17, 200, 45], [1, 7, 7, 7], list(range(3, 70)), list(range(10, 210))]


class Checks:
    def __init__(self, out: Path, device: str) -> None:
        self.out, self.device = out, device
        self.records: list[dict] = []

    def run(self, name: str, fn: Callable[[], dict]) -> dict | None:
        t0 = time.perf_counter()
        try:
            details = fn()
            rec = {"check": name, "ok": True, "seconds": round(time.perf_counter() - t0, 2), **details}
        except Exception as e:
            details = None
            rec = {"check": name, "ok": False, "seconds": round(time.perf_counter() - t0, 2), "error": repr(e)}
            rec["traceback"] = traceback.format_exc()[-3000:]
        self.records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        write_results(self.out, {"device": self.device, "checks": self.records})
        return details


def _tokens_and_logprobs(engine, max_tokens: int = 24):
    from omnivox.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = engine.generate(PROMPTS, params)
    return [o.token_ids for o in outs], [[s.top for s in o.logprobs] for o in outs]


def _compare(ref, got) -> dict:
    """Exact token agreement, first divergence, and (up to it) the largest top-5 logprob difference."""
    (rt, rl), (gt, gl) = ref, got
    same = [a == b for a, b in zip(rt, gt, strict=True)]
    worst = 0.0
    first_diff = []
    for a, b, la, lb in zip(rt, gt, rl, gl, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        first_diff.append(n)
        for sa, sb in zip(la[:n], lb[:n], strict=True):
            worst = max(worst, max(abs(x[1] - y[1]) for x, y in zip(sa, sb, strict=True)))
    # Half precision: each side's token within the other's top 5 at the first divergence (the vLLM criterion).
    near_tie = all(
        n == len(a) or (b[n] in [t for t, _ in la[n]] and a[n] in [t for t, _ in lb[n]])
        for a, b, la, lb, n in zip(rt, gt, rl, gl, first_diff, strict=True)
    )
    return {
        "tokens_equal": all(same),
        "first_divergence": first_diff,
        "max_top5_logprob_diff": worst,
        "top5_at_divergence": near_tie,
    }


def _describe(engine) -> dict:
    runner = engine.runner
    k = runner.kv_caches[0][0]
    kv_bytes = 2 * len(runner.kv_caches) * k.numel() * k.element_size()
    static = runner.static
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "decode_attention": runner.describe_decode_attention(),
        "kv_cache_gib": round(kv_bytes / 2**30, 3),
        "kv_blocks": len(engine.pool.blocks),
        "graph_buckets": len(static.built) if static is not None else 0,
        "cuda_graphs": bool(static is not None and static.use_graphs),
        # torch.compile so far in this process (the flex decode kernel: one graph per model shape); a count that
        # grows from one check to the next on the same engine means recompiles while serving.
        "dynamo_unique_graphs": _dynamo_graphs(),
    }


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from support.checkpoints import make_checkpoint

    from omnivox.engine import Engine, SamplingParams
    from omnivox.engine.loading import build_model
    from omnivox.models.checkpoint import load_hf_config
    from omnivox.models.config import ModelConfig

    dev_name = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda") and torch.cuda.is_available()
        else args.device
    )
    checks = Checks(args.out, dev_name)
    work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    ckpt = make_checkpoint(work / "llama3", "llama", rope_parameters=LLAMA3, max_position_embeddings=1024)
    dev = torch.device(args.device)
    checks.run("environment", lambda: {"torch": torch.__version__, "cuda": torch.cuda.is_available()})

    def meta_build() -> dict:
        model = build_model(ModelConfig.from_hf(load_hf_config(ckpt), None), torch.device("meta"), torch.bfloat16)
        return {"devices": sorted({t.device.type for t in [*model.parameters(), *model.buffers()]})}

    checks.run("meta build, llama3 rope", meta_build)
    reference: list = []

    def cpu_reference() -> dict:
        engine = Engine.from_pretrained(ckpt, device="cpu", dtype="float32", kv_cache_gib=0.05)
        reference.append(_tokens_and_logprobs(engine))
        return {"tokens": [len(t) for t in reference[0][0]]}

    checks.run("cpu float32 reference", cpu_reference)
    ref = reference[0] if reference else None
    engines: dict[str, Engine] = {}

    def load(name: str, **kw) -> Callable[[], dict]:
        def go() -> dict:
            t0 = time.perf_counter()
            engine = Engine.from_pretrained(ckpt, device=dev, **kw)
            load_s = time.perf_counter() - t0
            engines[name] = engine
            got = _tokens_and_logprobs(engine)
            details = {"load_seconds": round(load_s, 2), **_describe(engine)}
            if ref is not None:
                details |= _compare(ref, got)
            return details

        return go

    # The defaults on this device: static decode (CUDA graphs) with in-place flex decode attention.
    checks.run("load + generate, float32, defaults", load("fp32", dtype="float32", kv_cache_gib=0.05))

    def native() -> dict:
        engine = Engine.from_pretrained(ckpt, device=dev, dtype="float32", kv_cache_gib=0.05)
        engine.runner.set_decode_attention("native")
        engine.runner.prepare()
        details = _describe(engine)
        if ref is not None:
            details |= _compare(ref, _tokens_and_logprobs(engine))
        return details

    checks.run("float32, gathered SDPA decode (the fallback)", native)
    checks.run("float32, no static decode", load("dynamic", dtype="float32", kv_cache_gib=0.05, static_decode=False))
    # bf16 with the KV cache sized by the profiling step (kv_cache_gib unset): the serving configuration.
    checks.run("load + generate, bfloat16, KV sized after profiling", load("bf16", dtype="bfloat16"))

    def stream_on_engine_thread() -> dict:
        """16 concurrent streams through the background thread (set_device, replay off the loading thread)."""
        import asyncio

        engine = engines.get("bf16") or Engine.from_pretrained(ckpt, device=dev, dtype="bfloat16", kv_cache_gib=0.5)
        params = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=1)

        async def one(i: int) -> int:
            n = 0
            async for out in engine.stream(list(range(3, 3 + 5 * (i + 1))), params):
                n = len(out.token_ids) if out.finished else n
            return n

        async def all_of() -> list[int]:
            return await asyncio.gather(*(one(i) for i in range(16)))

        t0 = time.perf_counter()
        counts = asyncio.run(all_of())
        wall = time.perf_counter() - t0
        engine.shutdown()
        assert all(c == 48 for c in counts), counts
        return {"streams": 16, "tokens": sum(counts), "wall_s": round(wall, 2), "total_tps": sum(counts) / wall}

    checks.run("16 streams on the engine thread, bfloat16", stream_on_engine_thread)

    def step_times() -> dict:
        engine = engines.get("bf16")
        assert engine is not None, "no bf16 engine"
        res = {}
        for batch in (1, 16, 64):
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            engine.generate([[1, 2, 3]] * batch, params)  # warm
            t0 = time.perf_counter()
            engine.generate([[1, 2, 3 + i] for i in range(batch)], params)
            res[f"ms_per_step_batch_{batch}"] = round(1e3 * (time.perf_counter() - t0) / 64, 3)
        res["static_runs"] = engine.runner.static.num_runs if engine.runner.static is not None else 0
        res["dynamo_unique_graphs"] = _dynamo_graphs()  # as after the load: no recompile while serving
        return res

    checks.run("decode step time, tiny model (launch-bound)", step_times)

    def prefill_new_shapes() -> dict:
        """Time to first token over 12 prompt lengths never seen before, with SDPA's default choice and with cuDNN
        left out (cuDNN builds a plan per new shape: the issue predicts TTFT spikes)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from omnivox.models.attention import sdpa_backend_name

        engine = engines.get("bf16")
        assert engine is not None, "no bf16 engine"
        cfg = engine.model_config
        q = torch.zeros(1, cfg.num_heads, 300, cfg.head_dim, dtype=engine.dtype, device=engine.device)
        k = torch.zeros(1, cfg.num_kv_heads, 300, cfg.head_dim, dtype=engine.dtype, device=engine.device)
        res: dict = {"sdpa_backend_prefill_300": sdpa_backend_name(q, k, k, None)}
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        for label, offset, ctx in (("default", 0, None), ("no_cudnn", 1, no_cudnn)):
            times = []
            for i, n in enumerate(range(37 + offset, 900, 71)):  # distinct lengths per run: every shape is new
                prompt = [(7 * offset + 5 + 3 * i + j) % (cfg.vocab_size - 10) + 5 for j in range(n)]  # no prefix hits
                t0 = time.perf_counter()
                if ctx is None:
                    engine.generate([prompt], params)
                else:
                    with sdpa_kernel(ctx):
                        engine.generate([prompt], params)
                times.append(round(1e3 * (time.perf_counter() - t0), 2))
            res[f"ttft_ms_{label}"] = times
        return res

    checks.run("prefill over new shapes: SDPA default vs cuDNN left out", prefill_new_shapes)
    failed = [r["check"] for r in checks.records if not r["ok"]]
    print(f"gpu_smoke: {len(checks.records) - len(failed)} ok, {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
