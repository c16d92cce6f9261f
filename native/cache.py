"""The omnivox cache folder and the one way anything is built into it.

Everything cached (the embedded default models, the config and tokenizer parsed from a GGUF file) is built the same
way: take a lock file next to the target, look again (another process may have built it while we waited), build into
a temporary folder beside the target, and `os.replace` the result into place. Readers therefore see either nothing or
a complete entry, never a half-written one, and concurrent processes build an entry once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def omnivox_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else `$OMNIVOX_CACHE`, else `~/.cache/omnivox` (not created here)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("OMNIVOX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "omnivox"


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing) for the duration of the block."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed, also if this process dies
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_cached(target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """Return `target` once `is_complete(target)`, building it first if it is not.

    `build(staged)` must create `staged` (a file or a folder; its parent is a fresh temporary folder on the same
    file system as `target`). Safe to call from several processes at once: one builds under the lock file
    `.<target name>.lock` while the others wait, then find it complete. A leftover incomplete entry is replaced.
    Raises what `build` raises (nothing is left behind) and OSError when the cache cannot be written.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            staged = tmp / target.name
            build(staged)
            if not staged.exists():
                raise RuntimeError(f"building {target} produced nothing")
            if target.is_dir() and not target.is_symlink():  # incomplete leftover: os.replace needs it gone
                shutil.rmtree(target)
            os.replace(staged, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not is_complete(target):
        raise RuntimeError(f"{target} is incomplete right after it was built")
    return target
