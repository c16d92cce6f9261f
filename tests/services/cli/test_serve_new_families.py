"""This session's new families and flags used as a user uses them: `omnivox serve` in a child process on a real port,
called with the `omnivox` CLI from other processes. One server holds a Gemma 3 vision-language folder, a Qwen3-MoE
decoder served int8 with n-gram speculation and a Whisper model, behind API keys, with a small per-request pixel budget
(--max-request-megapixels) and a 1 s stream idle timeout."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from PIL import Image
from support.checkpoints import make_checkpoint
from support.gemma3_checkpoint import make_gemma3
from support.serve_process import OMNIVOX, ServeProcess, assert_one_line_error, omnivox
from support.whisper_checkpoints import make_whisper

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("new-families")
    (root / "keys").write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    Image.new("RGB", (60, 40), (200, 30, 90)).save(root / "photo.png")
    Image.new("RGB", (1000, 1000), (10, 200, 30)).save(root / "one-mp.png")
    serve = ServeProcess(
        "--model", str(make_gemma3(root / "gemma3")), "--name", "g3",
        "--model", str(make_checkpoint(root / "qwen3-moe", family="qwen3_moe", seed=3)), "--name", "moe",
        "--model", str(make_whisper(root / "whisper", seed=3)), "--name", "whisper",
        "--quantization", "moe=int8", "--speculative", "moe=ngram",
        "--api-keys", str(root / "keys"), "--max-request-megapixels", "1.5", "--stream-idle-timeout", "1",
        "--kv-cache-gib", "0.02", "--threads", "1",
    )  # fmt: skip
    try:
        yield serve.wait_ready(), root
    finally:
        serve.stop()


def _cached(result: subprocess.CompletedProcess) -> int:
    """The prompt tokens served from the prefix cache, from the CLI's summary line on stderr."""
    assert result.returncode == 0, result.stderr
    [count] = re.findall(r"\((\d+) cached\)", result.stderr)
    return int(count)


def test_ask_gemma3_about_an_image_shares_its_cache_only_within_caller_and_salt(served):
    address, root = served
    ask = ["ask", "--server", address, "--model", "g3", "--image", str(root / "photo.png"), "What is this?"]
    ask += ["--max-tokens", "3", "--temperature", "0", "--cache-salt", "s1"]
    first = omnivox(*ask, "--api-key", ALICE)
    again = omnivox(*ask, "--api-key", ALICE)
    other = omnivox(*ask, "--api-key", BOB)  # same salt, another caller: nothing shared
    assert _cached(first) == 0 and _cached(again) > 0 and _cached(other) == 0
    assert first.stdout == again.stdout == other.stdout and first.stdout.strip()
    # Two 1 MP images under a 1.5 MP budget: the second is refused by name, in one line.
    big = ["--image", str(root / "one-mp.png")] * 2
    result = omnivox("ask", "--server", address, "--api-key", ALICE, "--model", "g3", *big, "Compare.")
    assert_one_line_error(result, "INVALID_ARGUMENT", "contents[0].parts[1].image", "limit is 1500000 per request")


def test_generate_on_a_moe_model_served_int8_with_ngram_speculation(served):
    address, _ = served
    prompt = "one two three four one two three four one two three four"
    result = omnivox("generate", prompt, "--server", address, "--api-key", ALICE, "--model", "moe",
                     "--max-tokens", "12", "--temperature", "0")  # fmt: skip
    assert result.returncode == 0 and "+ 12 output tokens" in result.stderr, result.stderr


def test_an_idle_microphone_stream_ends_in_one_line_and_exit_1(served):
    """`arecord ... | omnivox transcribe --stream -` whose pipe stays open and silent: the server's idle timeout
    ends the call OUT_OF_RANGE. The CLI aborted after its one-line error (exit 134, 'Fatal Python error:
    _enter_buffered_busy': gRPC's request thread held stdin's buffer lock in a read at interpreter shutdown)."""
    address, _ = served
    args = ["transcribe", "--stream", "-", "--sample-rate", "16000", "--server", address, "--api-key", ALICE]
    proc = subprocess.Popen([*OMNIVOX, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:  # stdin stays open and nothing is ever sent (communicate() would close it: an empty stream, no timeout)
        proc.wait(timeout=60)
        result = subprocess.CompletedProcess(args, proc.returncode, proc.stdout.read(), err := proc.stderr.read())
    finally:
        proc.kill()
        proc.stdin.close()
    assert_one_line_error(result, "OUT_OF_RANGE", "--stream-idle-timeout")
    assert "Fatal Python error" not in err


def test_a_client_command_with_an_api_key_does_not_import_torch(served):
    """--api-key made connect() import the server's auth module, and through its metrics the engine and torch: every
    keyed CLI call took 5-6 s on a busy 2-core machine instead of 0.4-0.7 s (the client interceptor now lives in
    services/cli/bearer.py)."""
    address, _ = served
    code = (
        "import sys; from omnivox.services.cli import main; "
        f"rc = main(['models', '--server', '{address}', '--api-key', '{ALICE}']); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('omnivox'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "g3 (default)" in result.stdout, result.stderr[-2000:]


def test_help_lists_the_new_flags() -> None:
    serve_help = omnivox("serve", "--help").stdout
    assert "--max-request-megapixels" in serve_help and "--stream-idle-timeout" in serve_help
    assert "--cache-salt" in omnivox("ask", "--help").stdout  # every command's: test_cache_isolation


def test_a_name_after_another_model_is_refused_not_misrouted(served):
    """`--model A --model B --name b` paired 'b' with A (names go in order) and served B under its folder name:
    requests for 'b' reached the other model without a word. Now a one-line error, before anything loads."""
    _, root = served
    a, b = str(root / "gemma3"), str(root / "qwen3-moe")
    result = omnivox("serve", "--model", a, "--model", b, "--name", "b", "--port", "0")
    assert_one_line_error(result, "--name 'b' follows --model #2 but names --model #1", "put each --name right after")
