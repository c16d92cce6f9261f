"""Grammar constraints in the engine (engine/structured.py): batch masks in one call per step, batch invariance with
unconstrained and TTS-style rows, rollback, and the finished-grammar rules."""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy as llg_np
import pytest
import torch
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams
from omnivox.engine.params import shared
from omnivox.engine.structured import compile_grammar, grammar_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["x", "yy"]}}},
    "required": ["id", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    eng = tiny_engine(tiny_checkpoint(tmp_path_factory.mktemp("structured")))
    yield eng
    eng.shutdown()


def factory(engine, grammar: str):
    cfg = engine.model_config
    tok = grammar_tokenizer(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    return compile_grammar(tok, grammar, cfg.vocab_size, cfg.eos_token_ids)


class _FramePositions:
    """A TTS-style constraint: only ids 100 + 40k .. 100 + 40k + 39 at frame position k (of 3), named by id."""

    def __init__(self) -> None:
        self.ids = [torch.arange(100 + 40 * k, 140 + 40 * k) for k in range(3)]
        self.masks = [torch.zeros(384, dtype=torch.bool).index_fill_(0, ids, True) for ids in self.ids]

    def allowed(self, output_token_ids):
        return self.masks[len(output_token_ids) % 3]

    def allowed_ids(self, output_token_ids):
        return self.ids[len(output_token_ids) % 3]


def test_mixed_batch_rows_equal_alone(engine, monkeypatch) -> None:
    """Constrained (JSON, regex with logit bias), unconstrained and TTS rows together give each what it gives alone;
    in the batch every grammar mask comes from the one parallel fill per step (no single-row fallback)."""
    json_f = factory(
        engine, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    )
    regex_f = factory(engine, llguidance.LLMatcher.grammar_from_regex("[a-f]{3,12}!"))
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, constraint_factory=json_f),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, constraint_factory=shared(_FramePositions())
        ),
        SamplingParams(temperature=0.8, seed=4, max_tokens=30, logit_bias={ord("a"): 3.0}, constraint_factory=regex_f),
        SamplingParams(temperature=1.0, seed=5, max_tokens=60, constraint_factory=json_f),
    ]
    prompts = ["Hello there", "The capital of", "def main():", "café naïve", "Hello there"]
    alone = [engine.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    singles = []
    real_single = llg_np.fill_next_token_bitmask
    monkeypatch.setattr(llg_np, "fill_next_token_bitmask", lambda *a: (singles.append(1), real_single(*a)))
    together = [o.token_ids for o in engine.generate(prompts, params)]
    assert together == alone
    assert not singles  # the batch filled every grammar row's mask before sampling
    texts = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in together]
    for i in (0, 4):
        obj = json.loads(texts[i])
        assert isinstance(obj["id"], int) and set(obj["tags"]) <= {"x", "yy"}
    assert texts[3].endswith("!") and set(texts[3][:-1]) <= set("abcdef")
    assert all(100 + 40 * (k % 3) <= t < 140 + 40 * (k % 3) for k, t in enumerate(together[2]))
    engine.check_integrity()


def test_advance_rollback_and_finished_grammar(engine) -> None:
    f = factory(engine, llguidance.LLMatcher.grammar_from_regex("ab"))
    c = f()
    tok = engine.tokenizer
    a, b = (tok.encode(s, add_special_tokens=False) for s in ("a", "b"))
    first = c.allowed([]).clone()
    assert first[a[0]] and not c.must_end
    c.advance(a)
    c.advance(b)
    assert c.must_end  # "ab" is complete: nothing but EOS
    eos = engine.model_config.eos_token_ids
    assert set(c.allowed([]).nonzero().flatten().tolist()) == set(eos)
    c.rollback(2)
    assert torch.equal(c.allowed([]), first)
    with pytest.raises(ValueError, match="rejected"):
        c.advance(b)  # "b" cannot start "ab"


def test_mask_after_rollback_and_another_token(engine) -> None:
    """Speculative verification's path: a draft advanced (its mask computed), rolled back, then a different token
    accepted — the mask is the new state's, not the draft's (same token count, different state)."""
    f = factory(engine, llguidance.LLMatcher.grammar_from_regex("(ab|cd)e"))
    tok = engine.tokenizer
    a, c = (tok.encode(s, add_special_tokens=False) for s in ("a", "c"))
    spec, fresh = f(), f()
    spec.allowed([])
    spec.advance(a)
    draft_mask = spec.allowed([]).clone()
    spec.rollback(1)
    spec.advance(c)
    fresh.advance(c)
    assert torch.equal(spec.allowed([]), fresh.allowed([]))
    assert not torch.equal(spec.allowed([]), draft_mask)


def test_finished_grammar_wins_over_min_tokens(engine) -> None:
    f = factory(engine, llguidance.LLMatcher.grammar_from_regex("(yes|no)"))
    out = engine.generate(
        "Hello", SamplingParams(temperature=1.0, seed=0, min_tokens=20, max_tokens=40, constraint_factory=f)
    )[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_realistic_tokenizer_json_and_tool_calls(default_gguf, tmp_path) -> None:
    """SmolLM2's 49 152-token BPE (multi-character tokens, special tokens) under a tiny random decoder: sampled JSON
    validates and a required tool call parses, with the Hermes grammar services/processing/tools.py builds."""
    from support.checkpoints import make_checkpoint

    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.services.output import tool_parser
    from omnivox.services.processing import tool_grammar, tools

    hf = load_tokenizer(default_gguf)
    ckpt = make_checkpoint(
        tmp_path / "smol-tok",
        vocab_size=len(hf),
        hidden_size=32,
        intermediate_size=64,
        with_tokenizer=False,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.eos_token_id,
    )
    hf.save_pretrained(ckpt)
    engine = tiny_engine(ckpt)
    try:
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 12}}}
        json_f = factory(
            engine, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        )
        call = tool_grammar.call_schema(
            tools.HERMES,
            "lookup",
            {
                "type": "object",
                "properties": {"q": {"type": "string", "maxLength": 20}},
                "required": ["q"],
                "additionalProperties": False,
            },
            True,
        )
        tool_f = factory(engine, tool_grammar.grammar(tools.HERMES, [call], tools.REQUIRED, parallel=False))
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, constraint_factory=json_f) for s in range(12)]
        params += [SamplingParams(temperature=1.0, seed=s, max_tokens=80, constraint_factory=tool_f) for s in range(8)]
        outs = engine.generate(["Hello"] * len(params), params)
        for out in outs[:12]:
            assert out.finish_reason == "stop", out.text
            obj = json.loads(out.text)
            assert isinstance(obj["id"], int) and set(obj["tags"]) <= {"x", "yy"}
        for out in outs[12:]:
            assert out.finish_reason == "stop", out.text
            content, calls = tool_parser.parse(out.text, tools.HERMES)
            assert content == "" and len(calls) == 1 and calls[0].complete and calls[0].name == "lookup", out.text
            assert isinstance(json.loads(calls[0].arguments)["q"], str)
        engine.check_integrity()
    finally:
        engine.shutdown()
