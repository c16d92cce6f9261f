"""Every model call of an engine step runs in inference mode, whatever the caller's grad mode (8e24e58 moved
`@torch.inference_mode()` from ModelRunner.execute to its static-step helper: prefill and Whisper steps then ran
with autograd, and a Whisper step under load raised "Inference tensors cannot be saved for backward")."""

from __future__ import annotations

import torch
from support.engines import tiny_checkpoint, tiny_engine

from omnivox.engine.params import SamplingParams


def test_every_model_call_of_a_step_is_in_inference_mode(tmp_path):
    engine = tiny_engine(tiny_checkpoint(tmp_path, "llama"), static_decode=False, max_num_batched_tokens=8)
    seen: list[bool] = []
    engine.model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_inference_mode_enabled()))
    with torch.enable_grad():  # the engine thread's default
        engine.generate([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert seen and all(seen), seen  # a 20-token prompt in 8-token chunks, then decodes
