"""Engines over tiny checkpoints, shared by the engine tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from omnivox.engine import Engine
from support.checkpoints import make_checkpoint

_CACHE: dict[tuple, Path] = {}


def tiny_checkpoint(tmp_root: Path, family: str = "llama", **overrides) -> Path:
    key = (str(tmp_root), family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _CACHE:
        name = f"{family}-{abs(hash(key[2])) % 10**8}"
        _CACHE[key] = make_checkpoint(tmp_root / name, family, **overrides)
    return _CACHE[key]


def device_under_test() -> torch.device:
    """The device the engine tests run on: `OMNIVOX_TEST_DEVICE` (e.g. cuda, cuda:1), else the CPU. The same tests
    then run on a GPU unchanged, in float32 (exact-token comparisons hold within float32 tolerance)."""
    return torch.device(os.environ.get("OMNIVOX_TEST_DEVICE") or "cpu")


def tiny_engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("kv_cache_gib", 0.01)
    kwargs.setdefault("device", device_under_test())
    kwargs.setdefault("dtype", "float32")
    return Engine.from_pretrained(path, **kwargs)
