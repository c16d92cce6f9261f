"""The sampler's host traffic (engine/transfer.py): one device-to-host copy per sampling step, no implicit syncs
(`.item()`, `bool(t)`, a second `.tolist()`), exact round trips, and the engine's logits sampled without a copy.

On the CPU the syncs are counted where Python sees them (Tensor methods); on CUDA (OMNIVOX_TEST_DEVICE=cuda, as
benchmarks/gpu_check.sh runs it) torch's own sync debug mode checks every synchronising call of a sampler step."""

from __future__ import annotations

import pytest
import torch
from support.engines import device_under_test, tiny_checkpoint, tiny_engine
from support.host_reads import count_host_reads, synchronising_calls

from omnivox.engine import SamplingParams
from omnivox.engine.sampler import Sampler
from omnivox.engine.transfer import HostTransfer, take_rows, to_device

V = 300


class _Mask:
    def __init__(self, k: int, device: torch.device) -> None:
        self.mask = (torch.arange(V) % 3 != k).to(device)

    def allowed(self, output_token_ids):
        return self.mask


class _Ids(_Mask):
    def __init__(self, k: int, device: torch.device) -> None:
        super().__init__(k, device)
        self.ids = torch.arange(50 + k, 90 + k * 7, device=device)

    def allowed_ids(self, output_token_ids):
        return self.ids


class _Row:
    """What the sampler reads of a request."""

    def __init__(self, i: int, params: SamplingParams, constraint, device: torch.device) -> None:
        self.request_id = f"r{i}"
        self.params = params
        self.prompt_token_ids = [(7 * i + j) % V for j in range(9)]
        self.output_token_ids = [(11 * i + j) % V for j in range(i % 4)]
        self.eos_token_ids = [2]
        self.constraint = constraint
        self.generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _mixed_batch(device: torch.device) -> list[_Row]:
    """Every feature at once: greedy and sampled, seeded, logprobs with top-N, penalties, bias, bans, a mask row and
    a compacted (allowed_ids) row with penalties."""
    p = SamplingParams
    rows = [
        (p(temperature=0, logprobs=5), None),
        (p(temperature=0.8, top_k=20, top_p=0.9, seed=3), None),
        (p(temperature=1.0, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2), None),
        (p(temperature=0.7, logit_bias={3: 4.0, 8: -2.0}, min_tokens=5, stop_token_ids=[4], logprobs=0), None),
        (p(temperature=0, repetition_penalty=1.2), _Mask(1, device)),
        (p(temperature=1.0, repetition_penalty=1.1, seed=9, logprobs=2), _Ids(2, device)),
        (p(temperature=0), _Ids(0, device)),
        (p(temperature=0, presence_penalty=0.4, logprobs=3), None),
    ]
    return [_Row(i, params, c, device) for i, (params, c) in enumerate(rows)]


def test_one_copy_and_no_other_sync_per_sampler_call(monkeypatch) -> None:
    dev = torch.device("cpu")
    sampler = Sampler(V, dev)
    reqs = _mixed_batch(dev)
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(0))
    calls = count_host_reads(monkeypatch)
    out = sampler(logits, reqs)
    monkeypatch.undo()
    assert calls == {"tolist": 1}  # the one transfer; nothing else read a tensor on the host
    assert sampler.transfer.num_copies == 1
    assert out.failed == [] and len(out.token_ids) == len(reqs)
    assert [len(lp.top) if lp else None for lp in out.logprobs] == [5, None, None, 0, None, 2, None, 3]
    for i in (0, 7):  # greedy rows: the chosen token is the first of the top N, with the same logprob
        lp = out.logprobs[i]
        assert lp.top[0] == (out.token_ids[i], lp.logprob) and [v for _, v in lp.top] == sorted(
            (v for _, v in lp.top), reverse=True
        )
    assert out.token_ids[4] % 3 != 1 and 50 + 2 <= out.token_ids[5] < 90 + 14 and 50 <= out.token_ids[6] < 90
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        if lp is not None:
            assert lp.token_id == tok and isinstance(tok, int) and all(isinstance(t, int) for t, _ in lp.top)


def test_host_transfer_is_exact() -> None:
    ids = torch.tensor([0, 1, 151_935, 2**31 - 1, 2**40 + 3])  # int64 vocabulary ids are exact in float64
    vals = torch.tensor([[-0.0, -1e-30, float("-inf")], [-123.456, 3.4e38, -7.25]])  # float32 logprobs
    got = HostTransfer()([ids, vals])
    assert got[:5] == ids.tolist() and [int(v) for v in got[:5]] == ids.tolist()
    assert got[5:] == vals.flatten().tolist()
    assert HostTransfer()([]) == []


def test_take_rows_and_to_device_on_cpu() -> None:
    t = torch.randn(4, 5)
    assert take_rows(t, [0, 1, 2, 3]) is t  # every row in order: no copy
    sub = take_rows(t, [2, 0])
    assert torch.equal(sub, t[[2, 0]]) and sub.data_ptr() != t.data_ptr()
    cpu = torch.device("cpu")
    assert to_device([1, 2], cpu).dtype == torch.long and to_device([0.5], cpu).dtype == torch.float32
    assert to_device([1, 2], cpu, torch.long).tolist() == [1, 2]
    assert to_device(t, cpu) is t


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tiny_checkpoint(tmp_path_factory.mktemp("transfer"), "llama"))


def test_engine_step_makes_one_copy_and_samples_its_logits_in_place(engine) -> None:
    """Every step that samples makes exactly one device-to-host copy (greedy, sampled, logprobs and penalties in one
    batch), and the outputs equal each request run alone (rows do not leak into each other through the in-place
    writes)."""
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={5: 3.0}, max_tokens=6, ignore_eos=True),
    ]
    prompts = [[20, 21, 22, 23], [30, 31, 32], [40, 41, 42, 43, 44]]
    alone = [engine.generate([p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    copies, steps = engine.core.sampler.transfer.num_copies, engine.core.num_steps
    together = engine.generate(prompts, params)
    assert engine.core.sampler.transfer.num_copies - copies == engine.core.num_steps - steps
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.skipif(device_under_test().type != "cuda", reason="needs OMNIVOX_TEST_DEVICE=cuda (gpu_check.sh)")
def test_cuda_sampler_step_has_no_synchronising_call() -> None:
    """torch's sync debug mode names every call that waits for the GPU; the event wait of HostTransfer is the only
    wait a sampler step may make, and it is not one of them. The tokens equal the CPU sampler's for greedy rows."""
    dev = device_under_test()
    reqs = _mixed_batch(dev)
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(V, dev)
    sampler(logits.to(dev), _mixed_batch(dev))  # warm-up: first-use allocations are not the steady state
    on_device = logits.to(dev)
    with synchronising_calls(dev) as syncs:
        out = sampler(on_device, reqs)
    assert syncs == [], syncs
    cpu = Sampler(V, torch.device("cpu"))(logits.clone(), _mixed_batch(torch.device("cpu")))
    greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
    assert [out.token_ids[i] for i in greedy] == [cpu.token_ids[i] for i in greedy]


def test_engine_samples_the_runners_logits_without_a_copy(engine) -> None:
    """A step whose rows all sample (no drafts) hands the runner's logits tensor itself to the sampler."""
    core = engine.core
    seen: dict[str, list[int]] = {"runner": [], "sampler": []}
    execute, draw = core.runner.execute, core.sampler.draw

    def recording_execute(plan, *args):
        logits, sampling = execute(plan, *args)
        if logits is not None:
            seen["runner"].append(logits.data_ptr())
        return logits, sampling

    def recording_draw(logits, reqs, *args):  # the engine draws, then reads the step's draws in one copy
        seen["sampler"].append(logits.data_ptr())
        return draw(logits, reqs, *args)

    core.runner.execute, core.sampler.draw = recording_execute, recording_draw
    try:
        engine.generate([[20, 21, 22], [30, 31]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        core.runner.execute = execute
        del core.sampler.draw  # the class's method again
    assert seen["sampler"] and seen["sampler"] == seen["runner"]
