"""`omnivox serve --tensor-parallel 2 --device cpu` in a child process: it answers Generate over real gRPC with the
tokens the same checkpoint gives in one process, exits 0 on SIGTERM with its worker gone; killed outright (SIGKILL),
its worker notices within seconds and exits too (no orphan). Bad sizes are refused before anything loads."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from support.checkpoints import make_checkpoint
from support.serve_process import ServeProcess
from support.service_harness import user_request

from omnivox.engine import Engine, SamplingParams
from omnivox.services.cli import serve as serve_cli
from omnivox.services.cli._common import CliError
from omnivox.services.processing.prompt import ChatPromptBuilder
from omnivox.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-serve") / "tiny", family="qwen2")


def children(pid: int) -> dict[int, str]:
    """Live (not zombie) child processes of pid: {pid: command line}."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out[int(entry.name)] = cmdline
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(checkpoint: Path) -> tuple[ServeProcess, str, list[int]]:
    serve = ServeProcess(
        "--model", str(checkpoint), "--tensor-parallel", "2", "--device", "cpu", "--kv-cache-gib", "0.005",
        "--threads", "1",
    )  # fmt: skip
    address = serve.wait_ready()
    workers = [pid for pid, cmd in children(serve.proc.pid).items() if "spawn_main" in cmd]
    assert len(workers) == 2 - 1, children(serve.proc.pid)  # rank 1 (the spawn's resource tracker is not a rank)
    return serve, address, workers


def generate(address: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        sampling = sampling_pb2.SamplingConfig(temperature=0)
        request = user_request("Hello there", max_output_tokens=12, ignore_eos=True, sampling=sampling)
        responses = list(stub.Generate(request, timeout=60))
    assert responses[-1].summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH, responses[-1]
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


@pytest.mark.slow
def test_serves_and_stops_on_sigterm(checkpoint: Path) -> None:
    serve, address, workers = start(checkpoint)
    try:
        tokens = generate(address)
        assert len(tokens) == 12
        assert generate(address) == tokens  # greedy: the same again, through the same two ranks
        os.kill(serve.proc.pid, signal.SIGTERM)
        assert serve.proc.wait(timeout=60) == 0, "".join(serve.log)
        assert not [w for w in workers if alive(w)], "".join(serve.log)
        assert "Traceback" not in "".join(serve.log)
    finally:
        serve.stop()
    # The tokens of one process, from the prompt the service builds.
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype="float32", kv_cache_gib=0.005)
    prompt = ChatPromptBuilder(engine.tokenizer).build(user_request("Hello there").contents)
    [out] = engine.generate([prompt.token_ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.token_ids == tokens


@pytest.mark.slow
def test_killed_server_leaves_no_worker(checkpoint: Path) -> None:
    serve, _, workers = start(checkpoint)
    try:
        serve.proc.kill()
        serve.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)]
    finally:
        serve.stop()
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)


def test_bad_sizes_refused(checkpoint: Path) -> None:
    """Refused by `serve` before the server (or the engine package) is imported (in-process here: the CLI's one-line
    rendering of a CliError is tested with the other flags)."""

    def args(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        serve_cli.register(parser.add_subparsers())
        return parser.parse_args(["serve", *argv])

    with pytest.raises(CliError, match=r"--tensor-parallel 3 does not divide the model's attention heads \(4\)"):
        serve_cli.check_tensor_parallel(args("--model", str(checkpoint), "--tensor-parallel", "3", "--device", "cpu"))
    with pytest.raises(CliError, match="--tensor-parallel serves exactly one --model"):
        serve_cli.check_tensor_parallel(
            args("--model", str(checkpoint), "--model", str(checkpoint), "--tensor-parallel", "2")
        )
    with pytest.raises(CliError, match="--tensor-parallel must be at least 1"):
        serve_cli.check_tensor_parallel(args("--model", str(checkpoint), "--tensor-parallel", "0"))
    serve_cli.check_tensor_parallel(args("--model", str(checkpoint), "--tensor-parallel", "2", "--device", "cpu"))
