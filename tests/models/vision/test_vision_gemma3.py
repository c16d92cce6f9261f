"""Gemma 3 vision-language (Gemma3ForConditionalGeneration) on a tiny random checkpoint: the SigLIP tower + pooling
projector against transformers' get_image_features, and served over gRPC against the processor + `generate`.

The served models run 8-token engine steps with 4-token (and 16-token) images behind a 3-token sliding window:
transformers lets an image's tokens see each other both ways during prefill, so a chunk may not end inside one (it is
cut before the image, or grown past the budget to its end), and the window cuts inside an image.
"""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers
from PIL import Image
from support.gemma3_checkpoint import BOI, EOI, IMAGE, make_gemma3
from support.grpc_errors import violated_fields
from support.image_service import STEPS, ask, reference, run
from support.service_harness import ServerThread, nothing_left
from support.vision_checkpoints import png_bytes, relayout, sample_image
from support.vision_parity import check_batch_isolation, check_features_and_placeholders, check_hub_layout, check_keys

from omnivox.engine.params import SamplingParams
from omnivox.engine.request import EmbeddingSegment, Request
from omnivox.engine.scheduler import whole_blocks
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2_grpc

CHUNK = 8
A, B, C = sample_image(50, 30, seed=1), sample_image(30, 50, seed=2), sample_image(40, 40, seed=3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3")


@pytest.fixture(scope="module")
def served(path, tmp_path_factory):
    wide = make_gemma3(tmp_path_factory.mktemp("gemma3") / "wide", mm_tokens=16)  # an image longer than a step
    pas = make_gemma3(tmp_path_factory.mktemp("gemma3") / "pas", pan_and_scan=True)
    specs = [ModelSpec(path=path, name="gemma3"), ModelSpec(path=wide, name="wide"), ModelSpec(path=pas, name="pas")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=CHUNK)) as server:
        yield {
            "server": server,
            "paths": {"gemma3": path, "wide": wide, "pas": pas},
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "refs": {},
        }


def test_tower_and_projector_equal_transformers(path, tmp_path):
    enc = check_features_and_placeholders(path)
    assert enc.bidirectional_images and enc.placeholder_token_id == enc.marker_token_id
    check_batch_isolation(enc)
    check_keys(enc, "gemma3")
    # google/gemma-3-*-it's layout: SigLIP's inner vision_model kept.
    check_hub_layout(path, relayout(path, tmp_path / "hub", [(r"^vision_tower\.", "vision_tower.vision_model.")]), enc)


def test_one_and_two_images_equal_transformers(served):
    for turns in (
        [("user", [A, "What is in this picture?"])],
        [("user", [A, "Compare", B, "with this one."])],
        [("user", [C, "First picture."]), ("assistant", ["A square."]), ("user", ["And now?", B])],
    ):
        got, _, summary = run(served["stub"], ask("gemma3", turns))
        n, want = reference(served, "gemma3", turns)
        assert got == want
        assert summary.usage.prompt_tokens == n
    nothing_left(served["server"], "gemma3")


def test_an_image_longer_than_a_step_is_computed_in_one_chunk(served):
    """16 image tokens under an 8-token step budget: the chunk before the image stops at it, the next one takes the
    whole image (past the budget); the tokens equal transformers'."""
    for turns in ([("user", [A, "What is in this picture?"])], [("user", ["Compare", A, "with", B])]):
        got, _, _ = run(served["stub"], ask("wide", turns))
        assert got == reference(served, "wide", turns)[1]
    nothing_left(served["server"], "wide")


def test_pan_and_scan_crops_equal_transformers(served):
    """A folder whose image processor says do_pan_and_scan: the 50x30 and 30x50 images are each the original plus 2
    crops (3 runs of soft tokens in the processor's sentence), the 40x40 one is not cut; features, ids and greedy
    tokens equal transformers' processor called with the folder's pan-and-scan settings."""
    enc = served["server"].registry.lookup("pas").bundle.vision.encoder
    ref = transformers.AutoModelForImageTextToText.from_pretrained(served["paths"]["pas"]).eval()
    for turns in ([("user", [A, "What is in this picture?"])], [("user", [C, "Compare", B])]):
        ims = [x for _, items in turns for x in items if isinstance(x, Image.Image)]
        messages = [{"role": r, "content": [_part(x) for x in items]} for r, items in turns]
        text = enc.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        batch = enc.processor(text=[text], images=ims, return_tensors="pt", **enc.pan_and_scan)
        items = enc.preprocess(ims)
        assert [it.extra["tower_images"] for it in items] == [3 if im.width != im.height else 1 for im in ims]
        with torch.no_grad():
            want_feats = ref.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output.flatten(0, 1)
            out = ref.generate(**batch, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        torch.testing.assert_close(torch.cat(enc.encode(items)), want_feats, atol=1e-5, rtol=0)
        got, _, summary = run(served["stub"], ask("pas", turns))
        n = batch["input_ids"].shape[1]
        assert summary.usage.prompt_tokens == n
        assert got == out[0, n:].tolist()
    nothing_left(served["server"], "pas")


def _part(x) -> dict:
    return {"type": "image"} if isinstance(x, Image.Image) else {"type": "text", "text": x}


def test_prefix_hit_inside_an_image(served):
    """The prefix cache covers blocks that end inside the image (its keys were computed seeing the whole image); the
    chunk that follows starts there and takes the image's rest whole."""
    bundle = served["server"].registry.lookup("gemma3").bundle
    block = served["server"].engine("gemma3").block_size
    for k in range(2 * block):
        first = [("user", ["x " * k, B, "Where?"])]
        prompt = bundle.prompt_builder.build(ask("gemma3", first).contents)
        prompt.release()
        (seg,) = prompt.segments
        hit = (len(prompt.token_ids) - 3) // block * block  # the question's tokens differ
        if seg.start < hit < seg.end:
            break
    else:
        pytest.skip("no filler puts a block boundary inside the image")
    run(served["stub"], ask("gemma3", first))
    second = [("user", ["x " * k, B, "Why?"])]
    got, _, summary = run(served["stub"], ask("gemma3", second))
    assert summary.usage.cached_prompt_tokens == hit
    assert got == reference(served, "gemma3", second)[1]
    nothing_left(served["server"], "gemma3")


def test_image_tokens_in_user_text_are_invalid_argument(served):
    kv_before = served["server"].wait_kv_free("gemma3")
    for token in (BOI, EOI, IMAGE):
        with pytest.raises(grpc.RpcError) as info:
            run(served["stub"], ask("gemma3", [("user", [A, f"what is {token}?"])]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, token
        assert violated_fields(info.value) == ["contents[0].parts[1].text"], token
    with pytest.raises(grpc.RpcError) as info:
        run(served["stub"], ask("gemma3", [("user", ["Look:", content_pb2.ImagePart(data=b"not an image")])]))
    assert violated_fields(info.value) == ["contents[0].parts[1].image"]
    assert served["server"].wait_kv_free("gemma3") == kv_before
    got, _, _ = run(served["stub"], ask("gemma3", [("user", [A, "Still there?"])]))
    assert got == reference(served, "gemma3", [("user", [A, "Still there?"])])[1]
    nothing_left(served["server"], "gemma3")


def test_max_pixels_refused_where_the_token_count_is_fixed(served):
    """Without pan-and-scan every image is resized to the tower's square (a fixed 4 tokens here): max_pixels would
    only blur it at the same cost (it did), so it is INVALID_ARGUMENT naming the field, before the image is decoded.
    With pan-and-scan the crop count follows the image's size: max_pixels is taken (a 50x30 image is 1 + 2 crops; at
    120 pixels, 14x8, its crops would be narrower than the 8-pixel minimum: none)."""
    small = content_pb2.ImagePart(data=png_bytes(A), max_pixels=900)
    for name in ("gemma3", "wide"):
        with pytest.raises(grpc.RpcError) as info:
            run(served["stub"], ask(name, [("user", ["Look:", small])]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(info.value) == ["contents[0].parts[1].image.max_pixels"]
        assert "only blurred" in info.value.details()
    full = run(served["stub"], ask("pas", [("user", [A, "Size?"])]))[2]
    fewer = content_pb2.ImagePart(data=png_bytes(A), max_pixels=120)
    less = run(served["stub"], ask("pas", [("user", [fewer, "Size?"])]))[2]
    assert less.usage.prompt_tokens < full.usage.prompt_tokens
    nothing_left(served["server"], "gemma3")


def test_a_chunk_never_ends_inside_a_bidirectional_segment():
    """Cut before the image when the chunk starts before it; grown to its end (past the budget) when the chunk
    starts inside it, so the request still progresses; other segments are cut anywhere."""
    seg = EmbeddingSegment.from_embeds(10, torch.zeros(6, 4))
    seg.bidirectional = True
    req = Request("r", list(range(30)), SamplingParams(), max_tokens=4, eos_token_ids=(), segments=[seg])
    assert whole_blocks(req, 0, 12) == 10  # would end inside [10, 16)
    assert whole_blocks(req, 0, 16) == 16 and whole_blocks(req, 0, 10) == 10  # ends at an edge
    assert whole_blocks(req, 10, 4) == 6 and whole_blocks(req, 13, 1) == 3  # starts inside: grown to its end
    seg.bidirectional = False
    assert whole_blocks(req, 0, 12) == 12
