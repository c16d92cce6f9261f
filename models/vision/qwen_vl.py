"""What Qwen2-VL and Qwen2.5-VL share: the processor plumbing (dynamic resolution, one grid per image), the batched
tower call, and M-RoPE positions. Each family file names its tower and the config key of the merger's width.

Both processors resize each image to multiples of patch_size * merge_size within [min_pixels, max_pixels] and cut it
into patches of temporal_patch * patch^2 pixels (a still image is repeated over the temporal patch); the tower's merger
folds merge x merge patches into one text-sized row. All images of a batch go through one forward: attention is
block-diagonal per image (cu_seqlens), so batching changes nothing.

M-RoPE: the decoder's rotary angle of frequency band k uses one of three position rows (temporal, height, width;
`mrope_section` says how many bands each gets). Text tokens have the same position on all three rows, counting on
from the previous token; an image's tokens get (t0, row + s, col + s) with s its start, and the text after it starts
at s + max(rows, cols). So positions run behind token indices: a generated token at index i (0-based in the whole
sequence) sits at position i + delta on all three rows, delta = (last prompt position + 1) - prompt length <= 0.
For images both families' `get_rope_index` compute exactly this (they differ only for videos, which we do not take).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch
import transformers
from PIL import Image
from torch import nn

from omnivox.models.vision.base import ImageInputs, VisionEncoder


class QwenVLEncoder(VisionEncoder):
    """pixel inputs: `pixel_values` [patches, 3 * temporal_patch * patch^2] and `image_grid_thw` [1, 3] per image."""

    weight_prefixes = ((r"(model\.)?visual\.", "visual."),)
    # The vision_config key holding the merger's output width (it must equal the text hidden_size).
    merger_width_key: str

    def __init__(self, config: transformers.PretrainedConfig, processor: transformers.ProcessorMixin) -> None:
        super().__init__()
        self.config = config
        self.processor = processor
        self.visual = self.build_tower(config.vision_config)
        self.merge_size = config.vision_config.spatial_merge_size
        self.text_hidden_size = config.text_config.hidden_size
        width = getattr(config.vision_config, self.merger_width_key)
        if width != self.text_hidden_size:  # the merger's rows replace text embeddings
            raise ValueError(
                f"vision_config.{self.merger_width_key} {width} != the text hidden_size {self.text_hidden_size}"
            )
        self.marker_token = processor.image_token
        self.marker_token_id = processor.tokenizer.convert_tokens_to_ids(self.marker_token)
        self.placeholder_token_id = config.image_token_id
        self.reserved_tokens = (processor.video_token,)

    @staticmethod
    @abstractmethod
    def build_tower(vision_config: transformers.PretrainedConfig) -> nn.Module:
        """transformers' vision transformer of the family (patch embedding, blocks, merger), randomly initialised."""

    def _preprocess_one(self, im: Image.Image, max_pixels: int | None) -> ImageInputs:
        # The processor's own budget: it resizes to at most max_pixels (rounded to the patch grid), never upscaling
        # past what the checkpoint allows and never below its min_pixels.
        kwargs = {}
        if max_pixels is not None:
            size = self.processor.image_processor.size
            budget = max(size["shortest_edge"], min(max_pixels, size["longest_edge"]))
            kwargs["size"] = {"shortest_edge": size["shortest_edge"], "longest_edge": budget}  # min / max pixels
        item = self._run_processor(im, kwargs)
        item.extra["grid_thw"] = tuple(int(x) for x in item.tensors["image_grid_thw"][0])
        return item

    processor_keys = "the image processor's patch_size, merge_size and temporal_patch_size"

    def model_rows(self, item: ImageInputs) -> int:
        vc = self.config.vision_config
        per_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        got = item.tensors["pixel_values"].shape[-1]
        if got != per_patch:
            raise ValueError(
                f"the image processor makes patches of {got} values; the vision tower's patch embedding takes "
                f"{per_patch}: check {self.processor_keys} against vision_config"
            )
        return int(item.tensors["image_grid_thw"].prod()) // self.merge_size**2

    def _encode_batch(self, items: Sequence[ImageInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([it.tensors["pixel_values"] for it in items])  # [sum patches, C*T*P*P]
        pixels = pixels.to(self.device, self.param_dtype)
        grids = torch.cat([it.tensors["image_grid_thw"] for it in items]).to(self.device)  # [n, 3]
        feats = self.visual(pixels, grid_thw=grids).pooler_output  # [sum patches / merge^2, text_hidden]
        return list(feats.split((grids.prod(-1) // self.merge_size**2).tolist()))

    def rope_positions(self, token_ids: Sequence[int], items: Sequence[ImageInputs]) -> tuple[torch.Tensor, int]:
        return mrope_positions(
            token_ids, self.placeholder_token_id, [it.extra["grid_thw"] for it in items], self.merge_size
        )


def mrope_positions(
    token_ids: Sequence[int],
    image_token_id: int,
    image_grids: Sequence[tuple[int, int, int]],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """3-D positions ([3, N] int64) of a prompt with images, and the delta for the tokens generated after it.

    Equal to transformers' `Qwen2VLModel.get_rope_index` and `Qwen2_5_VLModel.get_rope_index` for one unpadded
    sequence of text and images (grid_thw in patches, before merging). Image i takes the next t*h*w/merge^2 image
    tokens; a prompt whose image tokens do not add up to the grids raises ValueError.
    """
    n = len(token_ids)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    pos = torch.empty(3, n, dtype=torch.long)
    grids = iter(image_grids)
    i = cur = 0
    while i < n:
        if ids[i] != image_token_id:
            j = i
            while j < n and ids[j] != image_token_id:
                j += 1
            pos[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        grid = next(grids, None)
        if grid is None:
            raise ValueError("the prompt has more image tokens than the images' grids")
        t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
        count = t * h * w
        if i + count > n or bool((ids[i : i + count] != image_token_id).any()):
            raise ValueError(f"image at token {i} needs {count} image tokens in a row")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos[0, i : i + count] = tt.flatten() + cur  # still images: time_interval 1
        pos[1, i : i + count] = hh.flatten() + cur
        pos[2, i : i + count] = ww.flatten() + cur
        cur += max(h, w)
        i += count
    if next(grids, None) is not None:
        raise ValueError("the prompt has fewer image tokens than the images' grids")
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def mrope_span(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """Positions [3, end - start] of tokens [start, end) of a sequence whose first N tokens are the prompt with
    `prompt_positions` [3, N]: prompt tokens take theirs, later tokens (generated) i + delta on all three rows.

    This is what a runner needs per prefill chunk (any start, e.g. inside an image) and per decode token.
    """
    n = prompt_positions.shape[1]
    parts = []
    if start < n:
        parts.append(prompt_positions[:, start : min(end, n)])
    if end > n:
        parts.append((torch.arange(max(start, n), end) + delta).expand(3, -1))
    return torch.cat(parts, dim=1)
