"""Peers: llama.cpp through llama-cpp-python (optional extra `llamacpp`), on the same GGUF file.

- in-process: `Llama.generate` yields one token id per step (greedy; we stop after max_tokens, so EOS is ignored).
  One model object serves one request at a time, so it runs at concurrency 1 only.
- server: `python -m llama_cpp.server` (its OpenAI-compatible HTTP server), `/v1/completions` with `stream: true`,
  driven by closed-loop client threads like every other system; it serialises requests internally.
In-process gets the same prompt token ids as every other system (the chat template already applied); the server
takes text only, so it gets the templated text, which it tokenizes to the same ids (special tokens parsed).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from omnivox.benchmarks.metrics import RequestTrace
from omnivox.benchmarks.systems.base import Progress, SystemUnavailable, may_start, run_closed_loop
from omnivox.benchmarks.workload import BenchRequest

CONTEXT = 2048


def display_name(key: str) -> str:
    return "llama.cpp server" if key == "llamacpp-server" else "llama.cpp in-process"


def _require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise SystemUnavailable("llama-cpp-python is not installed (pip install 'omnivox[llamacpp]')") from None
    return llama_cpp


def _threads() -> int:
    """The same thread count as the torch systems: OMP_NUM_THREADS when set (omnivox bench --threads sets it)."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def _quant(path: str) -> str:
    """The GGUF's file type as llama.cpp names it (e.g. Q4_1), for the system's label."""
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        field = reader.fields.get("general.file_type")
        if field is not None:
            return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except Exception:  # the label is cosmetic; never fail the run for it
        pass
    return "gguf"


class LlamaCppInProcess:
    levels = (1,)

    def __init__(self, gguf_path: str) -> None:
        self.gguf_path = gguf_path
        self.name = f"{display_name('llamacpp')} ({_quant(gguf_path)})"
        self.llm = None

    def start(self) -> None:
        llama_cpp = _require_llama_cpp()
        self.llm = llama_cpp.Llama(
            model_path=self.gguf_path,
            n_ctx=CONTEXT,
            n_threads=_threads(),
            n_threads_batch=_threads(),  # its default is every core, whatever n_threads says
            verbose=False,
        )
        self._one(BenchRequest(index=-1, prompt_text="", prompt_token_ids=[1, 2, 3, 4], max_tokens=4))

    def _one(self, req: BenchRequest) -> RequestTrace:
        trace = RequestTrace(index=req.index, send_time=time.perf_counter(), prompt_tokens=len(req.prompt_token_ids))
        for _ in self.llm.generate(req.prompt_token_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            trace.add_tokens(1, time.perf_counter())
            if trace.num_tokens >= req.max_tokens:
                break
        return trace

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        traces = []
        for i, req in enumerate(requests):
            if not may_start(i, len(requests), 1, deadline):
                break
            traces.append(self._one(req))
            progress(1)
        return traces

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


class LlamaCppServer:
    levels = None

    def __init__(self, gguf_path: str, log_path: Path = Path("bench-results/llamacpp-server.log")) -> None:
        self.gguf_path = gguf_path
        self.name = f"{display_name('llamacpp-server')} ({_quant(gguf_path)})"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.eos: int | None = None

    def start(self) -> None:
        from omnivox.benchmarks.systems.omnivox_grpc import free_port

        llama_cpp = _require_llama_cpp()
        try:
            import llama_cpp.server  # noqa: F401 - the [server] extra
        except ImportError as e:
            raise SystemUnavailable(f"llama-cpp-python's server extra is not installed ({e})") from None
        del llama_cpp
        self.port = free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", self.gguf_path, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--n_ctx", str(CONTEXT)]
        cmd += ["--n_threads", str(_threads()), "--n_threads_batch", str(_threads())]
        cmd += ["--interrupt_requests", "False"]  # its default cancels the running request when another arrives
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise SystemUnavailable(
                    f"llama_cpp.server exited with code {self.proc.returncode} (see {self.log_path})"
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemUnavailable("llama_cpp.server did not answer within 120 s")
            time.sleep(0.5)
        warm = BenchRequest(index=-1, prompt_text="", prompt_token_ids=[], max_tokens=4, templated_text="warm up")
        trace = self._one(warm)
        if trace.error:
            raise SystemUnavailable(f"warm-up request failed: {trace.error}")

    def _one(self, req: BenchRequest) -> RequestTrace:
        body = {
            "prompt": req.templated_text,  # its server takes text only; it tokenizes with special tokens parsed
            "max_tokens": req.max_tokens,
            "min_tokens": req.max_tokens,  # ignore EOS: llama-cpp-python masks EOS until min_tokens
            "temperature": 0.0,
            "top_k": 1,
            "repeat_penalty": 1.0,
            "stream": True,
        }
        trace = RequestTrace(index=req.index, send_time=time.perf_counter(), prompt_tokens=len(req.prompt_token_ids))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                trace.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return trace
            finish = None
            for raw in resp:  # server-sent events: one `data: {...}` line per chunk (one token)
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                choice = chunk["choices"][0]
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                if choice.get("text") or not choice.get("finish_reason"):
                    trace.add_tokens(1, time.perf_counter())
            if trace.num_tokens != req.max_tokens:
                trace.error = f"asked for {req.max_tokens} tokens, counted {trace.num_tokens} chunks ({finish})"
        finally:
            conn.close()
        return trace

    def run(
        self, requests: list[BenchRequest], concurrency: int, progress: Progress, deadline: float = math.inf
    ) -> list[RequestTrace]:
        return run_closed_loop(requests, concurrency, self._one, progress, deadline)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self._log.close()
            self.proc = None
