"""`omnivox` run as a user runs it: the CLI in a child process (`omnivox`), `omnivox serve` as a child process on a
free port (`ServeProcess`), its log, and the one-line error check of refused flags."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

OMNIVOX = [sys.executable, "-m", "omnivox.services.cli"]


def omnivox(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNIVOX, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("omnivox: error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


class ServeProcess:
    """`omnivox serve` in a child process; its log is read on a thread so that it never blocks."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*OMNIVOX, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.log: list[str] = []
        self.stdout: list[str] = []
        self.address: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.log), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True).start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            match = re.search(r"serving .* on (\S+)$", line.strip())
            if match:
                self.address = match.group(1)
                self.ready.set()

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            assert self.proc.poll() is None, "".join(self.log)
            assert time.monotonic() < deadline, "".join(self.log)
        return self.address  # type: ignore[return-value]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def wait_for_log(process: ServeProcess, fragment: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not any(fragment in line for line in process.log):
        assert time.monotonic() < deadline, "".join(process.log)
        time.sleep(0.005)
