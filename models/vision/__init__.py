"""Vision encoders of the vision-language families we serve; see base.py for the contract the service uses."""

from __future__ import annotations

from omnivox.models.vision.base import ImageInputs, VisionEncoder
from omnivox.models.vision.gemma3 import Gemma3Encoder
from omnivox.models.vision.idefics3 import Idefics3Encoder
from omnivox.models.vision.llava import LlavaEncoder
from omnivox.models.vision.qwen2_5_vl import Qwen25VLEncoder
from omnivox.models.vision.qwen2_vl import Qwen2VLEncoder
from omnivox.models.vision.qwen_vl import mrope_positions, mrope_span

# config.model_type -> encoder class
FAMILIES: dict[str, type[VisionEncoder]] = {
    "llava": LlavaEncoder,
    "llava_next": LlavaEncoder,
    "smolvlm": Idefics3Encoder,
    "idefics3": Idefics3Encoder,
    "qwen2_vl": Qwen2VLEncoder,
    "qwen2_5_vl": Qwen25VLEncoder,
    "gemma3": Gemma3Encoder,
}

__all__ = [
    "FAMILIES",
    "Gemma3Encoder",
    "Idefics3Encoder",
    "ImageInputs",
    "LlavaEncoder",
    "Qwen25VLEncoder",
    "Qwen2VLEncoder",
    "VisionEncoder",
    "mrope_positions",
    "mrope_span",
]
