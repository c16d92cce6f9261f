"""Qwen2.5-VL through the engine: image features as segments, M-RoPE positions per request, greedy tokens equal to
transformers' `generate` — with a prefill chunk boundary inside an image and two requests batched."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.vision_checkpoints import make_qwen2_5_vl, sample_image
from support.vision_parity import images, prompt

from omnivox.engine import EmbeddingSegment, Engine, SamplingParams
from omnivox.models.vision import VisionEncoder

STEPS = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("mrope") / "ckpt")


@pytest.fixture(scope="module")
def enc(path):
    return VisionEncoder.from_folder(path)


def request_for(enc: VisionEncoder, ims: list) -> tuple[list[int], list[EmbeddingSegment], tuple[torch.Tensor, int]]:
    """Prompt ids, one segment per feature run (keyed by the image's pixels), and the M-RoPE positions."""
    text = prompt(enc, len(ims))
    items = enc.preprocess(ims)
    ids = enc.expand_prompt(enc.processor.tokenizer(text, add_special_tokens=False).input_ids, items)
    feats = enc.encode(items)
    segments = []
    for i, runs in enumerate(enc.feature_runs(ids, items)):
        offset = 0
        for start, n in runs:
            key = f"{hash(ims[i].tobytes())}-{offset}"  # the content decides prefix-cache hits, not the position
            segments.append(EmbeddingSegment.from_embeds(start, feats[i][offset : offset + n], key=key))
            offset += n
    return ids, segments, enc.rope_positions(ids, items)


def reference_tokens(path, enc: VisionEncoder, ims: list) -> list[int]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    batch = enc.processor(text=[prompt(enc, len(ims))], images=ims, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    return out[0, batch["input_ids"].shape[1] :].tolist()


def test_greedy_tokens_equal_generate_with_chunks_cut_inside_images(path, enc):
    ims_a = images()
    ims_b = [sample_image(40, 40, seed=9)]
    expected_a = reference_tokens(path, enc, ims_a)
    expected_b = reference_tokens(path, enc, ims_b)
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS)
    engine = Engine.from_pretrained(path, device="cpu", kv_cache_gib=0.01, max_num_batched_tokens=7)
    ids_a, segs_a, rope_a = request_for(enc, ims_a)
    ids_b, segs_b, rope_b = request_for(enc, ims_b)
    assert rope_a[1] != 0  # the images make generated positions differ from their index
    assert any(s.start % 7 for s in segs_a)  # 7-token chunks end inside the images
    outs: dict[str, list[int]] = {}
    engine.add_request(ids_a, params, request_id="a", segments=segs_a, rope_positions=rope_a)
    engine.add_request(ids_b, params, request_id="b", segments=segs_b, rope_positions=rope_b)
    engine.add_request([5, 6, 7, 8], params, request_id="text")  # a plain request in the same steps
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert outs["a"] == expected_a
    assert outs["b"] == expected_b
    engine.check_integrity()


def test_without_rope_positions_the_tokens_differ(path, enc):
    """The positions matter: the same request with 1-D positions decodes something else."""
    ims = images()
    ids, segs, rope = request_for(enc, ims)
    engine = Engine.from_pretrained(path, device="cpu", kv_cache_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    with_rope = engine.generate([ids], params, segments=[segs])[0]
    rid = engine.add_request(ids, params, segments=segs, rope_positions=rope)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                mrope = out
    assert [x.logprob for x in mrope.logprobs] != [x.logprob for x in with_rope.logprobs]
