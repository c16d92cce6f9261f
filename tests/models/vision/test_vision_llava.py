"""LLaVA 1.5 and LLaVA-NeXT vision encoders against transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from support.vision_checkpoints import make_llava, relayout, sample_image
from support.vision_parity import (
    check_batch_isolation,
    check_features_and_placeholders,
    check_hub_layout,
    check_keys,
    check_max_pixels,
)

VARIANTS = {
    "llava-clip": dict(feature_layer=-2, strategy="default"),
    "llava-siglip-layers": dict(siglip=True, feature_layer=[-3, -1], strategy="full"),  # interleave-qwen-like
    "llava-dinov2": dict(dinov2=True, feature_layer=-1, strategy="default"),  # the embedded image model's layout
    "llava-next": dict(next_=True, feature_layer=-2, strategy="default"),
    # "full" keeps every row: only a tower without CLS (SigLIP) tiles into a square grid.
    "llava-next-siglip-layers": dict(next_=True, siglip=True, feature_layer=[-2, -1], strategy="full"),
}

# save_pretrained writes the llava-hf layout minus CLIP/SigLIP's inner `vision_model.`; the other two layouts:
LAYOUTS = {
    "in-memory": [  # transformers 5's module names
        (r"^language_model\.model\.", "model.language_model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^(vision_tower|multi_modal_projector|image_newline)", r"model.\1"),
    ],
    "llava-hf": [(r"^vision_tower\.", "vision_tower.vision_model.")],  # as published (llava-1.5-7b-hf)
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    return {name: make_llava(root / name, **kw) for name, kw in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llava_family(checkpoints, tmp_path, variant):
    path = checkpoints[variant]
    enc = check_features_and_placeholders(path)
    assert enc.placeholder_token_id == enc.marker_token_id == enc.processor.tokenizer.convert_tokens_to_ids("<image>")
    check_batch_isolation(enc)
    check_keys(enc, variant)
    for name, renames in LAYOUTS.items():
        check_hub_layout(path, relayout(path, tmp_path / name, renames), enc)
    check_max_pixels(enc)


def test_next_unpadding_gives_orientation_dependent_counts(checkpoints):
    """anyres: a wide and a tall image pick different grids and unpad differently (the rows differ by image)."""
    from omnivox.models.vision import VisionEncoder

    enc = VisionEncoder.from_folder(checkpoints["llava-next"])
    wide, tall = enc.preprocess([sample_image(60, 20), sample_image(20, 60)])
    assert wide.num_features != tall.num_features
    assert [f.shape[0] for f in enc.encode([wide, tall])] == [wide.num_features, tall.num_features]
    # The CLIP variant: 16 patches per tile, CLS dropped; base tile then grid rows each ended by image_newline.
    newline = enc.image_newline
    rows = enc.encode([wide])[0]
    assert torch.equal(rows[-1], newline)
