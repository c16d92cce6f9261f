"""Request and output processing load without grpc (issue 27), so the HTTP front and the realtime socket call the very
code gRPC's servicers call. Every services module outside the gRPC face (services/grpc_api/) is imported in a fresh
interpreter in which any `grpc` import fails; a new module anywhere else is held to this."""

from __future__ import annotations

import subprocess
import sys

from support.paths import REPO_ROOT

# The gRPC face (services/grpc_api/: servicers, the server and its interceptor chain, the error -> status mapping), the
# HTTP front's route modules (openai_api/http_*.py: they ride in the gRPC server's process and share its auth, log line
# and status counter, grpc_api/auth.py and logs.py) and the command-line client. Nothing else may import grpc.
GRPC_FACE_ROOMS = ("grpc_api", "cli")


def _is_grpc_face(parts: tuple[str, ...]) -> bool:
    return parts[0] in GRPC_FACE_ROOMS or (parts[0] == "openai_api" and parts[-1].startswith("http_"))


_BLOCK_AND_IMPORT = """
import importlib, sys, traceback
class NoGrpc:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith(("grpc.", "grpc_")):
            here = [f for f in traceback.extract_stack() if "/services/" in f.filename]
            raise ImportError(f"{name} imported from {here[-1].filename}:{here[-1].lineno}" if here else name)
sys.meta_path.insert(0, NoGrpc())
failed = []
for module in sys.argv[1:]:
    try:
        importlib.import_module("omnivox.services." + module)
    except ImportError as exc:
        failed.append(f"{module}: {exc}")
print("\\n".join(failed))
"""


def _processing_modules() -> list[str]:
    folder = REPO_ROOT / "services"
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if not _is_grpc_face(parts) and parts[-1] != "__init__":
            names.append(".".join(parts))
    return names


def test_request_and_output_processing_load_without_grpc() -> None:
    modules = _processing_modules()
    rooms = {"processing.generate_request", "output.generate_output", "calls.generate_call", "parts.registry"}
    assert rooms | {"errors"} <= set(modules)
    run = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT, *modules], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "", f"these import grpc (move the grpc part to the gRPC face):\n{run.stdout}"
