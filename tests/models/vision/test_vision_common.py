"""The VisionEncoder contract beyond parity: refusals, prompt bookkeeping errors, dtype, keys across loads, and the
image codec feeding an encoder."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.vision_checkpoints import make_llava, png_bytes, sample_image

from omnivox.codecs.image import decode_image, image_content_key
from omnivox.models.vision import VisionEncoder


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava-common") / "ckpt", next_=True)


def test_text_only_checkpoint_has_no_vision_encoder(tmp_path):
    path = make_checkpoint(tmp_path / "llama", "llama", with_tokenizer=False)
    with pytest.raises(ValueError, match="has no vision encoder"):
        VisionEncoder.from_folder(path)


def test_prompt_bookkeeping_errors(llava):
    enc = VisionEncoder.from_folder(llava)
    a, b = enc.preprocess([sample_image(40, 30), sample_image(30, 40)])
    with pytest.raises(ValueError, match="2 image markers for 1 images"):
        enc.expand_prompt([enc.marker_token_id, 5, enc.marker_token_id], [a])
    ids = enc.expand_prompt([7, enc.marker_token_id, 5, enc.marker_token_id], [a, b])
    with pytest.raises(ValueError, match="fewer placeholder"):
        enc.feature_runs(ids[: len(ids) - 3], [a, b])
    with pytest.raises(ValueError, match="more placeholder"):
        enc.feature_runs(ids, [a])
    assert enc.feature_runs(ids, [a, b]) == [[(1, a.num_features)], [(2 + a.num_features, b.num_features)]]
    assert enc.feature_bytes(a) == a.num_features * enc.text_hidden_size * 4


def test_decoded_image_bytes_to_features_and_keys(llava):
    """The service's path: bytes -> decode_image -> preprocess -> encode; keys stable across loads."""
    enc = VisionEncoder.from_folder(llava)
    data = png_bytes(sample_image(44, 33))
    item = enc.preprocess([decode_image(data).image])[0]
    assert enc.encode([item])[0].shape == (item.num_features, enc.text_hidden_size)
    again = VisionEncoder.from_folder(llava)
    assert image_content_key(data, "m", enc.feature_settings()) == image_content_key(
        data, "m", again.feature_settings()
    )


def test_bfloat16_encoder_tracks_float32(llava):
    fp32 = VisionEncoder.from_folder(llava)
    bf16 = VisionEncoder.from_folder(llava, dtype=torch.bfloat16)
    assert fp32.feature_settings() != bf16.feature_settings()  # a different dtype is a different cache key
    item = fp32.preprocess([sample_image(50, 30)])[0]
    a, b = fp32.encode([item])[0], bf16.encode([item])[0]
    assert b.dtype == torch.bfloat16 and b.shape == a.shape
    torch.testing.assert_close(b.float(), a, atol=0.05, rtol=0.05)
