"""The embedded image model's training side (benchmarks/train_image_model.py, image_lora.py, image_scenes.py) on tiny
inputs: the held-out scorer asks what each scene shows, and a LoRA trained on the text model is what the assembled
LLaVA folder serves once merged."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import transformers

from omnivox.benchmarks import image_lora, image_scenes
from omnivox.benchmarks.train_image_model import HELD_OUT_SEED, held_out_questions
from omnivox.models.vision.llava_assembly import merge_adapter


def test_held_out_questions_ask_each_type_about_its_own_scene():
    scenes = [shapes for _, shapes in image_scenes.scenes(HELD_OUT_SEED, 120)]
    questions = held_out_questions(scenes, per_kind=40, seed=1)
    kinds = Counter(q.kind for _, q in questions)
    # The old scorer drew one type per scene: 26 colour questions of 150 scenes, whose most common answer (42.3 %)
    # was taken for colour's chance; here every type gets its count and chance is 1 in 5 colours.
    assert kinds == {kind: 40 for kind in image_scenes.QUESTION_TYPES}
    for i, q in questions:
        shapes = scenes[i]
        if q.kind == "colour":  # "What color is the circle?": the colour of that scene's one circle
            kind = q.text.removeprefix("What color is the ").removesuffix("?")
            assert [s.colour for s in shapes if s.kind == kind] == [q.answer]
        if q.kind == "position":
            colour, kind = q.text.removeprefix("Is the ").split(" on the")[0].split()
            (s,) = [s for s in shapes if (s.colour, s.kind) == (colour, kind)]
            assert q.answer == ("left" if s.x < image_scenes.SIDE / 2 else "right")
        assert q.answer in image_scenes.ANSWERS[q.kind]
    assert held_out_questions(scenes, per_kind=40, seed=1) == questions  # seeded
    answers = Counter(q.answer for _, q in questions if q.kind == "colour")
    assert len(answers) == 5 and max(answers.values()) / 40 < 0.4


def test_colours_are_far_apart():
    """No two scene colours that a 112 px resize could blur into one another (the closest pair: red / purple)."""
    rgb = list(image_scenes.COLOURS.values())
    closest = min(
        sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5 for i, a in enumerate(rgb) for b in rgb[i + 1 :]
    )
    assert closest > 100


def test_a_merged_lora_is_the_trained_one():
    """Logits of a tiny Llama with LoRA wrappers (as trained) == the same Llama with the adapter merged into its
    weights by merge_adapter (as the assembled LLaVA folder holds it), after a round trip through adapter_state."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).eval()
    trained = transformers.LlamaForCausalLM(config).eval()
    trained.load_state_dict(plain.state_dict())
    loras = image_lora.add_lora(trained.model, rank=4)
    assert len(loras) == 2 * len(image_lora.LORA_TARGETS)
    with torch.no_grad():
        for lora in loras.values():
            lora.lora_B.normal_(0, 0.05)
    state = image_lora.adapter_state(loras)
    image_lora.load_adapter(loras, state)  # the float16 round trip the file makes, so both sides hold the same values
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(64) for _ in range(12)]])
    with torch.no_grad():
        before = plain(ids).logits
        plain.model.load_state_dict(merge_adapter(plain.model.state_dict(), image_lora.adapter_state(loras)))
        want, got = trained(ids).logits, plain(ids).logits
    assert (want - got).abs().max() < 1e-4
    assert (want - before).abs().max() > 1e-2  # the adapter changed the model (so the test can fail)


# 200 stage-1 steps: colour 37 / 51, shape 49 / 51 on the checked scenes in 27 s (400 steps took 45 s in CI);
# 120 gave colour 31 / 51, too near the 0.6 bound.
STAGE_1_STEPS = 200


@pytest.mark.slow
def test_stage_1_rows_read_as_their_shapes_words():
    """After stage 1 the projected row under a shape's centre is nearest, among the colour words, to its colour's
    token embedding (and among shape words to its shape's), on scenes it was not fitted on (45 fitted, 15 checked).
    At full size (1200 scenes, 2000 steps, half of each batch on shape rows) 96.5 % / 98.3 % of shapes, row norm 2.1;
    the rows of run 2's projector (after stage 2 through the frozen LM): 22 % / 34 % (1 in 5 / 1 in 3), row norm 167
    against the word embeddings' 3.2. Green also with batches drawn uniformly at this size."""
    from omnivox.benchmarks import train_image_model as tim
    from omnivox.models.vision import llava_assembly as la
    from omnivox.services.parts.defaults import ensure_default_model
    from omnivox.services.parts.vision_defaults import ensure_dinov2_folder

    torch.manual_seed(0)
    gguf = ensure_default_model(progress=False)
    table, tok = la.load_token_embeddings(gguf), la.tokenizer_with_image_token(gguf)  # stage 1 needs no LM forward
    dinov2 = transformers.Dinov2Model.from_pretrained(ensure_dinov2_folder(la.IMAGE_SIZE)).eval()
    scenes = image_scenes.scenes(tim.TRAIN_SEED, 60)
    feats = tim.encode_images(dinov2, [im for im, _ in scenes])  # [60, 64, 384]: 8x8 patches (CLS dropped)
    fit, check = 45, scenes[45:]
    flat = feats[:fit].float().reshape(-1, feats.shape[-1])
    projector = tim.Projector(flat.mean(0), flat.std(0) + 1e-4, table.shape[1])
    tim.pretrain_to_words(projector, table, tok, feats[:fit], scenes[:fit], steps=STAGE_1_STEPS)
    table = torch.nn.functional.normalize(table, dim=-1)
    with torch.no_grad():
        rows = torch.nn.functional.normalize(projector(feats[fit:, -64:]), dim=-1)  # [15, 64, D]: the patch rows
    for words, field in ((tuple(image_scenes.COLOURS), "colour"), (image_scenes.SHAPES, "kind")):
        ids = [tok(w, add_special_tokens=False).input_ids[0] for w in words]
        right = total = 0
        for n, (_, shapes) in enumerate(check):
            for s in shapes:
                row = rows[n, int(s.y / image_scenes.SIDE * 8) * 8 + int(s.x / image_scenes.SIDE * 8)]
                right += words[int((table[ids] @ row).argmax())] == getattr(s, field)
                total += 1
        assert right / total > 0.6, (field, right, total)


def test_easy_vqa_train_images_come_with_their_own_questions():
    """The easy-vqa images in the training mix (benchmarks/easy_vqa_data.py) are a seeded sample of the train split,
    each with the questions asked of it, typed as the scorer types them; the test split is never drawn from."""
    pytest.importorskip("easy_vqa")
    from omnivox.benchmarks import easy_vqa_data

    images, questions = easy_vqa_data.train_images(5, seed=35)
    again, same = easy_vqa_data.train_images(5, seed=35)
    assert [q.text for qs in questions for q in qs] == [q.text for qs in same for q in qs]
    assert all(im.mode == "RGB" and im.size == (64, 64) for im in images)
    kinds = Counter(q.kind for qs in questions for q in qs)
    assert set(kinds) <= {"yes/no", "shape", "colour"} and kinds["yes/no"] > 0
    for qs in questions:  # one shape per image: every shape answer of an image names the same shape
        assert len({q.answer for q in qs if q.kind == "shape"}) <= 1
        assert easy_vqa_data.sample_turns(qs, random.Random(0), 5) == easy_vqa_data.sample_turns(
            qs, random.Random(0), 5
        )
    test_ids = set(easy_vqa_data.questions_by_image("test")[1].values())
    train_paths = set(easy_vqa_data.questions_by_image("train")[1].values())
    assert not test_ids & train_paths
