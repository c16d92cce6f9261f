"""Vision checkpoints whose processor and model disagree, or whose config cannot make features, are refused at load
naming the keys to check. Served, each failed inside the encoder on every image request (INTERNAL; transformers' own
model fails on them too): LLaVA-NeXT with a SigLIP tower under "default" (15 rows per tile cannot tile a 4x4 grid),
a LLaVA processor counting no CLS row for a CLIP tower or without patch_size (transformers' processor raises a
TypeError on every image; we named nothing), an Idefics3 processor with another image_seq_len, a
Qwen2.5-VL or Qwen2-VL image processor with another merge_size or patch_size, a Gemma 3 processor with another
image_seq_length than mm_tokens_per_image."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.gemma3_checkpoint import make_gemma3
from support.vision_checkpoints import make_qwen2_vl
from support.vision_variants import make_idefics3_variant, make_llava_variant, make_qwen2_5_vl_variant

from omnivox.models.vision import VisionEncoder


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-refusals")
    return {
        "llava": make_llava_variant(root / "llava"),
        "smolvlm": make_idefics3_variant(root / "smolvlm"),
        "qwen": make_qwen2_5_vl_variant(root / "qwen"),
        "qwen2_vl": make_qwen2_vl(root / "qwen2_vl"),
        "gemma3": make_gemma3(root / "gemma3"),
    }


def _edited(base: Path, out: Path, edit) -> Path:
    shutil.copytree(base, out)
    file = out / "processor_config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))
    return out


CASES = {
    "llava-no-cls-row": ("llava", lambda c: c.update(num_additional_image_tokens=0), "num_additional_image_tokens"),
    "smolvlm-image-seq-len": ("smolvlm", lambda c: c.update(image_seq_len=9), "image_seq_len"),
    # llava-hf processor_config.json files before patch_size was added: transformers' processor fails on every image
    "llava-processor-without-patch-size": (
        "llava",
        lambda c: c.pop("patch_size"),
        "processor cannot process.*patch_size",
    ),
    "qwen-merge-size": ("qwen", lambda c: c["image_processor"].update(merge_size=1), "merge_size"),
    "qwen-patch-size": ("qwen", lambda c: c["image_processor"].update(patch_size=8, merge_size=1), "patch_size"),
    "qwen2-vl-merge-size": ("qwen2_vl", lambda c: c["image_processor"].update(merge_size=4), "merge_size"),
    "gemma3-image-seq-length": ("gemma3", lambda c: c.update(image_seq_length=9), "image_seq_length"),
}


NARROW_MERGERS = {  # the merger's width (its rows replace text embeddings) 48, the text hidden_size 64
    "qwen2_5_vl": (lambda out: make_qwen2_5_vl_variant(out, vision=dict(out_hidden_size=48)), "out_hidden_size 48"),
    "qwen2_vl": (lambda out: make_qwen2_vl(out, vision=dict(hidden_size=48)), "vision_config.hidden_size 48"),
}


@pytest.mark.parametrize("family", list(NARROW_MERGERS))
def test_qwen_merger_width_other_than_the_text_width_is_refused(tmp_path, family):
    make, key = NARROW_MERGERS[family]
    with pytest.raises(ValueError, match=key):
        VisionEncoder.from_folder(make(tmp_path / family))


@pytest.mark.parametrize("case", list(CASES))
def test_processor_disagreeing_with_the_model_is_refused_at_load(bases, tmp_path, case):
    family, edit, key = CASES[case]
    VisionEncoder.from_folder(bases[family])  # the unedited checkpoint loads
    with pytest.raises(ValueError, match=key):
        VisionEncoder.from_folder(_edited(bases[family], tmp_path / case, edit))


def test_llava_next_siglip_default_is_refused_naming_the_strategy_over_the_api(tmp_path):
    """Through the server's loading path: the model fails to load with the reason, naming the config key."""
    from support.service_harness import ServerThread

    from omnivox.services.parts.loading import EngineOptions, ModelLoadError, ModelSpec

    path = make_llava_variant(tmp_path / "next-siglip", next_=True, tower="siglip")  # strategy "default"
    server = ServerThread([ModelSpec(path=path, name="next")], EngineOptions(kv_cache_gib=0.01, device="cpu"))
    try:
        with pytest.raises(ModelLoadError, match="vision_feature_select_strategy 'default'"):
            server.__enter__()
    finally:
        server.stop()
