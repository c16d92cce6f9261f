"""Engines over tiny checkpoints, shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

from checkpoints import make_checkpoint

from omnivox.engine import Engine

_CACHE: dict[tuple, Path] = {}


def tiny_checkpoint(tmp_root: Path, family: str = "llama", **overrides) -> Path:
    key = (str(tmp_root), family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _CACHE:
        name = f"{family}-{abs(hash(key[2])) % 10**8}"
        _CACHE[key] = make_checkpoint(tmp_root / name, family, **overrides)
    return _CACHE[key]


def tiny_engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("kv_cache_gib", 0.01)
    return Engine.from_pretrained(path, device="cpu", **kwargs)
