"""Greedy decoding of our engine against transformers' on the same prompts: the prompt sets every decoder-family
test uses (7 to 60 tokens), and `assert_matches` (tokens equal, top-5 logprobs within 1e-4), each prompt alone and all
together."""

from __future__ import annotations

import torch

from omnivox.engine import Engine, SamplingParams
from support.checkpoints import reference_greedy

SHORT, MID, LONG = [1, 5, 9, 33, 17, 200, 45], list(range(5, 23)), list(range(3, 43))  # 7, 18 and 40 tokens


XL = list(range(3, 63))  # 60 tokens: 4 blocks of 16, more than a window of 20 can touch (3)


STEPS = 6


def assert_matches(engine: Engine, ref, prompts, steps: int = STEPS) -> None:
    """Each prompt alone (CPU float32 batch-1 decode: the fused C step) and all together (the torch layers)."""
    ref.generation_config.eos_token_id = None  # like ignore_eos
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    outs = engine.generate(list(prompts), params) + [engine.generate([p], params)[0] for p in prompts]
    for prompt, out in zip(list(prompts) * 2, outs, strict=True):
        tokens, top = reference_greedy(ref, prompt, steps)
        assert out.token_ids == tokens
        ours = torch.tensor([[lp for _, lp in step.top] for step in out.logprobs])
        torch.testing.assert_close(ours, top, atol=1e-4, rtol=1e-4)
