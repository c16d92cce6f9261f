"""Imports point one way (DESIGN.md): codecs/ never imports models/ (the C-kernel build helpers both use live in
native/, below both), native/ imports nothing of omnivox but itself, and models/ reaches into codecs/ only where
the audio families still take their input limits and log-mel features from it (to move; listed here so the list
cannot grow unseen)."""

from __future__ import annotations

import ast

from support.paths import REPO_ROOT

ROOT = REPO_ROOT
# models/ -> codecs/ imports left (audio input limits and log-mel settings of the audio encoder families)
MODELS_TO_CODECS = {"omnivox.codecs.audio_input", "omnivox.codecs.mel"}


def _imports(folder: str) -> dict[str, set[str]]:
    """omnivox modules imported by each file of `folder` (module level and inside functions)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(ROOT))] = {n for n in names if n.startswith("omnivox")}
    return found


def test_codecs_do_not_import_models():
    bad = {f: sorted(n for n in names if n.startswith("omnivox.models")) for f, names in _imports("codecs").items()}
    assert not any(bad.values()), {f: n for f, n in bad.items() if n}


def test_native_imports_only_itself():
    bad = {f: sorted(n for n in names if not n.startswith("omnivox.native")) for f, names in _imports("native").items()}
    assert not any(bad.values()), {f: n for f, n in bad.items() if n}


def test_models_reach_codecs_only_for_audio_input():
    bad = {}
    for f, names in _imports("models").items():
        into_codecs = {n for n in names if n.startswith("omnivox.codecs")}
        if into_codecs - MODELS_TO_CODECS or (into_codecs and not f.startswith("models/audio/")):
            bad[f] = sorted(into_codecs)
    assert not bad, bad
