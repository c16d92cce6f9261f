"""The contract every vision family implements, and what they share: preprocessing through the checkpoint's own
processor, prompt expansion, and reading the vision side's weights out of a multimodal checkpoint.

How the service uses a `VisionEncoder` (one per loaded model):

1. `enc = VisionEncoder.from_folder(path, device, dtype)` once at load (dispatches on the checkpoint's config).
2. Per image part (off the event loop): `codecs.image.decode_image(bytes)`, then
   `item = enc.preprocess([pil], max_pixels)[0]` and `key = image_content_key(bytes, model_name,
   {**enc.feature_settings(), "max_pixels": max_pixels})`.
3. The chat template writes `enc.marker_token` where each image goes; the rendered text passes through
   `enc.expand_text(text, items)` (Gemma 3: the processor's text around each image; others: unchanged) and is
   tokenized; `ids = enc.expand_prompt(token_ids, items)` replaces every marker (id `enc.marker_token_id`) with that
   image's `item.placeholder_ids` (for SmolVLM these hold text tokens between tiles too). `enc.feature_runs(ids, items)`
   gives, per image, the runs of `enc.placeholder_token_id` positions its feature rows fill, in order: one
   `EmbeddingSegment` per run (`bidirectional` when `enc.bidirectional_images`: Gemma 3).
4. In the encoder worker: `features = enc.encode(items)` for the images of every request admitted together (one
   batched forward); `features[i]` is [items[i].num_features, text_hidden] in prompt order.
5. Qwen2-VL / Qwen2.5-VL only: `enc.rope_positions(ids, items)` -> ([3, N] positions, delta); generated token t
   (0-based, after N prompt tokens) sits at position N + t + delta on all three axes. Other families return None
   (1-D positions).
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from PIL import Image
from torch import nn

from omnivox.models.checkpoint import PROJECTOR, VISION, iter_checkpoint_tensors

logger = logging.getLogger(__name__)


@dataclass
class ImageInputs:
    """One image after the checkpoint's processor: what `encode` consumes and what the prompt needs."""

    tensors: dict[str, torch.Tensor]  # family-specific processor outputs for this one image (batch dim 1 or flat)
    placeholder_ids: tuple[int, ...]  # token ids that replace the image's marker token in the prompt
    num_features: int  # feature rows `encode` returns = placeholder_ids.count(placeholder_token_id)
    size: tuple[int, int]  # (width, height) of the image given to the processor
    extra: dict = field(default_factory=dict)  # family-specific facts (e.g. Qwen's grid_thw)


class VisionEncoder(nn.Module, ABC):
    """The vision side of a multimodal checkpoint: tower + projector, weights only of those parts."""

    family: str
    processor: transformers.ProcessorMixin
    marker_token: str  # what the chat template writes for one image (`processor.image_token`)
    marker_token_id: int
    placeholder_token_id: int  # the token whose rows the features replace
    # Other token strings user text must not spell: placeholders of media this API does not take (Qwen's video pad:
    # transformers' processor refuses text holding one without a video; we took it as a text token).
    reserved_tokens: tuple[str, ...] = ()
    text_hidden_size: int
    # The tokens of one image attend to each other both ways during prefill (Gemma 3); the engine then keeps each
    # image's segment inside one prefill chunk (EmbeddingSegment.bidirectional).
    bidirectional_images: bool = False
    # Why a part's max_pixels cannot lower this family's image tokens, or None when it can. Set where the processor
    # resizes every image to one size (LLaVA 1.5, Gemma 3 without pan-and-scan): a smaller image would only come out
    # blurred at the same token count, so the service refuses the field (services/processing/image_prompt.py) instead.
    max_pixels_refusal: str | None = None

    @staticmethod
    def from_folder(
        path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> VisionEncoder:
        """Load the vision side of the checkpoint folder `path` (config.json, weights, processor files).

        Raises ValueError when the checkpoint is not a vision-language model we serve.
        """
        from omnivox.models.vision import FAMILIES, encoder_class

        path = Path(path)
        config = transformers.AutoConfig.from_pretrained(path)
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"{path}: model_type {config.model_type!r} has no vision encoder; served: {sorted(FAMILIES)}"
            )
        cls = encoder_class(config.model_type)
        enc = cls(config, cls.load_processor(path, config))
        enc.check_processor()
        enc.load_from(path)
        return enc.to(device=device, dtype=dtype).eval()

    # --- per family -------------------------------------------------------------------------------------------------

    # Checkpoint name prefixes of the vision side -> our module's prefix; both layouts (hub and transformers 5).
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    # Stored name pieces -> the module's, where transformers 5 renamed modules but save_pretrained still writes the
    # hub's names (DINOv2's attention: `attention.attention.query` is `attention.q_proj` in memory).
    renamed_params: tuple[tuple[str, str], ...] = ()
    # Our parameters that no feature depends on, so a checkpoint may lack them (regexes).
    unused_params: tuple[str, ...] = ()

    @classmethod
    def load_processor(cls, path: Path, config: transformers.PretrainedConfig) -> transformers.ProcessorMixin:
        """The checkpoint's own processor (`AutoProcessor`), so preprocessing equals the reference's.

        transformers 5.24 cannot build the SmolVLM, Qwen2-VL and Qwen2.5-VL processors without torchvision, because
        their video processor needs it even when only images are processed. Then the same processor class is loaded
        without its video processor (`image_only_processor_class`): the image path is the class's own code, unchanged.
        Without torchvision these go there directly: AutoProcessor loaded the tokenizer before failing on the video
        processor, so each load read the tokenizer twice (0.9 s of a 1.9 s Qwen2-VL encoder load, SmolLM2's vocabulary).
        """
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
        from transformers.utils import is_torchvision_available

        name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
        full = getattr(transformers, name, None) if name else None
        has_image_only = full in (transformers.SmolVLMProcessor, *_QWEN_PROCESSORS)
        if has_image_only and not is_torchvision_available():
            logger.info("%s without its video processor (no torchvision)", name)
            return image_only_processor_class(full).from_pretrained(path)
        try:
            return transformers.AutoProcessor.from_pretrained(path)
        except (ImportError, AttributeError, OSError) as e:
            if not has_image_only:
                raise
            logger.warning("%s without its video processor (%s)", name, str(e).splitlines()[0][:120])
            return image_only_processor_class(full).from_pretrained(path)

    @abstractmethod
    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]: ...

    @abstractmethod
    def model_rows(self, item: ImageInputs) -> int:
        """Feature rows the model makes for `item`, from the config's arithmetic alone (no forward); ValueError naming
        the config key when the config cannot make features at all."""

    # The processor settings whose disagreement with the model's config `check_processor` reports.
    processor_keys: str = ""

    def check_processor(self) -> None:
        """Refuse (ValueError) a checkpoint whose processor writes another number of image tokens than the model
        makes feature rows, or whose config cannot make features, at load: served, every image request of it would
        fail inside the encoder (transformers' own model fails on it too). One probe image, no forward."""
        try:
            probe = self._preprocess_one(Image.new("RGB", (61, 37), (128, 64, 32)), None)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # e.g. a llava-hf processor without patch_size
            raise ValueError(
                f"the checkpoint's processor cannot process an image ({type(exc).__name__}: {exc}): check "
                f"{self.processor_keys}"
            ) from exc
        rows = self.model_rows(probe)
        if rows != probe.num_features:
            raise ValueError(
                f"the processor writes {probe.num_features} image tokens for a 61x37 image but the {self.family} "
                f"config makes {rows} feature rows: check {self.processor_keys} against the model's config"
            )

    def feature_settings(self) -> dict:
        """Everything besides the image bytes and the model name that decides the features (goes into the content
        key): the family, the weights' dtype and the image processor's full configuration. JSON-serialisable; a
        per-request max_pixels is added by the caller."""
        ip = self.processor.image_processor.to_dict()
        return {
            "family": self.family,
            "dtype": str(self.param_dtype).removeprefix("torch."),
            "image_processor": json.loads(json.dumps(ip, sort_keys=True, default=str)),
        }

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def feature_bytes(self, item: ImageInputs) -> int:
        """Bytes the features of `item` take (what an encoder cache budgets), known before encoding."""
        return item.num_features * self.text_hidden_size * self.param_dtype.itemsize

    def rope_positions(self, token_ids: Sequence[int], items: Sequence[ImageInputs]) -> tuple[torch.Tensor, int] | None:
        """M-RoPE positions ([3, N]) and the generated-token delta, for families that use them; else None."""
        return None

    # --- shared ------------------------------------------------------------------------------------------------------

    def preprocess(self, images: Sequence[Image.Image], max_pixels: int | None = None) -> list[ImageInputs]:
        """Each RGB image through the checkpoint's own processor, one at a time (no padding across images).

        max_pixels: at most this many pixels go into the processor. Families whose processor has its own pixel budget
        (Qwen2-VL, Qwen2.5-VL) get it passed down; the others get the image downscaled (aspect kept, bicubic) when it
        is larger.
        """
        out = []
        for im in images:
            out.append(self._preprocess_one(im, max_pixels))
        return out

    def _preprocess_one(self, im: Image.Image, max_pixels: int | None) -> ImageInputs:
        if max_pixels is not None and im.width * im.height > max_pixels:
            scale = (max_pixels / (im.width * im.height)) ** 0.5
            im = im.resize((max(1, int(im.width * scale)), max(1, int(im.height * scale))), Image.Resampling.BICUBIC)
        return self._run_processor(im, {})

    def _run_processor(self, im: Image.Image, kwargs: dict) -> ImageInputs:
        images = [[im]] if self.nested_images else [im]
        batch = self.processor(
            text=[self.marker_token], images=images, return_tensors="pt", add_special_tokens=False, **kwargs
        )
        ids = tuple(int(t) for t in batch["input_ids"][0])
        tensors = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        n = ids.count(self.placeholder_token_id)
        return ImageInputs(tensors=tensors, placeholder_ids=ids, num_features=n, size=(im.width, im.height))

    nested_images = False  # the processor wants images as [[image]] per prompt (Idefics3 / SmolVLM)

    def encode(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        """Features of each image, [num_features, text_hidden] each, in prompt order; one batched forward.

        Each tensor owns its memory (a copy, not a view of the batch's output), so a cache that keeps one image's
        features and drops another's frees what it drops. Raises AssertionError when an image's rows do not equal its
        placeholder count (a processor / model mismatch).
        """
        if not items:
            return []
        with torch.no_grad():
            feats = self._encode_batch(items)
        out = []
        for item, f in zip(items, feats, strict=True):
            if f.shape != (item.num_features, self.text_hidden_size):
                raise AssertionError(
                    f"{self.family}: {tuple(f.shape)} features for an image with {item.num_features} placeholders"
                )
            out.append(f.clone())
        return out

    def expand_text(self, text: str, items: Sequence[ImageInputs]) -> str:
        """The rendered chat text (one marker per image of `items`, in order) before it is tokenized: what the family's
        processor does to the text itself (Gemma 3 writes newlines, and pan-and-scan sentences, around each image
        there, which merge with the text beside them). Unchanged by default."""
        return text

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ImageInputs]) -> list[int]:
        """Replace the i-th marker token in token_ids by items[i].placeholder_ids; the counts must agree."""
        markers = sum(1 for t in token_ids if t == self.marker_token_id)
        if markers != len(items):
            raise ValueError(f"the prompt has {markers} image markers for {len(items)} images")
        out: list[int] = []
        it = iter(items)
        for t in token_ids:
            if t == self.marker_token_id:
                out.extend(next(it).placeholder_ids)
            else:
                out.append(t)
        return out

    def feature_runs(self, token_ids: Sequence[int], items: Sequence[ImageInputs]) -> list[list[tuple[int, int]]]:
        """Per image, the (start, length) runs of placeholder tokens in the expanded prompt its rows fill, in order.

        Asserts that image i owns exactly items[i].num_features placeholder positions.
        """
        runs: list[tuple[int, int]] = []
        start = None
        for i, t in enumerate([*token_ids, -1]):
            if t == self.placeholder_token_id and start is None:
                start = i
            elif t != self.placeholder_token_id and start is not None:
                runs.append((start, i - start))
                start = None
        per_image: list[list[tuple[int, int]]] = []
        queue = list(runs)
        for item in items:
            need, mine = item.num_features, []
            while need > 0:
                if not queue:
                    raise ValueError("the prompt has fewer placeholder tokens than the images' features")
                s, n = queue.pop(0)
                take = min(n, need)
                mine.append((s, take))
                if take < n:
                    queue.insert(0, (s + take, n - take))
                need -= take
            per_image.append(mine)
        if queue:
            raise ValueError("the prompt has more placeholder tokens than the images' features")
        return per_image

    def load_from(self, path: Path) -> None:
        """Copy the vision-side tensors of the checkpoint at `path` into this module (both key layouts); fail when
        one of our parameters (other than `unused_params`) is missing from the checkpoint.

        The tensors come from models.checkpoint's part routing (its VISION and PROJECTOR parts: one name map for the
        project), read one at a time; `weight_prefixes` then place them in this module."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tensors = (t for part in (VISION, PROJECTOR) for t in iter_checkpoint_tensors(path, part=part))
        for name, tensor in tensors:  # stored names; the decoder's tensors are never read
            ours = map_name(name, self.weight_prefixes)
            if ours is None:
                continue
            if ours not in params and ".vision_model." in ours:
                # transformers 5 dropped CLIP/SigLIP's inner `vision_model.` (llava-hf checkpoints still have it).
                ours = ours.replace(".vision_model.", ".", 1)
            for old, new in self.renamed_params if ours not in params else ():
                ours = ours.replace(old, new)
            if ours not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.family} vision encoder")
            p = params[ours]
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(ours)
        missing = sorted(p for p in set(params) - loaded if not any(re.match(o, p) for o in self.unused_params))
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:4]}")


def image_only_processor_class(full: type[transformers.ProcessorMixin]) -> type[transformers.ProcessorMixin]:
    """`full` (SmolVLMProcessor, Qwen2VLProcessor or Qwen2_5_VLProcessor) without its video processor.

    ProcessorMixin finds a processor's parts and init arguments from its `__init__` (signature and code object), so the
    subclass declares the image processor, the tokenizer and full's other arguments, and passes no video processor;
    everything else (token attributes, `__call__`, `replace_image_token`) is full's own code. It keeps full's name, so
    `save_pretrained` writes the real processor class into processor_config.json.
    """
    methods = {}
    if full is transformers.SmolVLMProcessor:

        def __init__(self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None, **kw):
            full.__init__(self, image_processor, tokenizer, None, image_seq_len, chat_template, **kw)

        def apply_chat_template(self, conversation, chat_template=None, **kw):
            # SmolVLM's override only adds video frame defaults read from the video processor.
            return transformers.ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kw)

        methods["apply_chat_template"] = apply_chat_template

    elif full in _QWEN_PROCESSORS:

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
            full.__init__(self, image_processor, tokenizer, None, chat_template, **kw)

    else:
        raise ValueError(f"no image-only variant of {full.__name__}")
    return type(full.__name__, (full,), {"__init__": __init__, "__module__": full.__module__, **methods})


_QWEN_PROCESSORS = (transformers.Qwen2VLProcessor, transformers.Qwen2_5_VLProcessor)  # the same __init__ arguments


def map_name(name: str, prefixes: Sequence[tuple[str, str]]) -> str | None:
    """Rename by the first matching prefix (a regex anchored at the start); None when none matches."""
    for pattern, target in prefixes:
        m = re.match(pattern, name)
        if m:
            return target + name[m.end() :]
    return None
