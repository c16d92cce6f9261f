"""Vision encoders of the vision-language families we serve; see base.py for the contract the service uses.

Every name here is imported on first use (PEP 562 `__getattr__`): base.py and each family's module import
transformers' processing and modeling utilities (~1.5 s), which a server with no vision model never needs.
`FAMILIES` names every family without importing one; `encoder_class(model_type)` imports its module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnivox.models.vision.base import ImageInputs, VisionEncoder
    from omnivox.models.vision.gemma3 import Gemma3Encoder
    from omnivox.models.vision.idefics3 import Idefics3Encoder
    from omnivox.models.vision.llava import LlavaEncoder
    from omnivox.models.vision.qwen2_5_vl import Qwen25VLEncoder
    from omnivox.models.vision.qwen2_vl import Qwen2VLEncoder
    from omnivox.models.vision.qwen_vl import mrope_positions, mrope_span

# config.model_type -> (module, encoder class)
FAMILIES: dict[str, tuple[str, str]] = {
    "llava": ("omnivox.models.vision.llava", "LlavaEncoder"),
    "llava_next": ("omnivox.models.vision.llava", "LlavaEncoder"),
    "smolvlm": ("omnivox.models.vision.idefics3", "Idefics3Encoder"),
    "idefics3": ("omnivox.models.vision.idefics3", "Idefics3Encoder"),
    "qwen2_vl": ("omnivox.models.vision.qwen2_vl", "Qwen2VLEncoder"),
    "qwen2_5_vl": ("omnivox.models.vision.qwen2_5_vl", "Qwen25VLEncoder"),
    "gemma3": ("omnivox.models.vision.gemma3", "Gemma3Encoder"),
}
# Every public name -> the module that defines it.
_MODULE_OF: dict[str, str] = {
    **{name: module for module, name in FAMILIES.values()},
    "ImageInputs": "omnivox.models.vision.base",
    "VisionEncoder": "omnivox.models.vision.base",
    "mrope_positions": "omnivox.models.vision.qwen_vl",
    "mrope_span": "omnivox.models.vision.qwen_vl",
}


def encoder_class(model_type: str) -> type[VisionEncoder]:
    """The VisionEncoder subclass of a family (a key of FAMILIES), its module imported on first use."""
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "Gemma3Encoder",
    "Idefics3Encoder",
    "ImageInputs",
    "LlavaEncoder",
    "Qwen25VLEncoder",
    "Qwen2VLEncoder",
    "VisionEncoder",
    "encoder_class",
    "mrope_positions",
    "mrope_span",
]
