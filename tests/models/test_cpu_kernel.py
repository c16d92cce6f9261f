"""The C decode-attention kernel equals the portable gathered path on random paged caches."""

from __future__ import annotations

import pytest
import torch
from support.kernel_support import KERNEL_TARGETS, require_kernels, target_library
from support.paths import REPO_ROOT

from omnivox.models import attention, cpu_kernels

pytestmark = pytest.mark.cpu_paths  # also run on the AVX2 builds: make test's second pass


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_kernels()  # skips without a compiler; a compiler with a broken kernel fails (not "skipped")


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (9, 3, 64), (8, 8, 32), (14, 2, 64), (6, 1, 128)])
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_equals_gathered_path(target, heads, kv_heads, dim):
    lib = target_library(target)
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
    ours = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, scale, lib=lib)
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
@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_gemv_equals_linear(target, n, k, bias):
    lib = target_library(target)
    torch.manual_seed(n + k)
    w, x = torch.randn(n, k), torch.randn(1, k)
    b = torch.randn(n) if bias else None
    ours = cpu_kernels.gemv(x, w, b, lib=lib)
    torch.testing.assert_close(ours, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_decoder_linear_routes_single_rows_to_the_kernel(monkeypatch):
    """models/layers.py `linear`: one float32 row of a contiguous weight goes through the GEMV kernel (a spy counts
    the calls), everything else through F.linear; both give the same numbers."""
    from omnivox.models.layers import linear

    calls = []
    real = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    w, x = torch.randn(16, 24), torch.randn(3, 24)
    with torch.inference_mode():
        one = linear(x[:1], w)
        assert calls == [(1, 24)], "a single float32 row did not take the GEMV kernel"
        many = linear(x, w)
        linear(x[:1], w.t().contiguous().t())  # a transposed (non-contiguous) weight: F.linear
        linear(x[:1].double(), w.double())  # float64: F.linear
    assert calls == [(1, 24)], "rows the kernel does not cover went through it"
    torch.testing.assert_close(one, many[:1], atol=1e-5, rtol=1e-5)
    with torch.enable_grad():
        linear(x[:1], w)  # autograd needs torch's op
    assert len(calls) == 1


def test_kernel_source_ships_in_wheels():
    """A wheel install (the Docker image) builds the kernels from models/*.c: they must be package data."""
    import tomllib

    root = REPO_ROOT
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.c" in data["omnivox.models"]
    assert "*.h" in data["omnivox.models"]  # intrinsics_scalar.h, which block_kernels_vnni.c can include
    for source in [*cpu_kernels._SOURCES, cpu_kernels._HEADER]:  # cpu_kernels.c, block_kernels_vnni.c, the header
        assert source.exists() and source.parent == root / "models"
