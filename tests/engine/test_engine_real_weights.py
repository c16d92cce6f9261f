"""Real weights: the embedded SmolLM2-135M-Instruct (GGUF) through our own decoder."""

from __future__ import annotations

import pytest

from omnivox.engine import Engine, SamplingParams


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(default_gguf):
    engine = Engine.from_pretrained(default_gguf, device="cpu", kv_cache_gib=0.25)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> is one of the model's end tokens
