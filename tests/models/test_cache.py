"""native/cache.py: the one locked, atomic way anything is built into the omnivox cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnivox.native.cache import build_cached, omnivox_cache_dir


def _complete(path: Path) -> bool:
    return (path / "done").is_file()


def test_cache_dir_comes_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "env"))
    assert omnivox_cache_dir() == tmp_path / "env"
    assert omnivox_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("OMNIVOX_CACHE")
    assert omnivox_cache_dir() == Path.home() / ".cache" / "omnivox"


def test_builds_once_then_returns_without_building(tmp_path):
    calls: list[Path] = []

    def build(staged: Path) -> None:
        calls.append(staged)
        staged.mkdir()
        (staged / "done").write_text("x")

    target = tmp_path / "models" / "thing"
    assert build_cached(target, build, _complete) == target
    assert build_cached(target, build, _complete) == target
    assert len(calls) == 1 and calls[0].name == "thing" and calls[0].parent.parent == target.parent
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]  # no staging folder left


def test_a_failed_build_leaves_nothing_and_a_leftover_is_replaced(tmp_path):
    target = tmp_path / "thing"

    def broken(staged: Path) -> None:
        staged.mkdir()
        (staged / "half").write_text("x")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        build_cached(target, broken, _complete)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".thing.lock"]

    target.mkdir()  # an incomplete entry written by something else (a crash before this helper existed)
    (target / "stale").write_text("x")

    def build(staged: Path) -> None:
        staged.mkdir()
        (staged / "done").write_text("x")

    build_cached(target, build, _complete)
    assert sorted(p.name for p in target.iterdir()) == ["done"]


_RACE = """
import sys, time
from pathlib import Path
from omnivox.native.cache import build_cached
target, log, ready, other = map(Path, sys.argv[1:5])
def build(staged):
    with open(log, "a") as f:
        f.write("built\\n")
    # Hold the lock until the other process is past its imports and about to ask for it (a fixed sleep is not
    # enough: on a busy machine the other interpreter may start only after this build is done).
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    staged.write_text("content")
ready.write_text("")
print(build_cached(target, build, lambda p: p.is_file()))
"""


def test_two_processes_build_once(tmp_path):
    target, log = tmp_path / "file.bin", tmp_path / "builds.log"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(target), str(log), str(ready[i]), str(ready[1 - i])],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(target)] * 2
    assert log.read_text() == "built\n" and target.read_text() == "content"
