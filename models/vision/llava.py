"""LLaVA 1.5 (`LlavaForConditionalGeneration`) and LLaVA-NeXT (`LlavaNextForConditionalGeneration`) vision sides.

Tower: transformers' CLIP, SigLIP or DINOv2 vision model built from `vision_config`. Features: the hidden states of
`vision_feature_layer` (an int, or a list whose layers are concatenated along channels), the CLS row dropped under the
"default" strategy, then the two-layer MLP projector. LLaVA-NeXT splits an image into anyres tiles (a base tile of the
whole image first, then a grid chosen from `image_grid_pinpoints`); the grid's features are re-assembled into one
feature map, the padding the resize added is cut off ("unpad"), and `image_newline` ends every row. Rows come out in
the order transformers' `pack_image_features` merges them into the sequence: base tile, then the grid row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from torch import nn
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    image_size_to_num_patches,
    unpad_image,
)

from omnivox.models.vision.base import ImageInputs, VisionEncoder

# DINOv2's attention as the hub (and transformers 5's save_pretrained) spell it -> transformers 5's module names.
DINOV2_HUB_NAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


class LlavaEncoder(VisionEncoder):
    """Vision side of LLaVA 1.5 and LLaVA-NeXT. pixel inputs: `pixel_values` [1, 3, H, W] (1.5) or
    [1, tiles, 3, H, W] with `image_sizes` [1, 2] (NeXT), as the checkpoint's processor makes them."""

    weight_prefixes = (
        (r"(model\.)?vision_tower\.", "vision_tower."),
        (r"(model\.)?multi_modal_projector\.", "multi_modal_projector."),
        (r"(model\.)?image_newline$", "image_newline"),
    )
    renamed_params = DINOV2_HUB_NAMES
    # Features are hidden states of encoder layers: the pooled-output parts of CLIP / SigLIP (and DINOv2's final
    # layernorm and pretraining mask token) are never used.
    unused_params = (
        r"vision_tower\.post_layernorm\.",
        r"vision_tower\.head\.",
        r"vision_tower\.layernorm\.",
        r"vision_tower\.embeddings\.mask_token$",
    )

    def __init__(self, config: transformers.PretrainedConfig, processor: transformers.ProcessorMixin) -> None:
        super().__init__()
        self.family = config.model_type  # "llava" | "llava_next"
        self.config = config
        self.processor = processor
        self.vision_tower = transformers.AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)  # same layers as LlavaNextMultiModalProjector
        self.anyres = config.model_type == "llava_next"
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size)) if self.anyres else None
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not 'default' or 'full'")
        self.text_hidden_size = config.text_config.hidden_size
        self.marker_token = processor.image_token
        self.marker_token_id = processor.tokenizer.convert_tokens_to_ids(self.marker_token)
        self.placeholder_token_id = config.image_token_id
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size  # feature rows per tile side
        # A CLS row ahead of the patch rows: CLIP's class_embedding, DINOv2's cls_token (SigLIP has none).
        has_cls = any(n.endswith(("class_embedding", "cls_token")) for n, _ in self.vision_tower.named_parameters())
        self.rows_per_tile = self.side**2 + has_cls - (self.strategy == "default")
        if self.anyres and self.rows_per_tile != self.side**2:
            raise ValueError(
                f"vision_feature_select_strategy {self.strategy!r} leaves {self.rows_per_tile} feature rows per tile "
                f"of this {vc.model_type} tower; LLaVA-NeXT re-assembles tiles into a {self.side}x{self.side} grid "
                "(a CLIP tower needs 'default', a SigLIP tower 'full')"
            )

    @property
    def max_pixels_refusal(self) -> str | None:
        """LLaVA 1.5's processor resizes and crops every image to one square; NeXT's grid follows the image's size."""
        if self.anyres:
            return None
        side = self.config.vision_config.image_size
        return f"LLaVA 1.5 resizes every image to {side}x{side} ({self.rows_per_tile} tokens): a smaller one is only blurred"

    processor_keys = (
        "the processor's patch_size, num_additional_image_tokens, vision_feature_select_strategy (and NeXT's "
        "image_grid_pinpoints)"
    )

    def model_rows(self, item: ImageInputs) -> int:
        if not self.anyres:
            return self.rows_per_tile
        image_size = item.tensors["image_sizes"][0].tolist()
        grid_h, grid_w = get_anyres_image_grid_shape(
            image_size, self.config.image_grid_pinpoints, self.config.vision_config.image_size
        )
        h, w = unpad_image(torch.empty(1, grid_h * self.side, grid_w * self.side), image_size).shape[1:]
        return self.side**2 + h * (w + 1)  # base tile, then each grid row ended by image_newline

    def _select(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, rows, vision_hidden * L]
        pixels = pixel_values.to(self.device, self.param_dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        hidden = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return hidden[:, 1:] if self.strategy == "default" else hidden

    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        if not self.anyres:
            pixels = torch.cat([it.tensors["pixel_values"] for it in items])  # [B, 3, H, W]
            feats = self.multi_modal_projector(self._select(pixels))  # [B, rows, text_hidden]
            return list(feats.unbind(0))
        counts, tiles = [], []
        for it in items:
            size = it.tensors["image_sizes"][0].tolist()  # (height, width) of the original image
            n = image_size_to_num_patches(size, self.config.image_grid_pinpoints, self.config.vision_config.image_size)
            counts.append(n)
            tiles.append(it.tensors["pixel_values"][0, :n])  # [n, 3, H, W]
        feats = self.multi_modal_projector(self._select(torch.cat(tiles)))  # [sum n, rows, text_hidden]
        return [
            self._pack(f, it.tensors["image_sizes"][0].tolist())
            for f, it in zip(feats.split(counts), items, strict=True)
        ]

    def _pack(self, feats: torch.Tensor, image_size: list[int]) -> torch.Tensor:
        """[tiles, rows, D] of one image -> [features, D]: base tile, then the unpadded grid with a newline per row."""
        newline = self.image_newline.to(feats.dtype)
        if feats.shape[0] == 1:
            return torch.cat((feats[0], newline[None]), dim=0)
        vc, side = self.config.vision_config, self.side
        grid_h, grid_w = get_anyres_image_grid_shape(image_size, self.config.image_grid_pinpoints, vc.image_size)
        grid = feats[1:].view(grid_h, grid_w, side, side, -1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [D, grid_h*side, grid_w*side]
        grid = unpad_image(grid, image_size)
        grid = torch.cat((grid, newline[:, None, None].expand(*grid.shape[:-1], 1)), dim=-1)
        return torch.cat((feats[0], grid.flatten(1, 2).transpose(0, 1)), dim=0)
