"""Checks every vision family passes against transformers; each test_vision_<family>.py calls them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from omnivox.codecs.image import image_content_key
from omnivox.models.checkpoint import iter_checkpoint_tensors
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel
from omnivox.models.vision import VisionEncoder
from support.vision_checkpoints import png_bytes, reference_features, sample_image

QUESTION = "What is in these pictures?"
ATOL = 1e-5  # float32 parity


def images() -> list:
    """Two images of transposed sizes (and different content)."""
    return [sample_image(50, 30, seed=1), sample_image(30, 50, seed=2)]


def prompt(enc: VisionEncoder, n_images: int) -> str:
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}] + [{"type": "image"}] * (n_images - 1)
    messages = [{"role": "user", "content": content}]
    return enc.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def check_features_and_placeholders(path: Path) -> VisionEncoder:
    """Features of two images equal transformers' get_image_features; the expanded prompt equals the processor's;
    each image's placeholder runs hold exactly its feature rows."""
    enc = VisionEncoder.from_folder(path)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    ims = images()
    text = prompt(enc, len(ims))
    batch, ref_feats = reference_features(ref, enc.processor, ims, text)

    items = enc.preprocess(ims)
    feats = enc.encode(items)
    torch.testing.assert_close(torch.cat(feats), ref_feats, atol=ATOL, rtol=0)

    ids = enc.expand_prompt(
        enc.processor.tokenizer(enc.expand_text(text, items), add_special_tokens=False).input_ids, items
    )
    assert ids == batch["input_ids"][0].tolist()
    runs = enc.feature_runs(ids, items)
    for item, f, image_runs in zip(items, feats, runs, strict=True):
        assert f.shape == (item.num_features, ref.config.text_config.hidden_size)
        assert sum(n for _, n in image_runs) == item.num_features
        assert all(ids[s + k] == enc.placeholder_token_id for s, n in image_runs for k in range(n))
    assert sum(1 for t in ids if t == enc.placeholder_token_id) == sum(it.num_features for it in items)
    return enc


def check_batch_isolation(enc: VisionEncoder) -> None:
    """Images encoded together equal each encoded alone."""
    ims = images() + [sample_image(40, 40, seed=3)]
    items = enc.preprocess(ims)
    together = enc.encode(items)
    for item, f in zip(items, together, strict=True):
        torch.testing.assert_close(f, enc.encode([item])[0], atol=ATOL, rtol=0)


def check_keys(enc: VisionEncoder, model_name: str) -> None:
    a, b = images()[0], images()[0].transpose(0)  # the same picture, transposed
    settings = enc.feature_settings()
    ka = image_content_key(png_bytes(a), model_name, settings)
    assert ka == image_content_key(png_bytes(a), model_name, enc.feature_settings())
    assert ka != image_content_key(png_bytes(b), model_name, settings)
    assert ka != image_content_key(png_bytes(a), model_name, {**settings, "max_pixels": 1000})


def check_hub_layout(path: Path, hub: Path, enc: VisionEncoder) -> None:
    """The hub's key layout loads to the same vision weights, and both layouts give the decoder the same tensors."""
    other = VisionEncoder.from_folder(hub)
    for (name, p), (name2, p2) in zip(enc.state_dict().items(), other.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, p2), name
    ours = dict(iter_checkpoint_tensors(path))  # the decoder's part, renamed to a causal LM's names
    theirs = dict(iter_checkpoint_tensors(hub))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    decoder = DecoderModel(ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path)))
    decoder.load_weights(ours.items())  # fails on a missing or misplaced tensor


def check_max_pixels(enc: VisionEncoder) -> None:
    """A smaller max_pixels gives fewer (or as many) features, and the features still match the placeholders."""
    im = sample_image(56, 56, seed=4)
    full = enc.preprocess([im])[0]
    small = enc.preprocess([im], max_pixels=20 * 20)[0]
    assert small.num_features <= full.num_features
    assert enc.encode([small])[0].shape[0] == small.num_features
