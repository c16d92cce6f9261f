"""Gemma 3 (`Gemma3ForConditionalGeneration`: 4B / 12B / 27B) vision side.

Tower: transformers' SigLIP vision model from `vision_config`; features are its last hidden state (after
post_layernorm; Gemma 3's tower has no pooling head). Projector: transformers' `Gemma3MultiModalProjector` (average
pool of the patch grid down to `mm_tokens_per_image` rows, soft-embedding RMSNorm, one matrix into the text width).
With `do_pan_and_scan` true in the folder's image processor config, an image wider or taller than
`pan_and_scan_min_ratio_to_activate` is also cut into crops, each a tower image of its own: the original's rows come
first, then each crop's. The file's pan-and-scan settings go to every processor call: transformers' `Gemma3Processor`
ignores them otherwise (its own defaults, pan-and-scan off and 256-px crops, override the file's; users pass them per
call), so a folder that asks for pan-and-scan gets it.

Prompt: the chat template writes `<start_of_image>` (the processor's `image_token`) per image, and the processor
replaces it in the *text* (`replace_image_token`: `full_image_sequence`, "\\n\\n<start_of_image>", `image_seq_length`
x `<image_soft_token>`, "<end_of_image>\\n\\n"; with crops, a sentence holding one such sequence per tower image)
before tokenizing: the newlines merge with the text around them ("user\\n" + "\\n\\n" is one token of three newlines
in a BPE vocabulary). So `expand_text` writes the same text with one `<image_soft_token>` per tower image, and
`expand_prompt` widens each to `mm_tokens_per_image` rows: the ids equal the processor's. Each run of soft tokens is
one feature run (one segment).

Attention: transformers lets the tokens of one run see each other both ways during prefill (`token_type_ids`,
`blockwise_overlay`); the service marks the segments `bidirectional` and the engine keeps each inside one prefill
chunk (models/attention.py, engine/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from omnivox.models.vision.base import ImageInputs, VisionEncoder

_PAN_AND_SCAN = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


class Gemma3Encoder(VisionEncoder):
    """pixel inputs: `pixel_values` [1 + crops, 3, S, S] per image (the processor resizes each to the tower's size)."""

    weight_prefixes = (
        (r"(model\.)?vision_tower\.", "vision_tower."),
        (r"(model\.)?multi_modal_projector\.", "multi_modal_projector."),
    )
    unused_params = (r"vision_tower\.head\.",)  # a SigLIP config with vision_use_head: Gemma 3 never pools
    bidirectional_images = True

    def __init__(self, config: transformers.PretrainedConfig, processor: transformers.ProcessorMixin) -> None:
        super().__init__()
        self.family = config.model_type  # "gemma3"
        self.config = config
        self.processor = processor
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.text_hidden_size = config.text_config.hidden_size
        tok = processor.tokenizer
        self.marker_token = processor.image_token  # <start_of_image>: what the chat template writes
        self.soft_token = tok.image_token  # <image_soft_token>: the rows the features replace
        self.placeholder_token_id = config.image_token_id
        self.marker_token_id = self.placeholder_token_id  # one soft token per tower image after `expand_text`
        self.reserved_tokens = (tok.eoi_token,)
        ip = processor.image_processor
        self.pan_and_scan = (
            {k: getattr(ip, k) for k in _PAN_AND_SCAN if getattr(ip, k, None) is not None}
            if getattr(ip, "do_pan_and_scan", None)
            else {}
        )

    @property
    def max_pixels_refusal(self) -> str | None:
        """Every image (and crop) is resized to the tower's square; only pan-and-scan's crop count follows the
        image's size, so max_pixels lowers the token count with pan-and-scan on and nothing without it."""
        if self.pan_and_scan:
            return None
        side, rows = self.config.vision_config.image_size, self.config.mm_tokens_per_image
        return f"Gemma 3 resizes every image to {side}x{side} ({rows} tokens): a smaller one is only blurred"

    processor_keys = "the processor's image_seq_length against the config's mm_tokens_per_image"

    def model_rows(self, item: ImageInputs) -> int:
        vc = self.config.vision_config
        side = vc.image_size // vc.patch_size
        per_side = int(self.config.mm_tokens_per_image**0.5)
        if per_side**2 != self.config.mm_tokens_per_image or side % per_side:
            raise ValueError(
                f"config mm_tokens_per_image {self.config.mm_tokens_per_image} does not pool the {side}x{side} patch "
                "grid (a square whose side divides the grid's)"
            )
        return item.tensors["pixel_values"].shape[0] * self.config.mm_tokens_per_image

    def _run_processor(self, im, kwargs: dict) -> ImageInputs:
        item = super()._run_processor(im, {**self.pan_and_scan, **kwargs})
        crops = item.tensors["pixel_values"].shape[0] - 1
        text = self.processor.replace_image_token({"num_crops": [crops]}, 0)
        item.extra["text"] = text.replace(self.soft_token * self.processor.image_seq_length, self.soft_token)
        item.extra["tower_images"] = crops + 1
        item.placeholder_ids = (self.placeholder_token_id,) * item.num_features
        return item

    def expand_text(self, text: str, items: Sequence[ImageInputs]) -> str:
        pieces = text.split(self.marker_token)
        if len(pieces) != len(items) + 1:  # left as is: expand_prompt reports the mismatch
            return text
        out = [pieces[0]]
        for item, piece in zip(items, pieces[1:], strict=True):
            out += [item.extra["text"], piece]
        return "".join(out)

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ImageInputs]) -> list[int]:
        """Widen each soft token `expand_text` wrote to the rows of one tower image."""
        soft = self.placeholder_token_id
        markers = sum(1 for t in token_ids if t == soft)
        if markers != sum(it.extra["tower_images"] for it in items):
            raise ValueError(f"the prompt has {markers} image markers for {len(items)} images")
        rows = [soft] * self.config.mm_tokens_per_image
        return [r for t in token_ids for r in (rows if t == soft else (t,))]

    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([it.tensors["pixel_values"] for it in items]).to(self.device, self.param_dtype)
        hidden = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state  # [n, patches, vision]
        feats = self.multi_modal_projector(hidden)  # [n, mm_tokens_per_image, text_hidden]
        counts = [it.tensors["pixel_values"].shape[0] for it in items]
        return [f.flatten(0, 1) for f in feats.split(counts)]  # each [(1 + crops) * mm_tokens, text_hidden]
