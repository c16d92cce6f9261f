"""The Orpheus audio-token layout: tokens <-> codes, the token constraint, the prompt, layouts as checkpoint data."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.checkpoints import make_checkpoint, make_tokenizer

from omnivox.engine import Engine, SamplingParams, shared
from omnivox.models.orpheus import LAYOUT_FILE, ORPHEUS_LAYOUT, SpeechLayout, SpeechTokenConstraint

ORPHEUS_VOCAB = 156940  # canopylabs/orpheus-3b-0.1-ft config.json vocab_size


def test_orpheus_facts():
    L = ORPHEUS_LAYOUT
    assert L.frame_size == 7
    assert L.audio_token(0, 0) == 128256 + 10  # <custom_token_10>
    # <custom_token_N> = 128256 + N; code = N - 10 - 4096 * (index mod 7)
    for index, n in [
        (0, 10),
        (0, 4105),
        (1, 4106),
        (3, 10 + 3 * 4096 + 77),
        (6, 10 + 6 * 4096 + 4095),
        (9, 10 + 2 * 4096 + 5),
    ]:
        assert L.code_of(128256 + n, index) == n - 10 - 4096 * (index % 7)
    assert L.min_vocab_size == 128256 + 10 + 7 * 4096 <= ORPHEUS_VOCAB
    assert L.prompt_prefix == (128259,) and L.prompt_suffix == (128009, 128260, 128261, 128257)
    assert L.end_of_speech == 128258 and L.start_of_speech == L.prompt_suffix[-1]
    assert (L.temperature, L.top_p, L.repetition_penalty) == (0.6, 0.8, 1.3)
    assert set(L.voices) == {"tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"}


def test_codes_tokens_codes_round_trip():
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 4096, (11, 7), generator=g).tolist()
    tokens = ORPHEUS_LAYOUT.frames_to_tokens(frames)
    assert len(tokens) == 77 and all(128266 <= t < 128266 + 7 * 4096 for t in tokens)
    assert ORPHEUS_LAYOUT.tokens_to_frames(tokens) == frames
    # end of speech stops; a trailing partial frame is dropped
    assert ORPHEUS_LAYOUT.tokens_to_frames([*tokens[:17], ORPHEUS_LAYOUT.end_of_speech]) == frames[:2]
    # a token of the wrong frame position is an error (or the end, when not strict)
    bad = [*tokens[:8], tokens[0], *tokens[9:]]
    with pytest.raises(ValueError, match="frame position 1"):
        ORPHEUS_LAYOUT.tokens_to_frames(bad)
    assert ORPHEUS_LAYOUT.tokens_to_frames(bad, strict=False) == frames[:1]


def test_constraint_admits_exactly_the_codes_of_each_frame_position():
    L = ORPHEUS_LAYOUT
    c = SpeechTokenConstraint(L, ORPHEUS_VOCAB)
    out: list[int] = []
    for n in range(16):
        mask = c.allowed(out)
        assert mask.dtype == torch.bool and mask.shape == (ORPHEUS_VOCAB,)
        k = n % 7
        expected = set(range(128266 + 4096 * k, 128266 + 4096 * (k + 1)))
        if k == 0 and n > 0:
            expected.add(L.end_of_speech)  # end of speech only at a frame boundary, after a frame
        assert set(mask.nonzero().flatten().tolist()) == expected
        assert c.allowed_ids(out).tolist() == sorted(expected)
        lo, hi = c.allowed_span(out)  # the rows the engine projects: every admitted id, 4096 or 4104 of ~157k
        assert lo <= min(expected) and max(expected) < hi and hi - lo <= 4096 + 8
        out.append(128266 + 4096 * k + n)
    # masks are built once and reused
    assert c.allowed([0] * 3) is c.allowed([0] * 10)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeechTokenConstraint(L, 128300)


TINY = SpeechLayout(
    name="tiny",
    prompt_prefix=(7,),
    prompt_suffix=(8, 9),
    start_of_speech=9,
    end_of_speech=10,
    audio_token_base=100,
    codebook_size=30,
    voices=("ann", "bob"),
    default_voice="ann",
)


def test_engine_with_the_constraint_generates_only_valid_frames(tmp_path):
    """The real engine and sampler: every sampled token is an audio token of its frame position."""
    ckpt = make_checkpoint(tmp_path / "m", family="llama", seed=3)
    engine = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    try:
        constraint = SpeechTokenConstraint(TINY, engine.model_config.vocab_size)
        prompts = [TINY.build_prompt(engine.tokenizer, t, v) for t, v in [("Hello there", "ann"), ("Hi", "bob")]]
        params = SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=7 * 6,
            stop_token_ids=[TINY.end_of_speech],
            constraint_factory=shared(constraint),
        )
        outs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    for out in outs:
        tokens = [t for t in out.token_ids if t != TINY.end_of_speech]
        frames = TINY.tokens_to_frames(tokens)  # raises on any misplaced token
        assert len(frames) * 7 == len(tokens) and frames
        if out.token_ids[-1] == TINY.end_of_speech:
            assert (len(out.token_ids) - 1) % 7 == 0


def test_prompt_layout(tmp_path):
    make_tokenizer(tmp_path, 384)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = ORPHEUS_LAYOUT.build_prompt(tok, "Hello there", "leo")
    text_ids = tok("leo: Hello there")["input_ids"]
    assert ids == [128259, *text_ids, 128009, 128260, 128261, 128257]
    assert ORPHEUS_LAYOUT.build_prompt(tok, "Hi") == [128259, *tok("tara: Hi")["input_ids"], *ids[-4:]]
    assert ORPHEUS_LAYOUT.build_prompt(tok, "Hi", "")[1:-4] == tok("Hi")["input_ids"]


def test_layout_is_checkpoint_data(tmp_path):
    assert SpeechLayout.load(tmp_path) is None
    TINY.save(tmp_path)
    assert SpeechLayout.load(tmp_path) == TINY
    assert json.loads((tmp_path / LAYOUT_FILE).read_text())["frame_levels"] == [[0], [1, 4], [2, 3, 5, 6]]
    (tmp_path / LAYOUT_FILE).write_text(json.dumps({"audio_token_bass": 5}))
    with pytest.raises(ValueError, match="audio_token_bass"):
        SpeechLayout.load(tmp_path)
    with pytest.raises(ValueError, match="frame_levels"):
        dataclasses.replace(ORPHEUS_LAYOUT, frame_levels=((0,), (1, 1)))
    with pytest.raises(ValueError, match="end_of_speech"):
        dataclasses.replace(ORPHEUS_LAYOUT, end_of_speech=128266 + 5)
    with pytest.raises(ValueError, match="default_voice"):
        dataclasses.replace(ORPHEUS_LAYOUT, default_voice="nobody")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ORPHEUS_LAYOUT.end_of_speech = 1  # type: ignore[misc]
