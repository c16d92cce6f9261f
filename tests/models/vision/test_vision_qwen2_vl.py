"""Qwen2-VL: its tower (LayerNorm, fc1/fc2 MLP, full attention, PatchMerger to vision hidden_size), M-RoPE positions and
our decoder with 3-D positions against transformers; the released config layout (text keys at the top level) reads
the same as the nested one. Load refusals: tests/services/generation/test_vision_sweep_refusals.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.qwen_vl_parity import check_mrope_decoder, check_rope_index
from support.vision_checkpoints import make_qwen2_vl, relayout, sample_image
from support.vision_parity import (
    check_batch_isolation,
    check_features_and_placeholders,
    check_hub_layout,
    check_keys,
    check_max_pixels,
)
from transformers.utils import is_torchvision_available

from omnivox.models.config import ModelConfig, served_families
from omnivox.models.vision import Qwen2VLEncoder, VisionEncoder

# save_pretrained writes the hub layout (visual.*, model.layers.*); transformers 5's module names:
IN_MEMORY = [(r"^visual\.", "model.visual."), (r"^model\.", "model.language_model.")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "ckpt")


@pytest.fixture(scope="module")
def enc(path):
    return VisionEncoder.from_folder(path)


@pytest.fixture(scope="module")
def reference(path):
    return transformers.AutoModelForImageTextToText.from_pretrained(path).eval()


def test_features_placeholders_keys_layouts(path, tmp_path, monkeypatch):
    if not is_torchvision_available():  # the image-only processor directly: the tokenizer is read once, not twice
        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", _not_called)
    enc = check_features_and_placeholders(path)  # tower + merger == transformers' get_image_features
    assert isinstance(enc, Qwen2VLEncoder) and enc.family == "qwen2_vl"
    assert isinstance(enc.visual.merger.ln_q, torch.nn.LayerNorm)  # Qwen2-VL's tower, not 2.5's RMSNorm one
    assert enc.placeholder_token_id == enc.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    check_batch_isolation(enc)
    check_keys(enc, "qwen2-vl")
    check_hub_layout(path, relayout(path, tmp_path / "in-memory", IN_MEMORY), enc)
    check_max_pixels(enc)
    im = sample_image(56, 56)  # 3136 px; the processor's own budget takes max_pixels
    assert enc.preprocess([im], max_pixels=1024)[0].num_features < enc.preprocess([im])[0].num_features


def _not_called(*args, **kwargs):
    raise AssertionError("AutoProcessor.from_pretrained loads the tokenizer, then fails on the video processor")


def test_rope_positions_equal_get_rope_index(enc, reference):
    check_rope_index(enc, reference)


def test_decoder_with_mrope_equals_transformers(path, enc, reference):
    check_mrope_decoder(path, enc, reference)


def test_released_config_layout_reads_as_the_nested_one(path, enc, tmp_path):
    """Qwen/Qwen2-VL-*-Instruct keep the text keys at the top level with rope_scaling {"type": "mrope"}: the same
    decoder config (mrope_section included) and the same features as the transformers 5 layout."""
    released = make_qwen2_vl(tmp_path / "released", released_layout=True)
    nested_cfg = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path))
    released_cfg = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(released))
    assert released_cfg == nested_cfg and released_cfg.family == "qwen2"
    assert released_cfg.hf_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert "'qwen2_vl'" in served_families()  # what a refusal of another model_type lists
    item = enc.preprocess([sample_image(50, 30)])
    torch.testing.assert_close(VisionEncoder.from_folder(released).encode(item)[0], enc.encode(item)[0], atol=0, rtol=0)
