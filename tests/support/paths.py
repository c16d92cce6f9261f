"""Where the repository is, for tests that read its files (README, docs, deploy/, benchmarks/results, protos)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository
