"""Qwen2.5-VL: vision features, M-RoPE positions and our decoder with 3-D positions, against transformers."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.qwen_vl_parity import check_mrope_decoder, check_rope_index
from support.vision_checkpoints import make_qwen2_5_vl, relayout, sample_image
from support.vision_parity import (
    check_batch_isolation,
    check_features_and_placeholders,
    check_hub_layout,
    check_keys,
    check_max_pixels,
)

from omnivox.models.vision import VisionEncoder

# save_pretrained writes the hub layout (visual.*, model.layers.*); transformers 5's module names:
IN_MEMORY = [(r"^visual\.", "model.visual."), (r"^model\.", "model.language_model.")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "ckpt")


@pytest.fixture(scope="module")
def enc(path):
    return VisionEncoder.from_folder(path)


@pytest.fixture(scope="module")
def reference(path):
    return transformers.AutoModelForImageTextToText.from_pretrained(path).eval()


def test_features_placeholders_keys_layouts(path, tmp_path):
    enc = check_features_and_placeholders(path)
    assert enc.placeholder_token_id == enc.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    check_batch_isolation(enc)
    check_keys(enc, "qwen")
    check_hub_layout(path, relayout(path, tmp_path / "in-memory", IN_MEMORY), enc)
    check_max_pixels(enc)
    # max_pixels reaches the processor's own budget: a 56x56 image (3136 px) under 1024 px has fewer tokens.
    im = sample_image(56, 56)
    assert enc.preprocess([im], max_pixels=1024)[0].num_features < enc.preprocess([im])[0].num_features


def test_rope_positions_equal_get_rope_index(enc, reference):
    check_rope_index(enc, reference)


def test_decoder_with_mrope_equals_transformers(path, enc, reference):
    check_mrope_decoder(path, enc, reference)


def test_three_d_positions_need_mrope_config():
    from omnivox.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4), 16, 32)
    with pytest.raises(ValueError, match="mrope_section"):
        rope.tables(torch.zeros(3, 4, dtype=torch.long), torch.float32)
