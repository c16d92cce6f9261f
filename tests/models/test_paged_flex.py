"""Decode attention that reads the paged cache in place (FlexAttention with a paged block mask) equals the gathered
path on CPU (eager FlexAttention), for grouped and plain heads, partial last blocks, scattered and padded tables."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.engines import device_under_test

from omnivox.models.attention import (
    AttentionMetadata,
    _decode_attention_gathered,
    decode_attention_flex,
    paged_attention,
    paged_block_mask,
)

BS = 16


def _case(seed: int, heads: int, kv_heads: int, lens: list[int], num_blocks: int = 24, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    dev = device_under_test()
    k_cache = torch.randn(num_blocks * BS, kv_heads, d, generator=g).to(dev)
    v_cache = torch.randn(num_blocks * BS, kv_heads, d, generator=g).to(dev)
    q = torch.randn(len(lens), heads, d, generator=g).to(dev)
    width = max(-(-n // BS) for n in lens) + 1  # one column past the longest: padding entries must be ignored
    perm = torch.randperm(num_blocks - 1, generator=g)  # the last block is the scratch block
    table = torch.zeros(len(lens), width, dtype=torch.long)  # padding entries point at block 0, a real block
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // BS)
        table[i, :nb] = perm[used : used + nb]
        used += nb
    lens_t = torch.tensor(lens)
    span = torch.arange(width * BS)
    meta = AttentionMetadata(
        block_size=BS,
        slot_mapping=torch.zeros(len(lens), dtype=torch.long, device=dev),
        num_decode=len(lens),
        decode_block_tables=table.to(dev),
        decode_mask=(span[None, :] < lens_t[:, None]).view(len(lens), 1, 1, -1).to(dev),
        decode_lens=lens_t.to(dev),
        prefills=[],
    )
    return q, k_cache, v_cache, meta, num_blocks


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("rows", [None, 8])  # the mask padded to more rows than requests (one compiled shape)
def test_flex_equals_gathered(heads, kv_heads, rows):
    lens = [1, 16, 17, 40, 5, 64]
    q, k_cache, v_cache, meta, num_blocks = _case(0, heads, kv_heads, lens)
    mask = paged_block_mask(meta.decode_block_tables, meta.decode_lens, BS, num_blocks, rows or len(lens))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention warns that it is unfused
        got = decode_attention_flex(q, k_cache, v_cache, mask, heads**-0.5)
    want = _decode_attention_gathered(q, k_cache, v_cache, meta, heads**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_attention_takes_the_flex_path_when_the_mask_is_given():
    lens = [3, 33, 20]
    q, k_cache, v_cache, meta, num_blocks = _case(1, 4, 2, lens)
    want = paged_attention(q, k_cache, v_cache, meta, 0.25)
    meta.decode_block_mask = paged_block_mask(meta.decode_block_tables, meta.decode_lens, BS, num_blocks, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A key the mask_mod refuses really is refused: poison every slot no request owns, the result does not move.
    owned = torch.zeros(num_blocks * BS, dtype=torch.bool)
    for table, n in zip(meta.decode_block_tables.cpu(), lens, strict=True):
        slots = (table[: -(-n // BS), None] * BS + torch.arange(BS)).flatten()[:n]
        owned[slots] = True
    k_cache[~owned.to(k_cache.device)] = 1e4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        poisoned = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(poisoned, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
def test_engine_with_flex_decode_equals_the_default(tmp_path_factory, static):
    """Through the whole engine (dynamic path and the static twin): the same greedy tokens and logprobs."""
    from support.engines import tiny_checkpoint, tiny_engine

    from omnivox.engine import SamplingParams

    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("flex"), "qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    flex = tiny_engine(ckpt, static_decode=static, max_num_seqs=4)
    flex.runner.set_decode_attention("flex")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flex.runner.prepare()
        a = flex.generate(prompts, params)
    assert flex.runner.use_flex and "FlexAttention" in flex.runner.describe_decode_attention()
    b = tiny_engine(ckpt, static_decode=static, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in x.logprobs]), torch.tensor([lp.logprob for lp in y.logprobs])
        )
    if static:
        st = flex.runner.static
        assert st.num_runs > 0 and st.frozen
        assert st.built == {(b, st.block_buckets[-1]) for b in st.batch_buckets}  # one context width under flex


def test_flex_failure_at_load_falls_back_to_native(tmp_path_factory, monkeypatch):
    from support.engines import tiny_checkpoint, tiny_engine

    from omnivox.engine import runner as runner_mod

    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("flex"), "llama")
    engine = tiny_engine(ckpt, static_decode=True, max_num_seqs=2)
    engine.runner.set_decode_attention("flex")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(runner_mod, "decode_attention_flex", broken)
    engine.runner.prepare()
    assert not engine.runner.use_flex and not engine.runner.static.use_flex and engine.runner.static.frozen
