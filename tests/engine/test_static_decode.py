"""The static decode path built at load: every bucket before the first step, none after, bounded buckets, and the
one-copy staging buffer (pinned on CUDA) equal to the per-tensor staging it replaced."""

from __future__ import annotations

import pytest
import torch
from support.engines import device_under_test, tiny_checkpoint, tiny_engine

from omnivox.engine import SamplingParams
from omnivox.engine.loading import profile_activation_bytes
from omnivox.engine.static_decode import DEFAULT_MAX_GRAPH_BLOCKS, block_buckets


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("static"), "llama")


@pytest.fixture(scope="module")
def static_engine(ckpt):
    return tiny_engine(ckpt, static_decode=True, max_num_seqs=8)


def test_every_bucket_built_at_load_largest_first(static_engine):
    static = static_engine.runner.static
    assert static.frozen and static_engine.num_steps == 0  # built in the constructor, before any step
    assert static.built == set(static.buckets())
    assert static.buckets()[0] == (8, 32)  # largest first: the graph pool is sized once, by the largest
    assert static.batch_buckets == [1, 2, 4, 8] and static.block_buckets == [1, 2, 4, 8, 16, 32]  # 512 / 16 blocks
    assert static.use_graphs == (static.device.type == "cuda")
    if static.use_graphs:
        assert set(static.graphs) == static.built


def test_no_bucket_built_while_serving(static_engine):
    static = static_engine.runner.static
    static.built.discard((1, 1))
    try:
        with pytest.raises(RuntimeError, match="not built at load"):
            static.run([5], [3], [[0]])
    finally:
        static.built.add((1, 1))
    out = static_engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and static.num_runs >= 3


def test_bucket_list_is_bounded():
    assert block_buckets(131072 // 16)[-1] == DEFAULT_MAX_GRAPH_BLOCKS  # not max_model_len / 16 blocks
    assert block_buckets(8) == [1, 2, 4, 8] and block_buckets(5) == [1, 2, 4, 5] and block_buckets(1) == [1]
    assert block_buckets(10_000, max_graph_blocks=64)[-1] == 64


def test_long_context_runs_on_the_dynamic_path(ckpt):
    engine = tiny_engine(ckpt, static_decode=True, max_num_seqs=2)
    engine.runner.static.block_buckets = [1, 2]  # pretend the graphs stop at 32 tokens of context
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(5, 45))  # 40 tokens: past the last bucket
    assert not engine.runner.static.fits(1, len(prompt) + 1)
    before = engine.runner.static.num_runs
    static_tokens = engine.generate([prompt], params)[0].token_ids
    assert engine.runner.static.num_runs == before
    assert static_tokens == tiny_engine(ckpt).generate([prompt], params)[0].token_ids


def _reference_staging(static, token_ids, positions, block_tables, batch, blocks):
    """The staging the one-buffer copy replaced: one tensor per buffer, padded rows on the scratch block."""
    n, bs, scratch = len(token_ids), static.block_size, static.scratch_block
    table = torch.full((batch, blocks), scratch, dtype=torch.long)
    for i, bt in enumerate(block_tables):
        k = min(len(bt), blocks)
        table[i, :k] = torch.tensor(bt[:k])
    pos = torch.zeros(batch, dtype=torch.long)
    pos[:n] = torch.tensor(positions)
    ids = torch.zeros(batch, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids)
    slot = torch.full((batch,), scratch * bs, dtype=torch.long)
    slot[:n] = table[torch.arange(n), pos[:n] // bs] * bs + pos[:n] % bs
    lens = torch.ones(batch, dtype=torch.long)
    lens[:n] = pos[:n] + 1
    return ids, pos, slot, lens, table


def test_one_copy_staging_equals_per_tensor_staging(static_engine):
    static = static_engine.runner.static
    steps = [
        ([7, 8, 9], [0, 17, 40], [[3], [4, 5], [6, 7, 9]]),  # 3 rows pad to 4; 41 tokens -> 4 blocks
        ([11], [5], [[2]]),  # a smaller step after a larger one: stale rows must be padding again
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 200], [[1], [2], [3], [4], list(range(10, 23))]),
    ]
    for token_ids, positions, tables in steps:
        batch, blocks = static.stage(token_ids, positions, tables)
        ref = _reference_staging(static, token_ids, positions, tables, batch, blocks)
        got = (
            static.input_ids[:batch],
            static.positions[:batch],
            static.slot_mapping[:batch],
            static.context_lens[:batch],
            static.block_tables[:batch, :blocks],
        )
        for r, g in zip(ref, got, strict=True):
            assert torch.equal(r, g.cpu())


def test_host_buffer_pinned_only_on_cuda(static_engine):
    static = static_engine.runner.static
    assert static._host.is_pinned() == (static.device.type == "cuda")
    assert static._staged.device == static.device


def test_profile_step_runs_on_any_device(ckpt):
    engine = tiny_engine(ckpt)
    peak = profile_activation_bytes(engine.model, 64, 8, 16)
    assert peak == 0 if engine.device.type == "cpu" else peak > 0
    assert device_under_test().type == engine.device.type
