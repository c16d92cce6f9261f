"""Image requests over gRPC against transformers: request builders (`ask`, `part_of`), a greedy `run` with logprobs,
and the `reference` prompt and tokens that transformers' processor + `generate` give."""

from __future__ import annotations

import torch
import transformers
from PIL import Image

from omnivox.v1 import content_pb2, generation_pb2, sampling_pb2
from support.vision_checkpoints import png_bytes

STEPS = 16


def part_of(item) -> content_pb2.Part:
    if isinstance(item, str):
        return content_pb2.Part(text=item)
    if isinstance(item, Image.Image):
        return content_pb2.Part(image=content_pb2.ImagePart(data=png_bytes(item)))
    return content_pb2.Part(image=item)  # an ImagePart as is


def ask(model: str, turns: list[tuple[str, list]], logprobs: bool = False) -> generation_pb2.GenerateRequest:
    contents = [content_pb2.Content(role=role, parts=[part_of(x) for x in items]) for role, items in turns]
    request = generation_pb2.GenerateRequest(
        model=model,
        contents=contents,
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=STEPS,
        ignore_eos=True,
    )
    if logprobs:
        request.logprobs = True
    return request


def run(stub, request, timeout: float = 120) -> tuple[list[int], list[float], generation_pb2.GenerateSummary]:
    ids, lps, summary = [], [], None
    for response in stub.Generate(request, timeout=timeout):
        if response.HasField("delta"):
            ids.extend(response.delta.token_ids)
            lps.extend(lp.logprob for lp in response.delta.logprobs)
        else:
            summary = response.summary
    assert summary is not None
    return ids, lps, summary


def reference(s, family: str, turns: list[tuple[str, list]]) -> tuple[int, list[int]]:
    """(prompt length, greedy tokens) of transformers' processor + generate for the same turns."""
    path = s["paths"][family]
    if family not in s["refs"]:
        processor = s["server"].registry.lookup(family).bundle.vision.processor
        model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
        s["refs"][family] = (processor, model)
    processor, model = s["refs"][family]
    messages = [
        {
            "role": role,
            "content": [{"type": "text", "text": x} if isinstance(x, str) else {"type": "image"} for x in items],
        }
        for role, items in turns
    ]
    images = [x for _, items in turns for x in items if isinstance(x, Image.Image)]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    nested = family == "smolvlm"
    batch = processor(text=[text], images=[images] if nested else images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    n = batch["input_ids"].shape[1]
    return n, out[0, n:].tolist()
