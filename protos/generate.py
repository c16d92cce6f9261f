#!/usr/bin/env python
"""Regenerate the Python code for protos/omnivox/v1/*.proto (messages, stubs and .pyi type stubs).

Run from anywhere: `python protos/generate.py` (or `make proto`). The code lands next to the .proto files, with imports
that read `from omnivox.v1 import x_pb2`, because protoc runs with `-I protos`. tests/protos/test_proto.py runs this into a
temporary folder and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
PROTO_PACKAGE = Path("omnivox") / "v1"


def proto_files() -> list[Path]:
    """The .proto files, relative to PROTOS_DIR, sorted."""
    return sorted(p.relative_to(PROTOS_DIR) for p in (PROTOS_DIR / PROTO_PACKAGE).glob("*.proto"))


def generate(out_dir: Path = PROTOS_DIR) -> list[Path]:
    """Compile every proto into out_dir/omnivox/v1 and return the generated files, sorted."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    (out_dir / PROTO_PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out_dir)


def generated_files(root: Path) -> list[Path]:
    folder = root / PROTO_PACKAGE
    return sorted(p for p in folder.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTOS_DIR, help="root to write omnivox/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
