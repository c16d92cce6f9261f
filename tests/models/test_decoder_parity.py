"""Our decoder against transformers' own implementation on tiny random checkpoints saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import load_reference, reference_greedy
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CONFIGS = [
    ("llama", {}),  # 4 heads over 2 KV heads, untied
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # MQA, tied (SmolLM2-like)
    ("llama", {"num_key_value_heads": 4, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),  # MHA, Llama 3.x rope
    ("qwen2", {}),  # q/k/v bias
    ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    ("qwen3", {}),  # q/k norm, head_dim 32 != hidden / heads
    ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": False}),
]

PROMPTS = [[1, 5, 9, 33, 17, 200, 45], [1, 7, 7, 7], list(range(3, 70))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.mark.parametrize(("family", "overrides"), CONFIGS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CONFIGS)])
def test_greedy_tokens_and_logits_match_transformers(root, family, overrides):
    path = tiny_checkpoint(root, family, **overrides)
    engine = tiny_engine(path)
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None  # like ignore_eos: run all steps, mask nothing
    steps = 32
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, theirs = reference_greedy(ref, prompt, steps)
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
        # float32 logits close: our top-5 log-probabilities at every step against transformers' raw logits.
        ours = torch.tensor([[lp for _, lp in step.top] for step in out.logprobs])
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_takes_effect(root):
    """The scaled checkpoint must not silently decode like the unscaled one (a config we ignore would)."""
    plain = tiny_engine(tiny_checkpoint(root, "llama", num_key_value_heads=4, rope_theta=500000.0))
    scaled = tiny_engine(
        tiny_checkpoint(root, "llama", num_key_value_heads=4, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    )
    prompt = list(range(3, 200))
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    a = plain.generate([prompt], p)[0].logprobs[0].top
    b = scaled.generate([prompt], p)[0].logprobs[0].top
    assert a != b


HALF = [("llama", torch.bfloat16), ("llama", torch.float16), ("phi3", torch.float16), ("gemma2", torch.bfloat16),
        ("gemma3", torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("family", "dtype"), HALF, ids=[f"{f}-{str(d)[6:]}" for f, d in HALF])
def test_half_precision_tracks_transformers(root, family, dtype):
    """In half precision the two implementations round differently; each side's chosen token must stay within the
    other's top 5 at every step (the vLLM criterion), over one prompt that both sides decode greedily. Gemma's
    (1 + weight) norms are folded into the weights in the model dtype, transformers adds 1 in float32 each time."""
    path = tiny_checkpoint(root, family)
    engine = tiny_engine(path, dtype=dtype)
    assert engine.runner.kv_caches[0][0].dtype == dtype
    ref = load_reference(path, dtype=dtype)
    ref.generation_config.eos_token_id = None
    prompt = PROMPTS[2]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))[0]
    gen = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=16,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    theirs = gen.sequences[0, len(prompt) :].tolist()
    for step, (ours_tok, their_tok) in enumerate(zip(out.token_ids, theirs, strict=True)):
        if ours_tok != their_tok:  # from here on the contexts differ; the first divergence must be a near-tie
            assert their_tok in [t for t, _ in out.logprobs[step].top]
            assert ours_tok in gen.logits[step][0].topk(5).indices.tolist()
            break
