"""Gemma 3 (`Gemma3ForConditionalGeneration`: 4B / 12B / 27B) vision side.

Tower: transformers' SigLIP vision model from `vision_config`; features are its last hidden state (after
post_layernorm; Gemma 3's tower has no pooling head). Projector: transformers' `Gemma3MultiModalProjector` (average
pool of the patch grid down to `mm_tokens_per_image` rows, soft-embedding RMSNorm, one matrix into the text width).

Prompt: the chat template writes `<start_of_image>` (the processor's `image_token`) per image, and the processor
replaces it in the *text* by `processor.full_image_sequence` ("\\n\\n<start_of_image>", `image_seq_length` x
`<image_soft_token>`, "<end_of_image>\\n\\n") before tokenizing: the newlines merge with the
text around them ("user\\n" + "\\n\\n" is one token of three newlines in a BPE vocabulary). So `expand_text` makes the
same replacement in the rendered text with a single `<image_soft_token>`, and `expand_prompt` widens that one token
to the image's rows: the ids equal the processor's.

Attention: transformers lets the tokens of one image see each other both ways during prefill (`token_type_ids`,
`blockwise_overlay`); the service marks the segments `bidirectional` and the engine keeps each inside one prefill
chunk (models/attention.py, engine/scheduler.py). Pan-and-scan (extra crops) is refused at load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from omnivox.models.vision.base import ImageInputs, VisionEncoder


class Gemma3Encoder(VisionEncoder):
    """pixel inputs: `pixel_values` [1, 3, S, S] per image (the processor resizes every image to the tower's size)."""

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
        if getattr(processor.image_processor, "do_pan_and_scan", None):
            raise ValueError(
                "the image processor's do_pan_and_scan true is not supported (Gemma 3 pan-and-scan crops); "
                "set it false in preprocessor_config.json"
            )
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.text_hidden_size = config.text_config.hidden_size
        tok = processor.tokenizer
        self.marker_token = processor.image_token  # <start_of_image>: what the chat template writes
        self.soft_token = tok.image_token  # <image_soft_token>: the rows the features replace
        self.placeholder_token_id = config.image_token_id
        self.marker_token_id = self.placeholder_token_id  # one soft token per image after `expand_text`
        self.reserved_tokens = (tok.eoi_token,)
        self._one_image = processor.full_image_sequence.replace(self.soft_token * processor.image_seq_length, "")
        self._one_image = self._one_image.replace(tok.eoi_token, self.soft_token + tok.eoi_token)

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
        return self.config.mm_tokens_per_image

    def _run_processor(self, im, kwargs: dict) -> ImageInputs:
        item = super()._run_processor(im, kwargs)
        item.placeholder_ids = (self.placeholder_token_id,) * item.num_features
        return item

    def expand_text(self, text: str) -> str:
        return text.replace(self.marker_token, self._one_image)

    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([it.tensors["pixel_values"] for it in items]).to(self.device, self.param_dtype)
        hidden = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state  # [B, patches, vision]
        return list(self.multi_modal_projector(hidden).unbind(0))  # each [mm_tokens_per_image, text_hidden]
