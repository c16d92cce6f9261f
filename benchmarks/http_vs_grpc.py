"""The same short chat over the OpenAI-compatible HTTP front and over gRPC Generate, side by side in one run, against
one server process (`omnivox serve --http-port`, the embedded SmolLM2-135M): TTFT p50 and total TPS (a throughput) at
each concurrency, and HTTP's ratio to gRPC (target: within 10 %).

    python -m omnivox.benchmarks.http_vs_grpc --out benchmarks/results/http-vs-grpc-cpu.json

Workload: one user turn ("What is the capital of France?"), greedy, `ignore_eos`, `--output-tokens` tokens; closed loop
of `concurrency` clients on persistent connections (one grpc.aio channel; httpx keep-alive). At concurrency 1 the
fronts take turns request by request; above, level by level, the first front alternating by round; `--rounds` times,
so a load change on a shared machine falls on both. HTTP is streamed (SSE, `stream_options.include_usage`) by two
clients on keep-alive connections: `http`, a lean asyncio HTTP/1.1 client (benchmarks/sse_client.py: about the
work grpc.aio's C-core client does, so the fronts are compared, not the clients' libraries; the ratios are its) and
`httpx` (what a Python SDK user sees; it adds 4-5 ms of its own to the first token at concurrency 1). TTFT is the
first content chunk, tokens the usage's completion tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.metrics import RequestTrace, summarize
from omnivox.benchmarks.sse_client import SseClient
from omnivox.benchmarks.systems.base import run_closed_loop_async
from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess
from omnivox.benchmarks.workload import BenchRequest

QUESTION = "What is the capital of France?"
FRONTS = ("grpc", "http", "httpx")  # httpx: the HTTP front again, through httpx


def http_port_of(log_path: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := re.search(r"OpenAI-compatible HTTP on https?://\S+:(\d+)/v1", log_path.read_text(errors="replace")):
            return int(match.group(1))
        time.sleep(0.05)
    raise RuntimeError(f"the server reported no HTTP port (see {log_path})")


def chat_body(req: BenchRequest) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": req.prompt_text}], "temperature": 0.0,
            "max_tokens": req.max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def add_chunk(trace: RequestTrace, data: str) -> None:
    """One SSE event's data into the trace: a content chunk is a token, the usage chunk the counts."""
    if data == "[DONE]":
        return
    chunk, now = json.loads(data), time.perf_counter()
    if chunk.get("usage"):
        usage = chunk["usage"]
        trace.prompt_tokens = usage["prompt_tokens"]
        trace.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        missing = usage["completion_tokens"] - trace.num_tokens  # chunks that held several tokens
        if missing > 0:
            trace.add_tokens(missing, trace.token_times[-1] if trace.token_times else now)
    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
        trace.add_tokens(1, now)


def _checked(trace: RequestTrace, req: BenchRequest) -> RequestTrace:
    if trace.error is None and trace.num_tokens != req.max_tokens:
        trace.error = f"asked for {req.max_tokens} tokens (ignore_eos), got {trace.num_tokens}"
    return trace


def http_client(sse: SseClient) -> Callable[[BenchRequest], Awaitable[RequestTrace]]:
    """One streamed chat over the lean client (benchmarks/sse_client.py): a trace per request."""

    async def one(req: BenchRequest) -> RequestTrace:
        trace = RequestTrace(index=req.index, send_time=time.perf_counter())
        async for status, data in sse.events("/v1/chat/completions", chat_body(req)):
            if status != 200:
                trace.error = f"HTTP {status}: {data[:200]!r}"
                return trace
            add_chunk(trace, data)
        return _checked(trace, req)

    return one


def httpx_client(http: Any) -> Callable[[BenchRequest], Awaitable[RequestTrace]]:
    """One streamed chat over `http` (an httpx.AsyncClient with keep-alive): a trace per request."""

    async def one(req: BenchRequest) -> RequestTrace:
        trace = RequestTrace(index=req.index, send_time=time.perf_counter())
        async with http.stream("POST", "/v1/chat/completions", json=chat_body(req)) as response:
            if response.status_code != 200:
                trace.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return trace
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    add_chunk(trace, line[6:])
        return _checked(trace, req)

    return one


def grpc_client(stub: Any) -> Callable[[BenchRequest], Awaitable[RequestTrace]]:
    """One Generate over `stub` (one grpc.aio channel): a trace per request, tokens counted from the deltas' ids."""
    from omnivox.v1 import content_pb2, generation_pb2, sampling_pb2

    async def one(req: BenchRequest) -> RequestTrace:
        message = generation_pb2.GenerateRequest(
            contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text=req.prompt_text)])],
            sampling=sampling_pb2.SamplingConfig(temperature=0.0), max_output_tokens=req.max_tokens, ignore_eos=True,
        )  # fmt: skip
        trace = RequestTrace(index=req.index, send_time=time.perf_counter())
        async for response in stub.Generate(message):
            now, kind = time.perf_counter(), response.WhichOneof("response")
            if kind == "delta" and response.delta.token_ids:
                trace.add_tokens(len(response.delta.token_ids), now)
            elif kind == "summary":
                trace.prompt_tokens = response.summary.usage.prompt_tokens
                trace.cached_tokens = response.summary.usage.cached_prompt_tokens
        return trace

    return one


async def measure(address: str, base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every level of every round, both fronts on persistent connections. At concurrency 1 the fronts take turns
    request by request (a load change on the shared machine falls on both); above, level by level, the first front
    alternating by round."""
    import grpc
    import httpx

    from omnivox.v1 import generation_pb2_grpc

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    most = max(concurrencies)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    levels: list[dict[str, Any]] = []
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sse = SseClient(host, int(port), most)
    async with (
        grpc.aio.insecure_channel(address) as channel,
        httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http,
    ):
        clients = {"grpc": grpc_client(generation_pb2_grpc.GenerationServiceStub(channel)), "http": http_client(sse),
                   "httpx": httpx_client(http)}  # fmt: skip
        for one in clients.values():  # warm up: a connection, the prompt in the prefix cache
            await one(BenchRequest(index=-1, prompt_text=QUESTION, prompt_token_ids=[], max_tokens=4))
        for round_ in range(args.rounds):
            order = list(FRONTS) if round_ % 2 == 0 else list(reversed(FRONTS))
            for c in concurrencies:
                requests = workload(max(args.min_requests, c * args.requests_per_client), args.output_tokens)
                traces: dict[str, list[RequestTrace]] = {front: [] for front in FRONTS}
                if c == 1:
                    for req in requests:
                        for front in order:
                            traces[front].append(await clients[front](req))
                else:
                    for front in order:
                        traces[front] = await run_closed_loop_async(requests, c, clients[front], lambda n: None)
                for front in FRONTS:
                    levels.append(level(front, c, round_, traces[front]))
                print(json.dumps(levels[-len(FRONTS) :]), file=sys.stderr)
    await sse.close()
    return levels


def workload(n: int, output_tokens: int) -> list[BenchRequest]:
    return [
        BenchRequest(index=i, prompt_text=QUESTION, prompt_token_ids=[], max_tokens=output_tokens) for i in range(n)
    ]


def level(front: str, concurrency: int, round_: int, traces: list[RequestTrace]) -> dict[str, Any]:
    m = summarize(front, concurrency, traces)
    return {"front": front, "concurrency": concurrency, "round": round_, "requests": m.num_requests,
            "errors": m.num_errors, "ttft_p50_ms": m.ttft_p50_ms, "total_tps": m.total_tps,
            "itl_p50_ms": m.itl_p50_ms}  # fmt: skip


def ratios(levels: list[dict[str, Any]], concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per concurrency: the median over rounds of each front's TTFT p50 and total TPS, and HTTP / gRPC (the lean
    client's; httpx's as httpx_*_ratio)."""
    import statistics

    out = []
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        for front in FRONTS:
            mine = [lv for lv in levels if lv["front"] == front and lv["concurrency"] == c]
            row[f"{front}_ttft_p50_ms"] = statistics.median(lv["ttft_p50_ms"] for lv in mine)
            row[f"{front}_total_tps"] = statistics.median(lv["total_tps"] for lv in mine)
            row[f"{front}_ttft_p50_ms_per_round"] = [round(lv["ttft_p50_ms"], 2) for lv in mine]
        row["ttft_ratio"] = row["http_ttft_p50_ms"] / row["grpc_ttft_p50_ms"]
        row["tps_ratio"] = row["http_total_tps"] / row["grpc_total_tps"]
        row["httpx_ttft_ratio"] = row["httpx_ttft_p50_ms"] / row["grpc_ttft_p50_ms"]
        row["httpx_tps_ratio"] = row["httpx_total_tps"] / row["grpc_total_tps"]
        out.append(row)
    return out


def server_ttfts(log_path: Path) -> dict[str, dict[str, float]]:
    """The server's own time to first token per front (its request log lines: from the call's start, after the HTTP
    request or the gRPC call was read), over the whole run: where the fronts' difference arises."""
    import statistics

    seen: dict[str, list[float]] = {"grpc": [], "http": []}
    for line in log_path.read_text(errors="replace").splitlines():
        if "omnivox.requests: " in line:
            record = json.loads(line.split("omnivox.requests: ", 1)[1])
            if record.get("ttft_s") is not None and record.get("output_tokens", 0) > 4:  # not the warm-ups
                seen["grpc" if record["event"] == "rpc" else "http"].append(1e3 * record["ttft_s"])
    return {front: {"requests": len(v), "p50_ms": statistics.median(v), "p90_ms": statistics.quantiles(v, n=10)[-1]}
            for front, v in seen.items() if len(v) > 1}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/http-vs-grpc.json"))
    p.add_argument("--note", default="", help="what else ran on the machine (recorded in the results file)")
    args = p.parse_args(argv)
    from omnivox.benchmarks.main import git_commit
    from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME, ensure_default_model

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), list(os.getloadavg())
    log_path = Path("bench-results") / f"{args.out.stem}.server.log"
    server = ServerProcess(ensure_default_model(), ["--name", DEFAULT_MODEL_NAME, "--http-port", "0",
                                                    "--threads", str(args.threads)], log_path)  # fmt: skip
    try:
        levels = asyncio.run(measure(server.address, f"http://127.0.0.1:{http_port_of(log_path)}", args))
    finally:
        server.close()
    result = {"benchmark": "http_vs_grpc", "started": started, "commit": git_commit(), "load_average_at_start": load,
              "model": DEFAULT_MODEL_NAME, "threads": args.threads, "output_tokens": args.output_tokens,
              "levels": levels, "ratios": ratios(levels, concurrencies), "server_ttft": server_ttfts(log_path),
              "load_average_at_end": list(os.getloadavg()),
              "note": args.note}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result)
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
