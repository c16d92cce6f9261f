"""easy-vqa 1.0 (PyPI `easy-vqa`, the `bench` extra) as data of the embedded image model: 64 px images of one circle,
rectangle or triangle in 8 colours, each with about 10 colour, shape and yes/no questions ("is there not a blue
shape?"). Its train split goes into the training mix (benchmarks/train_image_model.py), its test split is scored
(benchmarks/easy_vqa_score.py). 74 % of the test questions are yes/no, a kind the rendered scenes never ask.
"""

from __future__ import annotations

import random

from PIL import Image

from omnivox.benchmarks.image_scenes import Question

SHAPES = ("circle", "rectangle", "triangle")


def answer_type(answer: str) -> str:
    return "yes/no" if answer in ("yes", "no") else "shape" if answer in SHAPES else "colour"


def questions_by_image(split: str) -> tuple[dict[int, list[Question]], dict[int, str]]:
    """({image id: its questions}, {image id: png path}) of the "train" or "test" split."""
    import easy_vqa

    if split == "train":
        (texts, answers, image_ids), paths = easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths()
    else:
        (texts, answers, image_ids), paths = easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths()
    by_image: dict[int, list[Question]] = {}
    for text, answer, image_id in zip(texts, answers, image_ids, strict=True):
        by_image.setdefault(image_id, []).append(Question(answer_type(answer), text, answer))
    return by_image, paths


def train_images(n: int, seed: int) -> tuple[list[Image.Image], list[list[Question]]]:
    """A seeded sample of n train-split images (RGB) and the questions of each."""
    by_image, paths = questions_by_image("train")
    picks = sorted(random.Random(seed).sample(sorted(by_image), min(n, len(by_image))))
    return [Image.open(paths[i]).convert("RGB") for i in picks], [by_image[i] for i in picks]


def sample_turns(questions: list[Question], rng: random.Random, k: int) -> list[Question]:
    """k of an image's questions, distinct texts (one image answers "is there a red shape?" once)."""
    return rng.sample(questions, min(k, len(questions)))
