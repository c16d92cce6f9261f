"""CSM in the engine: greedy frames == transformers' CsmForConditionalGeneration.generate, frame for frame; seeded
sampled frames reproducible and batch-invariant; the frame's audio == transformers' Mimi decode of it."""

from __future__ import annotations

import pytest
import torch
from support.csm_checkpoints import TINY_CSM_SHAPES, save_tiny_csm
from transformers import CsmForConditionalGeneration

from omnivox.codecs.mimi import MimiDecoder
from omnivox.engine.engine import Engine
from omnivox.engine.params import SamplingParams

TEXTS = ("Hello there.", "A longer sentence, to give this prompt another length.", "Hi", "One, two, three, four.")


@pytest.fixture(scope="module", params=sorted(TINY_CSM_SHAPES))
def csm(request, tmp_path_factory):
    path = save_tiny_csm(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    reference = CsmForConditionalGeneration.from_pretrained(path).eval()
    engine = Engine.from_pretrained(path, max_num_seqs=8)
    return path, reference, engine


def prompt_ids(engine: Engine, text: str, speaker: int = 0) -> list[int]:
    messages = [{"role": str(speaker), "content": [{"type": "text", "text": text}]}]
    return list(engine.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


def reference_frames(reference, ids: list[int], frames: int) -> torch.Tensor:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), do_sample=False, depth_decoder_do_sample=False, max_new_tokens=frames
        )
    return out[0]  # (frames x N)


def test_greedy_frames_equal_transformers(csm):
    _, reference, engine = csm
    n = reference.config.num_codebooks
    prompts = [prompt_ids(engine, t, speaker=i % 2) for i, t in enumerate(TEXTS)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9))  # batched together
    for ids, out in zip(prompts, outs, strict=True):
        got = torch.tensor(out.frames)
        assert got.shape == (9, n) and out.token_ids == got[:, 0].tolist()
        assert torch.equal(got, reference_frames(reference, ids, 9))
    assert len({tuple(map(tuple, o.frames)) for o in outs}) == len(outs)  # the prompts matter
    engine.check_integrity()
    usage = engine.kv_usage()
    assert usage.free_blocks == usage.total_blocks  # every request's blocks back


def test_seeded_frames_are_reproducible_and_batch_invariant(csm):
    _, _, engine = csm
    ids = prompt_ids(engine, TEXTS[0])
    params = SamplingParams(temperature=0.9, top_k=20, seed=1234, max_tokens=8)
    alone = engine.generate([ids], params)[0].frames
    again = engine.generate([ids], params)[0].frames
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=11) for s in (1, 2, 3)]
    batch = engine.generate([prompt_ids(engine, t) for t in TEXTS[1:]] + [ids], [*others, params])
    assert alone == again == batch[-1].frames
    assert engine.generate([ids], SamplingParams(temperature=0.9, top_k=20, seed=99, max_tokens=8))[0].frames != alone
    assert engine.core.frame_step is not None and engine.core.frame_step.sampling.do_sample  # the depth samples too


def test_frames_decode_to_transformers_audio(csm):
    path, reference, engine = csm
    frames = engine.generate([prompt_ids(engine, TEXTS[1])], SamplingParams(temperature=0.0, max_tokens=6))[0].frames
    codec = MimiDecoder.from_folder(path, prefix="codec_model.")
    # (1 x N x T); the special codes past the codec's codebooks (pad, ...) that random weights can emit, clamped
    codes = torch.tensor(frames).T[None].clamp(max=codec.codebook_size - 1)
    with torch.no_grad():
        expected = reference.codec_model.decode(codes).audio_values[:, 0]
    assert expected.abs().max() > 0.05
    torch.testing.assert_close(codec.decode(codes), expected, atol=1e-4, rtol=0)


def test_an_end_frame_stops_the_request_as_transformers_does(csm):
    """With every codebook's logits at zero, argmax gives code 0 = codebook_eos everywhere: the first frame is an end
    frame, and both transformers' generate and the engine stop after it ("stop", the frame kept)."""
    path, _, _ = csm
    reference = CsmForConditionalGeneration.from_pretrained(path).eval()
    engine = Engine.from_pretrained(path, max_num_seqs=2)
    with torch.no_grad():
        for model in (reference, engine.model):
            model.lm_head.weight.zero_()
        reference.depth_decoder.codebooks_head.weight.zero_()
        engine.model.depth_decoder.codebooks_head.zero_()
    ids = prompt_ids(engine, TEXTS[0])
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=9))[0]
    expected = reference_frames(reference, ids, 9)
    assert expected.shape[0] == 1 and out.finish_reason == "stop"
    assert torch.equal(torch.tensor(out.frames), expected)
    engine.check_integrity()
