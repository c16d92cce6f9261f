"""The `omnivox` command, run as a user runs it: separate processes talking over localhost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.checkpoints import make_checkpoint
from support.paths import REPO_ROOT
from support.serve_process import ServeProcess, assert_one_line_error, omnivox, wait_for_log
from support.service_harness import user_request

from omnivox.v1 import generation_pb2_grpc, sampling_pb2


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A localhost port held bound but not listening for the block's duration: connecting is refused, and no other
    process can take the port meanwhile (a port bound, closed and then reused could meet a real server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama")


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4096-token context: room for a stream that runs for many seconds, so that it is surely still running when a
    test signals the server."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-long", family="llama", max_position_embeddings=4096)


def in_flight_at_shutdown(log: list[str]) -> int:
    """The number of admitted requests the server counted when the drain began (from its `shutting down` line)."""
    [count] = [int(m.group(1)) for line in log if (m := re.search(r"shutting down: (\d+) in-flight", line))]
    return count


@pytest.fixture(scope="module")
def serve(checkpoint: Path):
    process = ServeProcess("--model", str(checkpoint), "--kv-cache-gib", "0.01", "--device", "cpu", "--demo")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_help_lists_commands() -> None:
    result = omnivox("--help")
    assert result.returncode == 0
    for command in ("serve", "chat", "generate", "models"):
        assert command in result.stdout


def test_wrong_model_path_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(omnivox("serve", "--model", str(tmp_path / "nope")), "no such file or folder")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(omnivox("serve", "--model", str(tmp_path / "empty")), "no config.json")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert_one_line_error(omnivox("serve", "--model", str(tmp_path / "weights.bin")), "neither")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")  # passes the path check, fails to load
    assert_one_line_error(omnivox("serve", "--model", str(tmp_path / "broken"), "--port", "0"), "cannot load 'broken'")


def test_bad_sampling_default_is_one_line(checkpoint: Path) -> None:
    result = omnivox("serve", "--model", str(checkpoint), "--port", "0", "--sampling-default", "temperature=-1")
    assert_one_line_error(result, "--sampling-default", "temperature must be a finite number >= 0")
    result = omnivox("serve", "--model", str(checkpoint), "--port", "0", "--sampling-default", "other:top_k=3")
    assert_one_line_error(result, "no model is served as 'other'", "tiny")


def test_unreachable_server_is_one_line() -> None:
    with closed_port() as port:
        server = f"127.0.0.1:{port}"
        for command in (["models"], ["generate", "Hello"], ["chat", "Hello", "--once"]):
            result = omnivox(*command, "--server", server, "--connect-timeout", "0.2")  # refused: no need to wait
            assert_one_line_error(result, "cannot reach", server)


def test_demo_answers_through_the_api_then_keeps_serving(serve: ServeProcess) -> None:
    """`make serve` runs `omnivox serve --demo`: one chat request through real gRPC, printed as it streams."""
    deadline = time.monotonic() + 60
    while "still serving" not in "".join(serve.stdout):
        assert time.monotonic() < deadline and serve.proc.poll() is None, "".join(serve.stdout + serve.log)
        time.sleep(0.1)
    out = "".join(serve.stdout)
    assert "--- demo: GenerationService/Generate on" in out
    assert "assistant> " in out
    assert re.search(r"\[\w+ · \d+ prompt \+ \d+ output tokens", out), out
    assert serve.proc.poll() is None  # still serving


def test_models_command(serve: ServeProcess) -> None:
    result = omnivox("models", "--server", serve.address)
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split()[:5] == ["NAME", "IN", "OUT", "CONTEXT", "STATE"]
    assert row.split()[:6] == ["tiny", "(default)", "text", "text", "512", "ready"]


def test_generate_streams_the_same_text_as_the_api(serve: ServeProcess) -> None:
    result = omnivox("generate", "Hello there", "--server", serve.address, "--max-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    with grpc.insecure_channel(serve.address) as channel:
        request = user_request("Hello there", max_output_tokens=12, sampling=sampling_pb2.SamplingConfig(temperature=0))
        responses = list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(request))
    expected = "".join(r.delta.text for r in responses if r.HasField("delta"))
    assert result.stdout == expected + "\n"
    assert re.search(r"\[\w+ · \d+ prompt \+ \d+ output tokens", result.stderr), result.stderr


def test_generate_reports_invalid_argument(serve: ServeProcess) -> None:
    result = omnivox("generate", "Hello", "--server", serve.address, "--temperature", "-1")
    assert_one_line_error(result, "INVALID_ARGUMENT", "sampling.temperature")
    result = omnivox("generate", "Hello", "--server", serve.address, "--model", "nope")
    assert_one_line_error(result, "NOT_FOUND", "nope")


def test_generate_structured_output_flags(serve: ServeProcess, tmp_path: Path) -> None:
    """--choice, --regex and --json-schema constrain the answer (sampled at temperature 1); a bad schema is one line."""
    base = ("--server", serve.address, "--temperature", "1", "--seed", "3", "--max-tokens", "60", "-q")
    result = omnivox("generate", "Pick one", *base, "--choice", "yes,no")
    assert result.returncode == 0 and result.stdout in ("yes\n", "no\n"), result
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}'
    )
    result = omnivox("generate", "Count", *base, "--json-schema", str(schema))
    assert result.returncode == 0, result
    assert isinstance(json.loads(result.stdout)["n"], int), repr(result.stdout)
    result = omnivox("generate", "Code", *base, "--regex", "[A-Z]{2}-[0-9]{3}")
    assert result.returncode == 0 and re.fullmatch(r"[A-Z]{2}-[0-9]{3}\n", result.stdout), result
    schema.write_text("{not json")
    assert_one_line_error(
        omnivox("generate", "Hi", *base, "--json-schema", str(schema)),
        "INVALID_ARGUMENT",
        "response_format.json_schema",
    )


def test_chat_keeps_the_conversation(serve: ServeProcess) -> None:
    """Each line is a user turn; the second request carries the first exchange (checked against the API)."""
    args = ("--server", serve.address, "--max-tokens", "4", "--temperature", "0", "-q")
    result = omnivox("chat", *args, stdin="Hello\n\nHow are you?\n")
    assert result.returncode == 0, result.stderr

    def answer(turns: list[tuple[str, str]]) -> str:
        request = user_request("", max_output_tokens=4, sampling=sampling_pb2.SamplingConfig(temperature=0))
        del request.contents[:]
        for role, text in turns:
            request.contents.add(role=role).parts.add(text=text)
        with grpc.insecure_channel(serve.address) as channel:
            responses = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request)
            return "".join(r.delta.text for r in responses if r.HasField("delta"))

    first = answer([("user", "Hello")])
    second = answer([("user", "Hello"), ("assistant", first), ("user", "How are you?")])
    assert result.stdout == f"{first}\n{second}\n"  # the blank input line is skipped


def test_cli_output_into_a_closed_pipe_exits_quietly(serve: ServeProcess) -> None:
    """`omnivox ... | head -1`: the reader leaves, the next write raises BrokenPipeError: a traceback (and another at
    exit's flush). Now exit status 141 (128 + SIGPIPE, as a shell reports it) and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    cli = [sys.executable, "-m", "omnivox.services.cli", "generate", "Hi", "--max-tokens", "4"]
    done = subprocess.run(
        [*cli, "--server", serve.address, "--quiet"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        timeout=120,
        text=True,
    )
    os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_sigterm_lets_the_stream_finish_then_exits_0(long_checkpoint: Path) -> None:
    """Its own server (it stops that server, so no test order matters: it used to stop the module's shared one and had
    to run last). 16 streams of 400 tokens are 400 engine steps after the signal (5-8 s measured at load 11 on the
    shared 2 cores), against a few milliseconds between the streams' first deltas and the signal; the server's own
    count at `shutting down` proves all sixteen were still running."""
    process = ServeProcess("--model", str(long_checkpoint), "--kv-cache-gib", "0.02", "--device", "cpu")
    try:
        address = process.wait_ready()
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            # Several long streams keep the drain open while the late call arrives (a call to a server that has
            # already closed is CANCELLED instead).
            request = user_request("Talk for a long time.", max_output_tokens=400, ignore_eos=True)
            streams = [stub.Generate(request) for _ in range(16)]
            firsts = [next(stream) for stream in streams]  # every stream admitted before the signal
            assert all(first.HasField("delta") for first in firsts)
            os.kill(process.proc.pid, signal.SIGTERM)
            wait_for_log(process, "shutting down")
            # The server itself counted all sixteen still running when the drain began (deltas the client has not
            # read yet say nothing: hundreds can sit in its buffers after the server has finished).
            assert in_flight_at_shutdown(process.log) == len(streams), "".join(process.log)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(user_request("Late", max_output_tokens=2), timeout=10))
            # Refused by the drain itself (not a connection error from a server already gone).
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert "shutting down" in info.value.details(), info.value
            for stream in streams:
                after = list(stream)  # completes normally: no RpcError
                assert after[-1].HasField("summary") and after[-1].summary.usage.output_tokens == 400
        assert process.proc.wait(timeout=60) == 0, "".join(process.log)
        log = "".join(process.log)
        assert "SIGTERM received" in log and "stopped" in log
    finally:
        process.stop()


def test_every_subpackage_is_packaged() -> None:
    """A wheel install (docker/Dockerfile runs `pip install .`) ships every subpackage, e.g. the CLI's commands."""
    import tomllib

    root = REPO_ROOT
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for package, folder in config["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(root / folder)
            name = ".".join([package, *relative.parts])
            if name.startswith("omnivox.") or name == "omnivox":
                assert name in listed, f"{name} ({init.parent}) is missing from [tool.setuptools] packages"


def test_second_signal_cuts_the_drain_short(long_checkpoint: Path) -> None:
    process = ServeProcess("--model", str(long_checkpoint), "--kv-cache-gib", "0.01", "--device", "cpu")
    try:
        address = process.wait_ready()
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            # 4000 tokens: many seconds on any machine, so the stream cannot finish before the second signal.
            stream = stub.Generate(user_request("Talk for a long time.", max_output_tokens=4000, ignore_eos=True))
            assert next(stream).HasField("delta")
            process.proc.send_signal(signal.SIGINT)
            wait_for_log(process, "shutting down")
            assert in_flight_at_shutdown(process.log) == 1, "".join(process.log)
            process.proc.send_signal(signal.SIGINT)
            with pytest.raises(grpc.RpcError):  # the stream is cut, not completed
                list(stream)
        assert process.proc.wait(timeout=60) == 1
        assert any("cancelling the requests still running" in line for line in process.log)
    finally:
        process.stop()
