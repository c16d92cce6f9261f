"""The suite's own layout: test files in folders by subject, none at the top, unique names (pytest imports each by
its file name), and no test module importing another (what tests share lives in tests/support/)."""

from __future__ import annotations

import ast
from collections import Counter

from support.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"


def test_modules_sit_in_subject_folders_with_unique_names() -> None:
    top = sorted(p.name for p in TESTS.glob("*.py"))
    assert top == ["conftest.py"], f"test files belong in a subject folder (tests/engine/, tests/services/, ...): {top}"
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            offenders += [f"{path.relative_to(TESTS)}: {m}" for m in modules if m.split(".")[-1].startswith("test_")]
    assert offenders == [], "shared test code goes in tests/support/"
