"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model's .gguf (SmolLM2-135M-Instruct, Q4_1), fetched once into the stable cache.

    The cache is `$OMNIVOX_CACHE`, else `~/.cache/omnivox`, so one download serves the whole run (and later runs).
    """
    from omnivox.models.default import ensure_default_model

    return ensure_default_model(progress=False)
