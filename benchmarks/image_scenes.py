"""Rendered scenes of coloured shapes (Pillow) and questions answered from each scene's own description: the training
and held-out data of the embedded image model (benchmarks/train_image_model.py). Deterministic per seed.

A scene: 1-5 shapes (circle, square, triangle) in 5 colours and 2 sizes, not overlapping, on a light background.
Question types and their answers (every answer is one word, one SmolLM2 token):
- colour: "What color is the {shape}?" (asked when exactly one shape of that kind is present)
- shape: "What shape is the {colour} object?" (exactly one object of that colour)
- count: "How many shapes are there?" (1-5, uniform over scenes) or "How many {shape}s are there?" (a kind present)
- position: "Is the {colour} {shape} on the left or the right?" (its centre in the outer 40 % of the width)
- size: "Is the {colour} {shape} big or small?"
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SIDE = 224  # rendered size; the image model's processor resizes to its own 112
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 40, 170),
}
SIZES = {"small": 22, "big": 40}  # half-widths in pixels at SIDE (a 112 px input: 11 and 20 px, about one 14 px patch)
SIZE_WORDS = {"small": "small", "big": "big"}
NUMBERS = ("zero", "one", "two", "three", "four", "five")
QUESTION_TYPES = ("colour", "shape", "count", "position", "size")
ANSWERS = {  # every answer a question type can have
    "colour": tuple(COLOURS),
    "shape": SHAPES,
    "count": NUMBERS[1:],
    "position": ("left", "right"),
    "size": tuple(SIZE_WORDS.values()),
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: str
    x: int  # centre, pixels at SIDE
    y: int


@dataclass(frozen=True)
class Question:
    kind: str  # one of QUESTION_TYPES
    text: str
    answer: str


def make_scene(rng: random.Random) -> tuple[list[Shape], tuple[int, int, int]]:
    """1-5 non-overlapping shapes and a light background colour."""
    n = rng.randint(1, 5)
    shapes: list[Shape] = []
    tries = 0
    while len(shapes) < n:
        tries += 1
        if tries > 200:  # the shapes placed so far leave no room (five big ones can): start the layout again
            shapes, tries = [], 0
        size = rng.choice(tuple(SIZES))
        r = SIZES[size]
        x, y = rng.randint(r + 2, SIDE - r - 3), rng.randint(r + 2, SIDE - r - 3)
        if all(abs(x - s.x) > r + SIZES[s.size] + 4 or abs(y - s.y) > r + SIZES[s.size] + 4 for s in shapes):
            shapes.append(Shape(rng.choice(SHAPES), rng.choice(tuple(COLOURS)), size, x, y))
    background = tuple(rng.randint(225, 255) for _ in range(3))
    return shapes, background


def render(shapes: list[Shape], background: tuple[int, int, int]) -> Image.Image:
    im = Image.new("RGB", (SIDE, SIDE), background)
    draw = ImageDraw.Draw(im)
    for s in shapes:
        r, fill = SIZES[s.size], COLOURS[s.colour]
        box = (s.x - r, s.y - r, s.x + r, s.y + r)
        if s.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif s.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(s.x, s.y - r), (s.x - r, s.y + r), (s.x + r, s.y + r)], fill=fill)
    return im


def questions(shapes: list[Shape]) -> list[Question]:
    """Every well-defined question about the scene, one or more per type where the scene allows."""
    out = [Question("count", "How many shapes are there?", NUMBERS[len(shapes)])]
    kinds = [s.kind for s in shapes]
    colours = [s.colour for s in shapes]
    for kind in sorted(set(kinds)):
        out.append(Question("count", f"How many {kind}s are there?", NUMBERS[kinds.count(kind)]))
        if kinds.count(kind) == 1:
            (s,) = [s for s in shapes if s.kind == kind]
            out.append(Question("colour", f"What color is the {kind}?", s.colour))
    for s in shapes:
        if colours.count(s.colour) == 1:
            out.append(Question("shape", f"What shape is the {s.colour} object?", s.kind))
        if sum(1 for t in shapes if (t.kind, t.colour) == (s.kind, s.colour)) == 1:
            name = f"{s.colour} {s.kind}"
            out.append(Question("size", f"Is the {name} big or small?", SIZE_WORDS[s.size]))
            if s.x < 0.4 * SIDE or s.x > 0.6 * SIDE:
                side = "left" if s.x < SIDE / 2 else "right"
                out.append(Question("position", f"Is the {name} on the left or the right?", side))
    return out


def sample_questions(shapes: list[Shape], rng: random.Random, k: int) -> list[Question]:
    """Up to k questions of different types where possible (a type drawn first, then one of its questions)."""
    by_type: dict[str, list[Question]] = {}
    for q in questions(shapes):
        by_type.setdefault(q.kind, []).append(q)
    types = list(by_type)
    rng.shuffle(types)
    return [rng.choice(by_type[t]) for t in types[:k]]


def scenes(seed: int, n: int) -> list[tuple[Image.Image, list[Shape]]]:
    """n rendered scenes of the generator seeded with `seed` (the training uses one seed, the held-out score another)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shapes, background = make_scene(rng)
        out.append((render(shapes, background), shapes))
    return out
