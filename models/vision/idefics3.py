"""SmolVLM (`SmolVLMForConditionalGeneration`) and Idefics3 (`Idefics3ForConditionalGeneration`) vision sides.

The processor splits an image into a grid of square tiles plus one global (downscaled whole) image; each becomes
`image_seq_len` feature rows after the SigLIP-like tower and the pixel-shuffle connector (a scale_factor^2 fold of
neighbouring patches into channels, then one linear layer). In the prompt each tile's run of `<image>` tokens is
wrapped in text (`<fake_token_around_image><row_1_col_1>`, newlines, `<global-img>`), so one image fills several
placeholder runs: `VisionEncoder.feature_runs` returns them, tile by tile, in the order the rows come out here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from PIL import Image

from omnivox.models.vision.base import ImageInputs, VisionEncoder


class Idefics3Encoder(VisionEncoder):
    """pixel inputs: `pixel_values` [1, tiles, 3, S, S] and `pixel_attention_mask` [1, tiles, S, S] per image."""

    weight_prefixes = (
        (r"(model\.)?vision_model\.", "vision_model."),
        (r"(model\.)?connector\.", "connector."),
    )
    nested_images = True

    def __init__(self, config: transformers.PretrainedConfig, processor: transformers.ProcessorMixin) -> None:
        super().__init__()
        self.family = config.model_type  # "smolvlm" | "idefics3"
        if self.family == "smolvlm":
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector as Connector
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer as Tower
        else:
            from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as Connector
            from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer as Tower
        self.config = config
        self.processor = processor
        self.vision_model = Tower._from_config(config.vision_config)
        self.connector = Connector(config)
        self.patch_size = config.vision_config.patch_size
        self.text_hidden_size = config.text_config.hidden_size
        self.marker_token = processor.image_token
        self.marker_token_id = processor.tokenizer.convert_tokens_to_ids(self.marker_token)
        self.placeholder_token_id = config.image_token_id

    def _preprocess_one(self, im: Image.Image, max_pixels: int | None) -> ImageInputs:
        # The processor scales every image (up or down) to `size.longest_edge` on its long side, then cuts tiles of
        # `max_image_size`: an image shrunk beforehand comes back at full size, as many tiles, only blurred. So
        # max_pixels picks the processor's own resolution instead, as transformers' users do with
        # `size={"longest_edge": k * tile}`: the most tiles whose padded area holds at most max_pixels (one tile
        # at least), never more than the checkpoint's own.
        kwargs = {}
        if max_pixels is not None:
            ip = self.processor.image_processor
            longest, tile = ip.size["longest_edge"], ip.max_image_size["longest_edge"]
            edge = longest_edge_within(im.width, im.height, max_pixels, tile, longest)
            if edge < longest:
                kwargs["size"] = {"longest_edge": edge}
        return self._run_processor(im, kwargs)

    processor_keys = "the processor's image_seq_len and image processor tile size (max_image_size)"

    def model_rows(self, item: ImageInputs) -> int:
        tiles, _, height, width = item.tensors["pixel_values"][0].shape  # [tiles, 3, S, S]
        patches = (height // self.patch_size) * (width // self.patch_size)
        return tiles * (patches // self.config.scale_factor**2)  # the connector folds scale_factor^2 patches

    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        dtype, device = self.param_dtype, self.device
        tiles = [it.tensors["pixel_values"][0] for it in items]  # each [tiles, 3, S, S]
        masks = [it.tensors["pixel_attention_mask"][0].bool() for it in items]  # each [tiles, S, S]
        counts = [t.shape[0] for t in tiles]
        # Tiles of different images can differ in size (an image smaller than one tile is not padded when processed
        # alone): one forward per tile size, rows put back in order afterwards.
        pixels, mask = _cat_groups(tiles), _cat_groups(masks)
        out: list[torch.Tensor | None] = [None] * sum(counts)
        for idx in _groups(pixels):
            pv = torch.stack([pixels[i] for i in idx]).to(device, dtype)  # [n, 3, S, S]
            pm = torch.stack([mask[i] for i in idx]).to(device)  # [n, S, S]
            p = self.patch_size
            patch_mask = pm.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0  # [n, S/p, S/p]
            hidden = self.vision_model(pixel_values=pv, patch_attention_mask=patch_mask, return_dict=True)
            feats = self.connector(hidden.last_hidden_state)  # [n, image_seq_len, text_hidden]
            for i, f in zip(idx, feats, strict=True):
                out[i] = f
        result, start = [], 0
        for n in counts:
            result.append(torch.cat(out[start : start + n]))
            start += n
        return result


def _cat_groups(per_image: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for group in per_image for t in group.unbind(0)]


def _groups(tiles: list[torch.Tensor]) -> list[list[int]]:
    """Indices of the tiles grouped by shape."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(tiles):
        by_shape.setdefault(tuple(t.shape), []).append(i)
    return list(by_shape.values())


def longest_edge_within(width: int, height: int, max_pixels: int, tile: int, longest: int) -> int:
    """The largest long side k * tile (k >= 1, at most `longest`) at which the image, scaled to it and padded up to
    whole tiles on both sides as the Idefics3 processor does, covers at most max_pixels."""
    aspect = min(width, height) / max(width, height)
    best = tile
    for k in range(1, longest // tile + 1):
        edge = k * tile
        short = -(-max(1, round(edge * aspect)) // tile) * tile  # the short side padded up to whole tiles
        if edge * short <= max_pixels:
            best = edge
    return min(best, longest)
