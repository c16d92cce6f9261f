"""Building the decoder for an engine: device and dtype defaults, allocation straight on the device."""

from __future__ import annotations

import dataclasses

import torch

from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": None,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/"auto": bfloat16 on CUDA, float32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return resolve_dtype(_DTYPES[dtype], device)
    return dtype


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The decoder with uninitialised weights, allocated directly on device in dtype (no float32 detour)."""
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = DecoderModel(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.rotary.to(torch.float32)
    return model


def cap_max_len(cfg: ModelConfig, n: int) -> ModelConfig:
    return dataclasses.replace(cfg, max_model_len=min(cfg.max_model_len, n))
