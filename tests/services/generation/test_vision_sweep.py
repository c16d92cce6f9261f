"""The vision families under the configs and inputs real checkpoints bring, end to end through gRPC: a real server on
tiny random checkpoints (saved with save_pretrained, processor and chat template included) against transformers'
processor (as its `apply_chat_template(tokenize=True)` tokenizes) + `generate`: prompt length, greedy tokens and
their log-probabilities.

Each served variant stacks several knobs real releases set, so one server covers many (see VARIANTS). Also checked
equal at the model level (features and expanded prompt against `get_image_features` + the processor) when this file
was written, and not repeated here: LLaVA 1.5 vision_feature_layer -1 / -2 / 1 / lists, strategy "full" with CLIP,
SigLIP towers under both strategies, projector_hidden_act silu; NeXT at 1x1, 2x2, 3x500, 31x59, 100x7, 57x29 and
on-pinpoint sizes; Idefics3 scale_factor 4 and images below one tile; Qwen2.5-VL sizes off the 8-px grid, 3x5 / 9x9
(below min_pixels), window_size 8 without full-attention blocks, spatial_merge_size 1, temporal_patch_size 1, and a
processor config in the released preprocessor_config.json form (min_pixels / max_pixels keys). The load-time
refusals are in tests/services/generation/test_vision_sweep_refusals.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageOps
from support.image_service import ask, run
from support.service_harness import ServerThread
from support.vision_checkpoints import make_qwen2_vl, png_bytes, sample_image
from support.vision_variants import (
    LLAVA_HF_TEMPLATE,
    make_idefics3_variant,
    make_llava_variant,
    make_qwen2_5_vl_variant,
)

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

STEPS = 16  # test_service_images.ask asks for 16 greedy tokens


def _legacy_qwen_config(path: Path, rope_type: str = "mrope", **rope: object) -> Path:
    """Rewrite a Qwen2.5-VL config.json as the hub's releases spell it (transformers 4.4x): text keys at the top
    level, `rope_scaling` {"type": "mrope"} (or `rope_type` with `rope`'s keys, as the model card's YaRN recipe)
    with a top-level rope_theta, a disabled 32768 window, `in_chans`."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    text = config.pop("text_config")
    params = text.pop("rope_parameters")
    for key in ("layer_types", "model_type", "dtype"):
        text.pop(key, None)
    vision = config["vision_config"]
    vision.pop("rope_parameters", None)
    vision.pop("model_type", None)
    vision["in_chans"] = vision.pop("in_channels")
    config.pop("dtype", None)
    config.update(text)
    config.update(
        rope_theta=params["rope_theta"],
        rope_scaling={"type": rope_type, "mrope_section": params["mrope_section"], **rope},
        sliding_window=32768,
        use_sliding_window=False,
        max_window_layers=70,
        torch_dtype="float32",
        transformers_version="4.49.0",
    )
    file.write_text(json.dumps(config, indent=1))
    return path


def _llava_hf(out: Path) -> Path:
    # llava-1.5-hf's chat template (no BOS in it, images before the text) with a tokenizer that adds BOS; a Qwen2
    # text side with one KV head and tied embeddings (llava-interleave-qwen-0.5b), features of the last layer.
    return make_llava_variant(
        out,
        template=LLAVA_HF_TEMPLATE,
        add_bos=True,
        text_family="qwen2",
        text=dict(num_key_value_heads=1, tie_word_embeddings=True),
        top=dict(vision_feature_layer=-1),
    )


def _llava_next(out: Path) -> Path:
    # Other pinpoints (1x3, 3x1, 2x2 tiles), two layers concatenated, a projector without bias, an explicit head_dim
    # twice hidden/heads, plain multi-head attention.
    return make_llava_variant(
        out,
        next_=True,
        add_bos=True,
        top=dict(
            image_grid_pinpoints=[[28, 84], [84, 28], [56, 56]],
            vision_feature_layer=[-3, -2],
            multimodal_projector_bias=False,
        ),
        text=dict(head_dim=16, num_key_value_heads=4),
    )


def _idefics3(out: Path) -> Path:
    # Idefics3 itself (not SmolVLM): up to 3x3 tiles, one KV head, tied embeddings.
    return make_idefics3_variant(
        out,
        smolvlm=False,
        image_processor=dict(size={"longest_edge": 84}),
        text=dict(num_key_value_heads=1, tie_word_embeddings=True),
    )


def _smolvlm(out: Path) -> Path:
    # No image splitting, 56-pixel tiles folded by pixel shuffle 4 (SmolVLM-256M's scale factor).
    return make_idefics3_variant(
        out,
        scale_factor=4,
        vision=dict(image_size=56),
        image_processor=dict(do_image_splitting=False, size={"longest_edge": 112}, max_image_size={"longest_edge": 56}),
    )


def _qwen(out: Path) -> Path:
    # The released config layout, tied embeddings (3B), mrope_section [4, 2, 2], rope_theta 1e6, one KV head,
    # windows of 4x4 merged tokens with full attention in blocks 0 and 2, the processor's own pixel range.
    path = make_qwen2_5_vl_variant(
        out,
        top=dict(tie_word_embeddings=True),
        text=dict(
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]},
        ),
        vision=dict(window_size=32, fullatt_block_indexes=[0, 2]),
        image_processor=dict(min_pixels=256, max_pixels=2048),
    )
    return _legacy_qwen_config(path)


def _qwen_yarn(out: Path) -> Path:
    # The model card's long-context recipe on the released layout: rope_scaling {"type": "yarn", "factor": 4,
    # "original_max_position_embeddings", "mrope_section"}; untied, two KV heads for eight query heads.
    path = make_qwen2_5_vl_variant(
        out,
        text=dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, intermediate_size=128),
        vision=dict(out_hidden_size=128),
    )
    return _legacy_qwen_config(path, "yarn", factor=4.0, original_max_position_embeddings=64)


def _qwen2_vl(out: Path) -> Path:
    # Qwen2-VL-2B's shape in the released layout: tied embeddings, mrope_section [4, 2, 2] (2B: [16, 24, 24]), one KV
    # head, rope_theta 1e6; a three-block tower with GELU (not QuickGELU) as its config may say; its own pixel range.
    return make_qwen2_vl(
        out,
        released_layout=True,
        top=dict(tie_word_embeddings=True),
        text=dict(
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]},
        ),
        vision=dict(depth=3, hidden_act="gelu"),
        image_processor=dict(min_pixels=256, max_pixels=2048),
    )


VARIANTS = {"llava-hf": _llava_hf, "llava-next": _llava_next, "idefics3": _idefics3, "smolvlm": _smolvlm,
            "qwen": _qwen, "qwen-yarn": _qwen_yarn, "qwen2-vl": _qwen2_vl}  # fmt: skip

A, B = sample_image(50, 30, seed=1), sample_image(31, 59, seed=2)
WIDE, SLIVER = sample_image(90, 20, seed=3), sample_image(3, 40, seed=4)
ON_PINPOINT = sample_image(84, 28, seed=5)  # exactly LLaVA-NeXT's 3x1 pinpoint: no padding to cut off
CONVERSATIONS = {
    "images-between-text": [("user", ["Compare", A, "with", B, "please."])],
    "same-image-twice-a-sliver-a-pinpoint": [("user", [WIDE, "and again", WIDE, SLIVER, ON_PINPOINT])],
    "image-only-turn-then-text": [("user", [B]), ("assistant", ["Tall."]), ("user", ["Now this:", A])],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-sweep")
    paths = {name: make(root / name) for name, make in VARIANTS.items()}
    specs = [ModelSpec(path=p, name=n) for n, p in paths.items()]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=16)) as server:
        yield {
            "server": server,
            "paths": paths,
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "refs": {},
        }


def reference(s, name: str, turns: list[tuple[str, list]], **processor_kwargs) -> tuple[int, list[int], torch.Tensor]:
    """(prompt length, greedy tokens, their log-probabilities) of transformers for these turns: the checkpoint's processor renders the chat
    template and processes text + images as its `apply_chat_template(tokenize=True)` does (special tokens added
    unless the text starts with BOS), then `generate`. The images go to the processor as given."""
    if name not in s["refs"]:
        path = s["paths"][name]
        processor = s["server"].registry.lookup(name).bundle.vision.processor  # the checkpoint's (image-only) one
        s["refs"][name] = (processor, transformers.AutoModelForImageTextToText.from_pretrained(path).eval())
    processor, model = s["refs"][name]
    messages = [
        {"role": role, "content": [{"type": "text", "text": x} if isinstance(x, str) else {"type": "image"}
                                   for x in items]}
        for role, items in turns
    ]  # fmt: skip
    images = [x for _, items in turns for x in items if not isinstance(x, str)]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = processor.tokenizer.bos_token
    nested = name in ("idefics3", "smolvlm")
    batch = processor(
        text=[text],
        images=[images] if nested else images,
        add_special_tokens=not (bos is not None and text.startswith(bos)),
        return_tensors="pt",
        **processor_kwargs,
    )
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    n = batch["input_ids"].shape[1]
    tokens = out.sequences[0, n:]
    logprobs = torch.stack([torch.log_softmax(x[0].float(), -1)[t] for x, t in zip(out.logits, tokens, strict=True)])
    return n, tokens.tolist(), logprobs


def check(
    s, name: str, turns: list[tuple[str, list]], request_turns: list[tuple[str, list]] | None = None, **processor_kwargs
) -> int:
    """Our server's prompt length, greedy tokens and their log-probabilities equal transformers'. (A tied-embedding
    random model repeats one token whatever it sees; the log-probabilities still depend on every input.)"""
    got, lps, summary = run(s["stub"], ask(name, request_turns or turns, logprobs=True))
    n, want, want_lps = reference(s, name, turns, **processor_kwargs)
    assert (summary.usage.prompt_tokens, got) == (n, want)
    torch.testing.assert_close(torch.tensor(lps), want_lps, atol=2e-4, rtol=0)
    return n


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_equals_transformers(served, name):
    for turns in CONVERSATIONS.values():
        check(served, name, turns)
    free, total = served["server"].wait_kv_free(name)
    assert free == total


def _encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _inputs() -> dict[str, bytes]:
    """Image files as users send them, one per Pillow mode the decoder has to turn into RGB."""
    base = sample_image(44, 28, seed=9)
    rgba = np.array(base.convert("RGBA"))
    rgba[:, :15, 3] = 0  # fully transparent stripe, then a half-transparent one
    rgba[:, 15:25, 3] = 128
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return {
        "rgba-png": _encode(Image.fromarray(rgba), "PNG"),
        "palette-png": _encode(base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16), "PNG"),
        "gray-png": _encode(base.convert("L"), "PNG"),
        "cmyk-jpeg": _encode(base.convert("CMYK"), "JPEG", quality=95),
        "exif-rotated-jpeg": _encode(base, "JPEG", quality=95, exif=exif),
    }


@pytest.mark.parametrize("name", ["qwen", "llava-hf"])
def test_image_modes_equal_transformers_on_the_same_file(served, name):
    """RGBA (composited on white, as the processors' convert_to_rgb), palette, grayscale, CMYK and an EXIF-rotated
    JPEG: the tokens equal transformers' given the same file opened by PIL. The EXIF orientation is applied, as
    transformers' load_image does (the processor alone does not); the rotated image is a different prompt here
    (44x28 -> 28x44), so the check would see it ignored."""
    for data in _inputs().values():
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))  # what transformers' load_image does
        check(served, name, [("user", ["What is it?", image])], [("user", ["What is it?", _part(data)])])


def _part(data: bytes):
    from omnivox.v1 import content_pb2

    return content_pb2.ImagePart(data=data)


def test_idefics3_max_pixels_picks_the_processors_resolution(served):
    """Idefics3 / SmolVLM processors scale every image to `size.longest_edge` (84 px here: 3 tiles on the long side):
    a part's max_pixels used to shrink the image first, which the processor scaled back up (as many tiles, blurred).
    Now it picks the processor's long side (56 px within 56x56 pixels, 28 px within 28x28): fewer image tokens,
    equal to transformers' processor called with that `size`."""
    from omnivox.v1 import content_pb2

    image = sample_image(80, 50, seed=12)
    turns = [("user", ["Size?", image])]
    full = check(served, "idefics3", turns)
    lengths = []
    for max_pixels, edge in ((56 * 56, 56), (28 * 28, 28)):
        part = content_pb2.ImagePart(data=png_bytes(image), max_pixels=max_pixels)
        lengths.append(check(served, "idefics3", turns, [("user", ["Size?", part])], size={"longest_edge": edge}))
    assert full > lengths[0] > lengths[1]
