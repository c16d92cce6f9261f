"""The C decode-attention kernel equals the portable gathered path on random paged caches."""

from __future__ import annotations

import pytest
import torch
from support.paths import REPO_ROOT

from omnivox.models import attention, cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if cpu_kernels.kernel_available():
        return
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler here: the portable path serves (and the engine tests cover it)")
    # A compiler exists, so the kernels must build: a broken kernel must not pass as "skipped".
    pytest.fail(f"a C compiler exists but the CPU kernels are unavailable: {cpu_kernels.build_failure()}")


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (9, 3, 64), (8, 8, 32), (14, 2, 64), (6, 1, 128)])
def test_kernel_equals_gathered_path(heads, kv_heads, dim):
    torch.manual_seed(heads * 100 + dim)
    bs, num_blocks = 16, 40
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim)
    lens = torch.tensor([1, 17, 16, 130, 5])  # lengths inside, at and across block edges
    max_blocks = -(-int(lens.max()) // bs)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens.tolist()):
        k = -(-n // bs)
        tables[i, :k] = perm[used : used + k]
        used += k
    span = torch.arange(max_blocks * bs)
    meta = attention.AttentionMetadata(
        block_size=bs,
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode=len(lens),
        decode_block_tables=tables,
        decode_mask=(span[None, :] < lens[:, None]).view(len(lens), 1, 1, -1),
        decode_lens=lens,
        prefills=[],
    )
    q = torch.randn(len(lens), heads, dim)
    scale = dim**-0.5
    ours = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, scale)
    portable = attention._decode_attention_gathered(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(ours, portable, atol=1e-5, rtol=1e-4)
    # and both against a plain softmax(qK^T)V written out per request
    for i, n in enumerate(lens.tolist()):
        slots = (tables[i].unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]
        k = k_cache[slots].repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        v = v_cache[slots].repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i], k) * scale).softmax(-1)
        torch.testing.assert_close(ours[i], torch.einsum("hn,nhd->hd", p, v), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("n", "k", "bias"), [(1, 8, False), (7, 13, True), (64, 576, False), (1536, 576, True)])
def test_gemv_equals_linear(n, k, bias):
    torch.manual_seed(n + k)
    w, x = torch.randn(n, k), torch.randn(1, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(cpu_kernels.gemv(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_decoder_linear_routes_single_rows_to_the_kernel():
    from omnivox.models.layers import linear

    w, x = torch.randn(16, 24), torch.randn(3, 24)
    with torch.inference_mode():
        one = linear(x[:1], w)
        many = linear(x, w)
    torch.testing.assert_close(one, many[:1], atol=1e-5, rtol=1e-5)


def test_kernel_source_ships_in_wheels():
    """A wheel install (the Docker image) builds the kernels from models/*.c: they must be package data."""
    import tomllib

    root = REPO_ROOT
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.c" in data["omnivox.models"]
    for source in cpu_kernels._SOURCES:  # cpu_kernels.c and block_kernels_vnni.c
        assert source.exists() and source.parent == root / "models"
