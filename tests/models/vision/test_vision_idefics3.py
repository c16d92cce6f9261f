"""SmolVLM and Idefics3 vision encoders (tiles + global image, pixel shuffle) against transformers."""

from __future__ import annotations

import pytest
import transformers
from support.vision_checkpoints import make_idefics3, sample_image
from support.vision_parity import (
    check_batch_isolation,
    check_features_and_placeholders,
    check_hub_layout,
    check_keys,
    check_max_pixels,
)

from omnivox.models.vision import VisionEncoder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("idefics3")
    return {"smolvlm": make_idefics3(root / "smolvlm"), "idefics3": make_idefics3(root / "idefics3", smolvlm=False)}


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
def test_idefics3_family(checkpoints, family):
    path = checkpoints[family]
    enc = check_features_and_placeholders(path)
    assert enc.family == family
    assert type(enc.processor).__name__ == ("SmolVLMProcessor" if family == "smolvlm" else "Idefics3Processor")
    check_batch_isolation(enc)
    check_keys(enc, family)
    # The hub, save_pretrained and transformers' modules all name the parts model.vision_model / model.connector /
    # model.text_model: one layout, whose text side must load into our decoder.
    check_hub_layout(path, path, enc)
    check_max_pixels(enc)


def test_tiles_are_separate_placeholder_runs(checkpoints):
    """A split image fills one run per tile (4 rows each here), with text tokens between them."""
    enc = VisionEncoder.from_folder(checkpoints["smolvlm"])
    item = enc.preprocess([sample_image(56, 28)])[0]  # 2 tiles (1 row x 2 cols) + the global image
    ids = enc.expand_prompt([5, enc.marker_token_id, 6], [item])
    runs = enc.feature_runs(ids, [item])[0]
    assert [n for _, n in runs] == [4, 4, 4]
    assert item.num_features == 12
    tok = enc.processor.tokenizer
    assert tok.convert_ids_to_tokens(ids[runs[0][0] - 1]) == "<row_1_col_1>"
    assert tok.convert_ids_to_tokens(ids[runs[-1][0] - 1]) == "<global-img>"


def test_smolvlm_processor_without_torchvision_is_smolvlms_own(checkpoints):
    """Without torchvision the SmolVLM processor is loaded without its video processor; its image path is
    transformers' SmolVLMProcessor code (the class is a subclass that only drops the video part)."""
    enc = VisionEncoder.from_folder(checkpoints["smolvlm"])
    assert isinstance(enc.processor, transformers.SmolVLMProcessor)
    assert enc.processor.image_seq_len == 4
