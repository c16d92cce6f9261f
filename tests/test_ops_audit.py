"""Operations as a user sees them: every `omnivox serve` flag value out of range is a one-line error naming the flag;
metrics scraped and parsed as Prometheus does, gauges back to zero after cancelled, failed and refused calls; API key
files as operators write them, rotated without a restart, and never logged."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_checkpoint

from omnivox.services.cli import main as cli_main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("audit") / "tiny", family="llama")


# ---- CLI: every flag's value is checked, in one line naming the flag ---------------------------------------------
BAD_FLAGS = [
    (["--max-connection-age", "nan"], "--max-connection-age"),  # was a ValueError traceback
    (["--max-connection-age", "inf"], "--max-connection-age"),  # OverflowError traceback
    (["--max-connection-age", "1e30"], "--max-connection-age"),  # OverflowError traceback
    (["--max-message-mib", "100000"], "--max-message-mib"),  # OverflowError traceback (gRPC's C int)
    (["--kv-cache-gib", "nan"], "--kv-cache-gib"),  # 'cannot convert float NaN to integer', no flag named
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--grace-period", "nan"], "--grace-period"),  # served, with no grace at all
    (["--stream-idle-timeout", "nan"], "--stream-idle-timeout"),  # served
    (["--max-streams-per-key", "-1"], "--max-streams-per-key"),  # served, refusing every call
    (["--max-rpm-per-key", "-1"], "--max-rpm-per-key"),  # served, refusing every call
    (["--image-cache-mib", "-1"], "--image-cache-mib"),  # served
    (["--max-model-len", "0"], "--max-model-len"),  # said 'max_model_len', not the flag
    (["--name", ""], "--name"),  # served a model named ''
    (["--device", "foo"], "--device"),  # torch's list of 20 device types, no flag named
    (["--data-dir", __file__], "--data-dir"),  # served; creating a voice failed later
]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_serve_flag_out_of_range_is_one_line_naming_it(
    flags: list[str], named: str, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli_main(["serve", "--model", str(checkpoint), "--port", "0", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omnivox: error: ") and named in err[0], err


def test_serve_flag_error_from_the_command_line_has_no_traceback(checkpoint: Path) -> None:
    """The installed command, as a user runs it: exit 1, one line on stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "omnivox.services.cli", "serve", "--model", str(checkpoint), "--max-connection-age",
         "inf"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"omnivox: error: --max-connection-age must be a number greater than 0 and at most {2**31 // 1000 - 1}, "
        f"got {math.inf:g}"
    ]
