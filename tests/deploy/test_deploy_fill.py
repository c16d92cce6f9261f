"""deploy/base/fill_models.py, the models-fill Job's script, run as the Job runs it (a subprocess with its env)
against a real HTTP server: it fills the volume from a tar archive whose sha256 it checks first, swaps a new
checkpoint in by rename, leaves a filled volume alone on a rerun, refuses a wrong digest without touching what is
there, and takes a folder an init container copied from an OCI image."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.deploy_manifests import DEPLOY

SCRIPT = DEPLOY / "base" / "fill_models.py"


def tarball(files: dict[str, bytes], top: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def web(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server over a folder: (base URL, the folder)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()


def run_fill(dest: Path, source: str, sha256: str = "", model_id: str = "") -> subprocess.CompletedProcess[str]:
    env = {"MODEL_SOURCE": source, "MODEL_SHA256": sha256, "MODEL_DEST": str(dest), "MODEL_ID": model_id}
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_fills_from_a_url_checks_the_digest_and_reruns_as_a_no_op(tmp_path, web) -> None:
    base, www = web
    volume = tmp_path / "models"
    volume.mkdir()
    dest = volume / "model"
    v1 = tarball({"config.json": b'{"v": 1}', "model.safetensors": b"\0" * 4096}, top="Llama/")
    (www / "v1.tar.gz").write_bytes(v1)
    url = f"{base}/v1.tar.gz"
    sha = hashlib.sha256(v1).hexdigest()

    refused = run_fill(dest, url)  # no digest for an http source
    assert refused.returncode == 1 and "MODEL_SHA256 is required" in refused.stderr
    done = run_fill(dest, url, sha)
    assert done.returncode == 0, done.stderr
    assert (dest / "config.json").read_bytes() == b'{"v": 1}'  # the archive's one top folder is the model
    assert (dest / "model.safetensors").stat().st_size == 4096
    assert sorted(p.name for p in volume.iterdir()) == ["model"]  # no archive or staging folder left
    again = run_fill(dest, url, sha)
    assert again.returncode == 0 and "already holds" in again.stdout

    v2 = tarball({"config.json": b'{"v": 2}'})
    (www / "v2.tar.gz").write_bytes(v2)
    wrong = run_fill(dest, f"{base}/v2.tar.gz", sha)  # v1's digest for v2's archive
    assert wrong.returncode == 1 and "expected " + sha in wrong.stderr
    assert (dest / "config.json").read_bytes() == b'{"v": 1}'  # untouched
    assert sorted(p.name for p in volume.iterdir()) == ["model"]
    swapped = run_fill(dest, f"{base}/v2.tar.gz", hashlib.sha256(v2).hexdigest())
    assert swapped.returncode == 0, swapped.stderr
    assert sorted(p.name for p in dest.iterdir()) == [".omnivox-source", "config.json"]  # v1's weights are gone
    assert (dest / "config.json").read_bytes() == b'{"v": 2}'


def test_refuses_an_archive_that_is_not_a_checkpoint_or_escapes(tmp_path, web) -> None:
    base, www = web
    dest = tmp_path / "models" / "model"
    dest.parent.mkdir()
    for name, archive, why in [
        ("notes.tar.gz", tarball({"README": b"hi"}), "no config.json"),
        ("evil.tar.gz", tarball({"../escape.json": b"{}"}), "outside the destination"),
    ]:
        (www / name).write_bytes(archive)
        out = run_fill(dest, f"{base}/{name}", hashlib.sha256(archive).hexdigest())
        assert out.returncode == 1 and why in out.stderr, out.stderr
        assert not dest.exists() and list(dest.parent.iterdir()) == []
    assert not (tmp_path / "models" / "escape.json").exists()


def test_takes_a_folder_copied_from_an_oci_image(tmp_path) -> None:
    volume = tmp_path / "models"
    staging = volume / ".staging"
    staging.mkdir(parents=True)
    (staging / "config.json").write_text("{}")
    dest = volume / "model"
    done = run_fill(dest, f"file://{staging}", model_id="registry.example.com/models/m:v1")
    assert done.returncode == 0, done.stderr
    assert (dest / "config.json").exists() and not staging.exists()
    assert (dest / ".omnivox-source").read_text() == "registry.example.com/models/m:v1\n"
    staging.mkdir()  # the init container copies the image again on every run: the copy is dropped, not kept twice
    (staging / "config.json").write_text("{}")
    again = run_fill(dest, f"file://{staging}", model_id="registry.example.com/models/m:v1")
    assert again.returncode == 0 and "already holds" in again.stdout and not staging.exists()
