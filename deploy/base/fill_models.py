"""Fill the models volume once: MODEL_SOURCE (an http(s):// or file:// tar archive, or a file:// folder) becomes
MODEL_DEST (/models/model), atomically: unpacked beside it, then renamed into place, so a reader sees the old
checkpoint, old or new (or for the instant between two renames none), never half of one. Run by the omnivox-models-fill Job (models-fill-job.yaml) with the
omnivox image's Python and nothing else (standard library only).

MODEL_SHA256 (the archive's, required for http(s)) is checked before anything is unpacked. A destination whose
.omnivox-source names the same MODEL_ID (default: the source and digest) is left alone (the Job can rerun). Exit status 0 when filled or
already filled, 1 with one line on stderr otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

MARKER = ".omnivox-source"
CHUNK = 1 << 20


def fetch(source: str, into: Path) -> str:
    """Copy the archive at `source` to `into`, returning its sha256."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(source, timeout=60) as response, into.open("wb") as out:
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def unpack(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")  # no absolute paths, no links out of `into`, no devices
    entries = list(into.iterdir())
    if len(entries) == 1 and entries[0].is_dir():  # model.tar.gz holding one folder: its contents are the model
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(into / child.name)
        inner.rmdir()


def fill(source: str, sha256: str, dest: Path, identity: str = "") -> str:
    identity = identity or f"{source} {sha256}".strip()
    url = urllib.parse.urlparse(source)
    marker = dest / MARKER
    if marker.is_file() and marker.read_text().strip() == identity:
        if url.scheme == "file" and Path(url.path).is_dir():
            shutil.rmtree(url.path)  # the copy an init container made again: not kept twice
        return f"{dest} already holds {identity}"
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=dest.parent))
    try:
        if url.scheme == "file" and Path(url.path).is_dir():
            staging.rmdir()
            Path(url.path).rename(staging)  # a folder an init container copied from an OCI image, on this volume
        elif url.scheme in ("http", "https", "file"):
            if url.scheme != "file" and not sha256:
                raise ValueError(f"MODEL_SHA256 is required for {url.scheme}:// sources")
            archive = dest.parent / f"{staging.name}.tar"
            try:
                got = fetch(source, archive)
                if sha256 and got != sha256.lower():
                    raise ValueError(f"{source}: sha256 {got}, expected {sha256}")
                unpack(archive, staging)
            finally:
                archive.unlink(missing_ok=True)
        else:
            raise ValueError(f"MODEL_SOURCE {source!r}: expected http(s):// or file://")
        if not (staging / "config.json").is_file() and not any(staging.glob("*.gguf")):
            raise ValueError(f"{source}: no config.json or .gguf at the top of the checkpoint")
        (staging / MARKER).write_text(identity + "\n")
        if dest.exists():  # swap: the old checkpoint moves aside in one rename, then goes
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=dest.parent))
            dest.rename(old / dest.name)
            staging.rename(dest)
            shutil.rmtree(old)
        else:
            staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return f"{dest} filled from {identity}"


def main() -> int:
    source = os.environ.get("MODEL_SOURCE", "")
    dest = Path(os.environ.get("MODEL_DEST", "/models/model"))
    try:
        print(fill(source, os.environ.get("MODEL_SHA256", ""), dest, os.environ.get("MODEL_ID", "")))
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"fill_models: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
