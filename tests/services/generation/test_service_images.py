"""Image input over gRPC: GenerationService with image parts, served by a real server on tiny random LLaVA 1.5 (CLIP and DINOv2 towers) and NeXT,
SmolVLM, Qwen2.5-VL and Qwen2-VL checkpoints (saved with processor + chat template), against transformers' processor + `generate`.

The server runs with 8-token engine steps, so every image below is cut by at least one prefill chunk boundary.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import threading

import grpc
import pytest
import torch
from PIL import Image
from support.checkpoints import make_checkpoint
from support.grpc_errors import violated_fields
from support.image_service import STEPS, ask, reference, run
from support.service_harness import ServerThread, nothing_left
from support.vision_checkpoints import (
    make_idefics3,
    make_llava,
    make_qwen2_5_vl,
    make_qwen2_vl,
    png_bytes,
    sample_image,
)

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc

CHUNK = 8  # max_num_batched_tokens: smaller than every image's feature rows
MAKERS = {
    "llava": make_llava,
    "llava_dinov2": lambda out: make_llava(out, dinov2=True, feature_layer=-1),  # the embedded image model's layout
    "llava_next": lambda out: make_llava(out, next_=True),  # anyres tiles, unpadding, image_newline
    "smolvlm": make_idefics3,
    "qwen2_5_vl": make_qwen2_5_vl,
    "qwen2_vl": lambda out: make_qwen2_vl(out, released_layout=True),  # config.json as Qwen/Qwen2-VL-* spell it
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    paths = {name: make(tmp_path_factory.mktemp(name) / name) for name, make in MAKERS.items()}
    text = make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-text", family="llama")
    specs = [ModelSpec(path=p, name=n) for n, p in paths.items()] + [ModelSpec(path=text, name="text")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=CHUNK)) as server:
        yield {
            "server": server,
            "paths": paths,
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "refs": {},
        }


A, B, C = sample_image(50, 30, seed=1), sample_image(30, 50, seed=2), sample_image(40, 40, seed=3)


@pytest.mark.parametrize("family", list(MAKERS))
def test_one_and_two_images_equal_transformers(served, family):
    for turns in (
        [("user", [A, "What is in this picture?"])],
        [("user", [A, "Compare", B, "with this one."])],  # two images in one turn
        [("user", [C, "First picture."]), ("assistant", ["A square."]), ("user", ["And now?", B])],  # earlier turn
    ):
        got, _, summary = run(served["stub"], ask(family, turns))
        n, want = reference(served, family, turns)
        assert got == want, f"{family}: {got} != {want}"
        assert summary.usage.prompt_tokens == n
        segments = _segments(served, family, turns)
        assert any(
            s.num_tokens > CHUNK or (s.start % CHUNK and s.num_tokens > 1) for s in segments
        )  # a chunk boundary inside an image
    nothing_left(served["server"], family)


def _prompt(s, family, turns):
    """The prompt the server's builder makes for these turns (its cache references dropped again)."""
    bundle = s["server"].registry.lookup(family).bundle
    prompt = bundle.prompt_builder.build(ask(family, turns).contents)
    prompt.release()
    return prompt


def _segments(s, family, turns):
    return _prompt(s, family, turns).segments


@pytest.mark.parametrize("family", list(MAKERS))
def test_prefix_hit_covering_part_of_an_image(served, family):
    """Same image, then questions differing from their first token: the prefix cache covers the blocks before the
    difference, which (with the filler chosen here) ends inside the image."""
    block = served["server"].engine(family).block_size
    for k in range(block):
        first = [("user", ["x " * k, B, "Where?"])]
        prompt = _prompt(served, family, first)
        segs, prompt_len = prompt.segments, len(prompt.token_ids)
        end = max(s.end for s in segs)
        hit = (end // block) * block  # the first block after the image holds the differing question
        if any(s.start < hit < s.end for s in segs) and prompt_len > end:
            break
    else:
        pytest.skip("no filler puts a block boundary inside the image")
    run(served["stub"], ask(family, first))
    second = [("user", ["x " * k, B, "Why?"])]
    got, _, summary = run(served["stub"], ask(family, second))
    assert summary.usage.cached_prompt_tokens == hit
    assert got == reference(served, family, second)[1]
    nothing_left(served["server"], family)


def test_batch_isolation_different_images_same_text(served):
    family = "qwen2_5_vl"
    ims = [A, B, C, sample_image(24, 56, seed=7)]
    solo = [run(served["stub"], ask(family, [("user", ["Describe it.", im])]))[0] for im in ims]
    with concurrent.futures.ThreadPoolExecutor(len(ims)) as pool:
        batched = list(pool.map(lambda im: run(served["stub"], ask(family, [("user", ["Describe it.", im])]))[0], ims))
    assert batched == solo
    assert len({tuple(t) for t in solo}) > 1  # the images matter
    # One never-seen image asked about by 4 concurrent requests (different questions first, so no prefix hit on it):
    # encoded once, every answer equal to its solo run.
    worker = served["server"].registry.lookup(family).bundle.vision.worker
    shared = sample_image(48, 32, seed=21)
    questions = ["One?", "Two?", "Three?", "Four?"]
    encoded = worker.num_encoded
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: run(served["stub"], ask(family, [("user", [q, shared])]))[0], questions))
    assert worker.num_encoded == encoded + 1
    assert together == [reference(served, family, [("user", [q, shared])])[1] for q in questions]
    nothing_left(served["server"], family)


def test_repeat_eviction_and_re_encode_give_identical_tokens_and_logprobs(served):
    family = "smolvlm"  # several feature runs per image
    vision = served["server"].registry.lookup(family).bundle.vision
    cache, worker = vision.cache, vision.worker

    image = sample_image(44, 36, seed=5)  # seen by no other test

    def turns(q):  # the question first: a new question misses the prefix cache before the image
        return [("user", [q, image])]

    encoded = worker.num_encoded
    first = run(served["stub"], ask(family, turns("One?"), logprobs=True))
    (key,) = {s.key.split(":")[0] for s in _segments(served, family, turns("One?"))}
    features = cache._entries[key].features
    hit = run(served["stub"], ask(family, turns("One?"), logprobs=True))  # the prefix cache covers the image
    two = run(served["stub"], ask(family, turns("Two?"), logprobs=True))  # the encoder cache has it
    assert worker.num_encoded == encoded + 1
    assert hit[0] == first[0] and hit[2].usage.cached_prompt_tokens > 0
    # A prefix hit computes the prompt's tail in other chunk shapes: float32 rounding only (measured 1.2e-6).
    torch.testing.assert_close(torch.tensor(hit[1]), torch.tensor(first[1]), atol=1e-5, rtol=0)
    room = vision.encoder.feature_bytes(vision.encoder.preprocess([A])[0])
    budget, cache.budget_bytes = cache.budget_bytes, room  # room for A's features only: the others are evicted
    evictions = cache.evictions
    run(served["stub"], ask(family, [("user", ["Evict.", A])]))
    cache.budget_bytes = budget
    assert cache.evictions > evictions and key not in cache
    encoded = worker.num_encoded
    three = run(served["stub"], ask(family, turns("Three?"), logprobs=True))  # encoded again
    assert worker.num_encoded == encoded + 1
    assert torch.equal(cache._entries[key].features, features)  # re-encoding gives the same features, bit for bit
    for q, got in (("Two?", two), ("Three?", three)):
        assert got[0] == reference(served, family, turns(q))[1]
    # A transposed image and another max_pixels are other features: other keys.
    keys = {
        s.key.split(":")[0]
        for im in (C, C.transpose(Image.Transpose.TRANSPOSE))
        for s in _segments(served, family, [("user", [im])])
    }
    small = content_pb2.ImagePart(data=png_bytes(C), max_pixels=900)
    keys |= {s.key.split(":")[0] for s in _segments(served, family, [("user", [small])])}
    assert len(keys) == 3
    nothing_left(served["server"], family)


def _encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _png_bomb(size: int = 30_000) -> bytes:
    import struct
    import zlib

    data = bytearray(_encode(Image.new("RGB", (2, 2)), "PNG"))
    ihdr = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return bytes(data)


def _gif_10000_frames() -> bytes:
    frames = [Image.new("RGB", (4, 4), (255, 0, 0))]
    for i in range(1, 10_000):
        f = Image.new("RGB", (4, 4))
        f.putpixel((i % 4, (i // 4) % 4), (255, 255, 255))
        frames.append(f)
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=10)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bad_images_are_invalid_argument_and_the_server_keeps_serving(served):
    stub, family = served["stub"], "llava"
    kv_before = served["server"].wait_kv_free(family)
    bad = {
        "truncated": _encode(A, "PNG")[:60],
        "empty": b"",
        "text": b"What is in this picture? Plain text, not an image.",
        "tiff": _encode(A, "TIFF"),
        "1x1": _encode(Image.new("RGB", (1, 1)), "PNG"),
        "250:1": _encode(Image.new("RGB", (500, 2)), "PNG"),
        "png bomb": _png_bomb(),
        "gif of 10,000 frames": _gif_10000_frames(),
    }
    for name, data in bad.items():
        with pytest.raises(grpc.RpcError) as info:
            run(stub, ask(family, [("user", ["Look:", content_pb2.ImagePart(data=data)])]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        fields = violated_fields(info.value)
        assert len(fields) == 1 and fields[0].startswith("contents[0].parts[1].image"), (name, fields)
    # Every problem of a request at once; the good image in it takes no cache reference.
    with pytest.raises(grpc.RpcError) as info:
        run(stub, ask(family, [("user", [A, content_pb2.ImagePart(data=bad["tiff"]), bad_max_pixels()])]))
    assert violated_fields(info.value) == ["contents[0].parts[1].image", "contents[0].parts[2].image.max_pixels"]
    # Too many images, features above the cache budget, user text spelling the image token, a text-only model.
    with pytest.raises(grpc.RpcError) as info:
        run(stub, ask(family, [("user", [A] * 17)]))
    assert violated_fields(info.value) == ["contents"]
    cache = served["server"].registry.lookup(family).bundle.vision.cache
    budget, cache.budget_bytes = cache.budget_bytes, 100
    try:
        with pytest.raises(grpc.RpcError) as info:
            run(stub, ask(family, [("user", [A, "hi"])]))
        assert violated_fields(info.value) == ["contents[0].parts[0].image"]
    finally:
        cache.budget_bytes = budget
    with pytest.raises(grpc.RpcError) as info:
        run(stub, ask(family, [("user", [A, "what is <image>?"])]))
    assert violated_fields(info.value) == ["contents[0].parts[1].text"]
    with pytest.raises(grpc.RpcError) as info:
        run(stub, ask("text", [("user", [A, "hi"])]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(info.value) == ["contents[0].parts[0].image"]
    assert served["server"].wait_kv_free(family) == kv_before
    nothing_left(served["server"], family)
    got, _, summary = run(stub, ask(family, [("user", [A, "Still there?"])]))
    assert len(got) == STEPS and summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    nothing_left(served["server"], family)


def test_images_past_the_context_are_refused_before_the_rest_are_processed(served):
    """The image that fills the context is named, and the images after it are never decoded or preprocessed."""
    family = "llava"
    bundle = served["server"].registry.lookup(family).bundle
    builder, vision = bundle.prompt_builder, bundle.vision
    per_image = len(vision.encoder.preprocess([A])[0].placeholder_ids)
    assert builder.context_tokens == bundle.engine.model_config.max_model_len
    context, builder.context_tokens = builder.context_tokens, int(per_image * 2.5)  # the third image fills it
    calls: list[int] = []
    preprocess = vision.encoder.preprocess
    vision.encoder.preprocess = lambda images, *a: calls.append(len(images)) or preprocess(images, *a)
    try:
        with pytest.raises(grpc.RpcError) as info:
            run(served["stub"], ask(family, [("user", ["Compare:", *[A, B] * 8])]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(info.value) == ["contents[0].parts[3].image"]
        assert f"{3 * per_image} prompt tokens" in info.value.details()
        assert calls == [1, 1, 1]
    finally:
        builder.context_tokens = context
        del vision.encoder.preprocess
    nothing_left(served["server"], family)


def test_a_request_past_its_pixel_budget_is_refused_before_the_rest_are_decoded(served):
    """`serve --max-request-megapixels`: the image whose header takes the request's pixels past the budget is named
    (with the bad images before it), and neither it nor any image after it is preprocessed (or decoded)."""
    family = "llava"
    vision = served["server"].registry.lookup(family).bundle.vision
    assert vision.limits.max_request_pixels == 48_000_000  # EngineOptions' default reaches the part
    limits, vision.limits = vision.limits, dataclasses.replace(vision.limits, max_request_pixels=4000)
    calls: list[int] = []
    preprocess = vision.encoder.preprocess
    vision.encoder.preprocess = lambda images, *a: calls.append(len(images)) or preprocess(images, *a)
    tiff, garbage = content_pb2.ImagePart(data=_encode(A, "TIFF")), content_pb2.ImagePart(data=b"not an image")
    try:
        with pytest.raises(grpc.RpcError) as info:  # A and B: 3000 pixels; C (40x40) takes the request to 4600
            run(served["stub"], ask(family, [("user", ["Compare:", A, tiff, B, C, garbage])]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(info.value) == ["contents[0].parts[2].image", "contents[0].parts[4].image"]
        assert "are 4600 pixels; the limit is 4000 per request" in info.value.details()
        assert calls == [1, 1]
        nothing_left(served["server"], family)
        got, _, _ = run(served["stub"], ask(family, [("user", [A, B, "Still there?"])]))  # 3000: within it
        assert len(got) == STEPS
    finally:
        vision.limits = limits
        del vision.encoder.preprocess
    nothing_left(served["server"], family)


def bad_max_pixels() -> content_pb2.ImagePart:
    return content_pb2.ImagePart(data=png_bytes(B), max_pixels=10**9)


def test_cancelling_during_encoding_releases_cache_references(served):
    family = "llava"
    vision = served["server"].registry.lookup(family).bundle.vision
    encode = vision.worker.encode_batch

    release, encoded = threading.Event(), threading.Event()

    def slow(items):
        release.wait(30)  # held until the client's deadline has passed
        try:
            return encode(items)
        finally:
            encoded.set()

    vision.worker.encode_batch = slow
    try:
        image = sample_image(36, 44, seed=11)  # never seen: it must be encoded
        with pytest.raises(grpc.RpcError) as info:
            run(served["stub"], ask(family, [("user", [image, "Slow?"])]), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert vision.cache.total_refs() <= 1  # at most the cancelled request's, until the engine drops it
        release.set()
        assert encoded.wait(30)  # the encoding ends; nobody holds the entry (baseline waits for the release)
    finally:
        release.set()
        vision.worker.encode_batch = encode
    nothing_left(served["server"], family)


def test_list_models_shows_image_input(served):
    stub = model_pb2_grpc.ModelServiceStub(served["server"].channel())
    models = {m.name: m for m in stub.ListModels(model_pb2.ListModelsRequest()).models}
    for family in MAKERS:
        assert model_pb2.MODALITY_IMAGE in models[family].input_modalities
    assert model_pb2.MODALITY_IMAGE not in models["text"].input_modalities


def test_cli_ask_with_two_images_streams_the_same_text_as_the_api(served, tmp_path):
    import subprocess
    import sys

    files = []
    for name, im in (("a.png", A), ("b.jpg", B)):
        (tmp_path / name).write_bytes(_encode(im, "PNG" if name.endswith("png") else "JPEG"))
        files += ["--image", str(tmp_path / name)]
    request = ask("qwen2_5_vl", [("user", [A, B, "Compare them."])])
    request.contents[0].parts[1].image.data = (tmp_path / "b.jpg").read_bytes()
    request.max_output_tokens = 8
    request.ignore_eos = False
    want = "".join(r.delta.text for r in served["stub"].Generate(request) if r.HasField("delta"))
    args = ["ask", *files, "Compare them.", "--model", "qwen2_5_vl", "--temperature", "0", "--max-tokens", "8"]
    result = subprocess.run(
        [sys.executable, "-m", "omnivox.services.cli", *args, "--server", served["server"].address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"


@pytest.mark.parametrize("family", ["llava_next", "qwen2_5_vl", "qwen2_vl"])
def test_max_pixels_gives_fewer_image_tokens(served, family):
    """A part's max_pixels scales the image down before the processor: fewer placeholders, still a full answer."""
    big = sample_image(56, 56, seed=31)
    small = content_pb2.ImagePart(data=png_bytes(big), max_pixels=28 * 28)
    full = run(served["stub"], ask(family, [("user", [big, "Size?"])]))[2]
    less = run(served["stub"], ask(family, [("user", [small, "Size?"])]))
    assert less[2].usage.prompt_tokens < full.usage.prompt_tokens
    assert len(less[0]) == STEPS
    nothing_left(served["server"], family)


def test_max_pixels_refused_where_every_image_is_one_size(served):
    """LLaVA 1.5's processor resizes and crops every image to one square (a fixed token count): max_pixels only
    blurred it at the same cost, so it is INVALID_ARGUMENT naming the field; the server keeps serving."""
    small = content_pb2.ImagePart(data=png_bytes(sample_image(56, 56, seed=31)), max_pixels=28 * 28)
    with pytest.raises(grpc.RpcError) as info:
        run(served["stub"], ask("llava", [("user", [small, "Size?"])]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(info.value) == ["contents[0].parts[0].image.max_pixels"]
    assert "LLaVA 1.5 resizes every image" in info.value.details()
    nothing_left(served["server"], "llava")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_edge_images_and_bad_input(served, family):
    """The smallest and the most elongated images the codec takes go through the Qwen processors' resize (a side
    below one merged patch is rounded up to one) and are answered; user text spelling the image or the video token
    (transformers' processor refuses a video pad without a video) and an image that does not decode are
    INVALID_ARGUMENT naming the part; the server keeps serving, nothing held."""
    kv_before = served["server"].wait_kv_free(family)
    for w, h in ((2, 2), (400, 2), (2, 400)):  # 200:1, the codec's limit and the processor's
        got, _, summary = run(served["stub"], ask(family, [("user", [sample_image(w, h, seed=w), "Shape?"])]))
        assert len(got) == STEPS and summary.usage.prompt_tokens > 0, (w, h)
    for parts, field in (
        ([A, "what is <|image_pad|>?"], "contents[0].parts[1].text"),
        (["a video: <|vision_start|><|video_pad|><|vision_end|>", A], "contents[0].parts[0].text"),  # none in the API
        (["Look:", content_pb2.ImagePart(data=png_bytes(A)[:60])], "contents[0].parts[1].image"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            run(served["stub"], ask(family, [("user", parts)]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(info.value) == [field]
    assert served["server"].wait_kv_free(family) == kv_before
    nothing_left(served["server"], family)
