"""The dynamic path's host-to-device traffic (engine/transfer.py `DeviceStaging`): every int64 input of a step (token
ids, positions, KV slots, block tables, lengths, prefill tables, embedding rows, logit rows) goes up in one copy,
pinned and non-blocking on CUDA, and the step computes exactly what it computed from one tensor per input."""

from __future__ import annotations

import pytest
import torch
from support.engines import device_under_test, tiny_checkpoint, tiny_engine
from support.host_reads import synchronising_calls

from omnivox.engine import SamplingParams
from omnivox.engine.transfer import DeviceStaging

PROMPTS = [list(range(20, 41)), [30, 31, 32], [40, 41, 42, 43, 44] * 5, list(range(20, 38)) + [99]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
]


def test_parts_come_back_equal_in_their_shapes_from_one_tensor() -> None:
    dev = device_under_test()
    assert DeviceStaging(dev).pack == (dev.type == "cuda")  # on the CPU there is no copy to save
    staging = DeviceStaging(dev, pack=True)
    parts = [
        torch.tensor([7, 8, 9]),
        torch.arange(12).view(3, 4),
        torch.empty(0, dtype=torch.long),
        torch.tensor([2**40 + 1, -1]),
        torch.arange(6).view(2, 1, 3),
    ]
    for _ in range(2):  # the second call reuses the (pinned) buffer
        got = staging(parts)
        assert [g.shape for g in got] == [p.shape for p in parts]
        assert all(g.device.type == dev.type and g.is_contiguous() for g in got)
        assert all(torch.equal(g.cpu(), p) for g, p in zip(got, parts, strict=True))
        assert len({g.untyped_storage().data_ptr() for g in got}) == 1  # views of one tensor: one copy
    assert staging.num_copies == 2 and staging([]) == []
    with pytest.raises(TypeError, match="int64 host tensors"):
        staging([torch.tensor([1.5])])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("staging"), "llama")


def _run(engine) -> list[torch.Tensor]:
    """Every logits tensor the runner returns over a workload of chunked prefills batched with decodes."""
    seen: list[torch.Tensor] = []
    execute = engine.core.runner.execute

    def recording(plan, *args):
        logits, sampling = execute(plan, *args)
        if logits is not None:
            seen.append(logits.cpu().clone())
        return logits, sampling

    engine.core.runner.execute = recording
    try:
        engine.generate(PROMPTS, PARAMS)
        engine.generate(PROMPTS[:2], PARAMS[:2])  # prefix-cache hits: prefills that start past a cached context
    finally:
        engine.core.runner.execute = execute
    return seen


def test_one_copy_per_step_and_the_same_logits_as_one_tensor_per_input(ckpt) -> None:
    packed = tiny_engine(ckpt, max_num_batched_tokens=7, static_decode=False)
    runner = packed.core.runner
    runner.staging = DeviceStaging(runner.device, pack=True)  # the CUDA default, here on any device
    steps = packed.core.num_steps
    got = _run(packed)
    assert runner.staging.num_copies == packed.core.num_steps - steps > len(PROMPTS)

    apart = tiny_engine(ckpt, max_num_batched_tokens=7, static_decode=False)
    apart.core.runner.staging = DeviceStaging(apart.core.runner.device, pack=False)  # one copy per input, as before
    want = _run(apart)
    assert apart.core.runner.staging.num_copies == 0
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(device_under_test().type != "cuda", reason="needs OMNIVOX_TEST_DEVICE=cuda (gpu_check.sh)")
def test_cuda_staging_makes_no_synchronising_call() -> None:
    """torch's sync debug mode names every call that waits for the GPU: staging a step must make none (the event
    wait for the previous copy out of the pinned buffer is not one of them)."""
    dev = device_under_test()
    staging = DeviceStaging(dev)
    parts = [torch.arange(40), torch.arange(64).view(8, 8), torch.tensor([3, 1])]
    staging(parts)  # warm-up: the pinned buffer is allocated once
    with synchronising_calls(dev) as syncs:
        got = staging(parts)
    assert syncs == [], syncs
    assert all(torch.equal(g.cpu(), p) for g, p in zip(got, parts, strict=True))


@pytest.mark.skipif(device_under_test().type != "cuda", reason="needs OMNIVOX_TEST_DEVICE=cuda (gpu_check.sh)")
def test_cuda_dynamic_step_makes_no_synchronising_call(ckpt) -> None:
    """The whole dynamic step (chunked prefills batched with decodes: staging, attention metadata, the forward pass,
    the logit rows) queues its work without waiting for the GPU; the warnings name any call that does."""
    engine = tiny_engine(ckpt, max_num_batched_tokens=7, static_decode=False)
    dev = engine.core.runner.device
    execute = engine.core.runner.execute
    syncs: list[str] = []

    def watched(plan, *args):
        with synchronising_calls(dev) as seen:
            out = execute(plan, *args)
        syncs.extend(seen)
        return out

    engine.generate(PROMPTS, PARAMS)  # warm-up: compiled decode attention, first allocations
    engine.core.runner.execute = watched
    try:
        engine.generate([p[::-1] for p in PROMPTS], PARAMS)
    finally:
        engine.core.runner.execute = execute
    assert syncs == [], sorted(set(syncs))
