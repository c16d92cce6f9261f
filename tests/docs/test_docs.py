"""The README and docs/ stay true to the tree: the README is a newcomer's page that starts with its two commands,
docs/api.md names every RPC and every field of the API, and every repository path and relative link in them exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import FileDescriptor
from support.paths import REPO_ROOT

from omnivox.v1 import content_pb2, generation_pb2, model_pb2, sampling_pb2, speech_pb2, transcription_pb2

ROOT = REPO_ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROTO_FILES: list[FileDescriptor] = [
    m.DESCRIPTOR for m in (content_pb2, generation_pb2, model_pb2, sampling_pb2, speech_pb2, transcription_pb2)
]
# A path in backquotes or a link that starts at one of the repository's top-level folders.
TOP_FOLDERS = ("services", "engine", "models", "codecs", "tests", "benchmarks", "deploy", "docker", "protos", "docs")
PATH = re.compile(r"`((?:" + "|".join(TOP_FOLDERS) + r")/[\w./*{}-]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[\w-]+)?\)")


def test_readme_is_a_newcomers_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is a newcomer's page: reference material goes in docs/"
    first_block = readme.split("```")[1]
    assert "make serve" in first_block and "make test" in first_block, "the two set-up commands come first"
    for page in ("api.md", "models.md", "operations.md", "architecture.md"):
        assert f"(docs/{page})" in readme, f"README.md links docs/{page}"


def test_api_page_names_every_rpc_and_field() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for file in PROTO_FILES:
        for service in file.services_by_name.values():
            missing += [f"{service.name}.{m.name}" for m in service.methods if f"**`{m.name}`**" not in api]
        stack = list(file.message_types_by_name.values())
        while stack:
            message = stack.pop()
            stack.extend(message.nested_types)
            if message.GetOptions().map_entry:
                continue
            if f"#### `{message.name}`" not in api:
                missing.append(message.name)
                continue
            table = api.split(f"#### `{message.name}`", 1)[1].split("\n#### ", 1)[0]
            missing += [f"{message.name}.{f.name}" for f in message.fields if f"`{f.name}`" not in table]
        for enum in file.enum_types_by_name.values():
            table = api.split(f"#### enum `{enum.name}`", 1)[-1].split("\n#### ", 1)[0]
            missing += [f"{enum.name}.{v.name}" for v in enum.values if f"`{v.name}`" not in table]
    assert not missing, f"docs/api.md lacks (add them to 'Every RPC and field'): {missing}"


def _exists(reference: str) -> bool:
    reference = reference.rstrip(".")
    if any(c in reference for c in "*{"):
        pattern = re.sub(r"\{[^}]*\}", "*", reference)
        return any(ROOT.glob(pattern))
    return (ROOT / reference).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_link_exists(page: Path) -> None:
    text = page.read_text()
    missing = [ref for ref in PATH.findall(text) if not _exists(ref)]
    for link in LINK.findall(text):
        if "://" not in link and not (page.parent / link).exists():
            missing.append(link)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
