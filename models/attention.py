"""Attention over the paged KV cache.

The KV cache of one layer is two flat tensors `k_cache`, `v_cache` of shape [num_blocks * block_size, kv_heads, head_dim]:
slot `block * block_size + offset` holds one token. A step's tokens are flattened into one batch of T rows:
first the decode tokens (one per request, attended together), then each prefill chunk (attended per request with a
causal mask offset by the tokens it already has in the cache).

Decode attention, by what the metadata carries and where it runs:
- `decode_block_mask` set (CUDA default): FlexAttention reads the paged cache in place through a block mask whose KV
  blocks are each request's block table; nothing is copied. Compiled once on CUDA (the batch is always padded to
  the mask's rows, so one shape serves every step); on CPU it runs eagerly (tests) and materialises scores over the
  whole cache, so it is never the CPU default.
- CPU float32: the C kernel (models/cpu_kernels.c), which also reads the cache in place.
- otherwise: the gathered path (copy each request's blocks, then SDPA on CUDA, two matmuls on CPU): the fallback.

A prefill chunk's `bidirectional` spans (Gemma 3 images) open their block both ways: a query inside one sees every
key of it, later ones included (the scheduler never ends a chunk inside one); decode stays causal.

A sliding-window layer (Mistral; Qwen2 / Qwen3 layers marked "sliding_attention") passes `window`: a query at
position p sees keys p - window < j <= p, as transformers masks them. Prefill chunks add it to their mask; the C
kernel starts each row at its first key in the window; a decode step whose block tables span more than the window
leaves FlexAttention (its block mask knows only lengths) for the gathered path, which copies only the window's blocks.
Prefill chunks past the window gather keys from the block of their first query's first key on. When every layer
slides, the engine releases the blocks behind the window (engine/kv_manager.py): their table entries point at the
scratch block, which no path reads.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from omnivox.models import cpu_kernels


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flattened batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens in the cache after this step (cached before + this chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] blocks holding the context, in order
    # Position spans [start, end) whose tokens see each other both ways (Gemma 3 images), each ending by context_len:
    # a query inside one also sees the span's later keys (transformers' blockwise_overlay, OR-ed with causal).
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each row's k/v is written
    num_decode: int  # rows [0, num_decode) are decode tokens
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] blocks to read (padding: any block)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] True where a key is real
    decode_lens: torch.Tensor | None  # [num_decode] context length of each decode request
    prefills: list[PrefillChunk]
    decode_block_mask: BlockMask | None = None  # set: decode attention reads the cache in place (paged_block_mask)


log = logging.getLogger(__name__)

# FlexAttention's query block: one q block holds the single decode query (128 is a multiple of every kernel BLOCK_M).
_FLEX_Q_BLOCK = 128


def paged_block_mask(
    block_tables: torch.Tensor,  # [B, W] each request's blocks in order (entries past its length: any block)
    lens: torch.Tensor,  # [B] context length of each request (>= 1)
    block_size: int,
    num_cache_blocks: int,  # blocks in the flat cache (its rows / block_size)
    rows: int,  # the mask's batch: B padded up to this with one-token rows on the last cache block (scratch)
) -> BlockMask:
    """A FlexAttention block mask over the whole flat cache for one decode query per request.

    The KV blocks of row b are its block table, so the kernel visits only them. FlexAttention requires the mask_mod
    to be the whole truth (its eager path ignores the block lists), so the mask_mod maps each physical cache block
    back to its logical index in row b (-1: not this request's) and admits a key when logical * block_size + offset
    < lens[b], as torch's experimental PagedAttention does.
    """
    b, w = block_tables.shape
    dev = block_tables.device
    scratch = num_cache_blocks - 1
    tables = torch.full((rows, w), scratch, dtype=torch.long, device=dev)
    tables[:b] = block_tables
    lengths = torch.ones(rows, dtype=torch.long, device=dev)
    lengths[:b] = lens
    nblocks = (lengths + block_size - 1) // block_size  # [rows]
    logical = torch.arange(w, device=dev).expand(rows, w)
    used = logical < nblocks[:, None]
    # Physical -> logical block, one extra column catching the unused table entries (duplicates must not race).
    p2l = torch.full((rows, num_cache_blocks + 1), -1, dtype=torch.int32, device=dev)
    p2l.scatter_(1, torch.where(used, tables, num_cache_blocks), torch.where(used, logical, -1).to(torch.int32))
    p2l = p2l[:, :num_cache_blocks]
    kv_indices = torch.zeros(rows, 1, 1, num_cache_blocks, dtype=torch.int32, device=dev)
    kv_indices[:, 0, 0, :w] = tables.to(torch.int32)

    def mask_mod(bi, h, q_idx, kv_idx):
        logical_block = p2l[bi, kv_idx // block_size]
        return (logical_block >= 0) & (logical_block * block_size + kv_idx % block_size < lengths[bi])

    return BlockMask.from_kv_blocks(
        nblocks.view(rows, 1, 1).to(torch.int32),
        kv_indices,
        BLOCK_SIZE=(_FLEX_Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_cache_blocks * block_size),
        compute_q_blocks=False,  # the transposed lists serve only the backward pass
    )


@functools.cache
def _compiled_flex():
    """FlexAttention compiled (a fused kernel); uncompiled it materialises the scores over the whole cache."""
    return torch.compile(flex_attention, dynamic=False)


def decode_attention_flex(q, k_cache, v_cache, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """q [B, H, D] (B <= the mask's rows) -> [B, H, D], reading the paged cache in place."""
    b, h, d = q.shape
    rows = block_mask.kv_num_blocks.shape[0]
    qp = q.new_zeros(rows, h, 1, d)
    qp[:b, :, 0] = q
    n, kvh = k_cache.shape[0], k_cache.shape[1]
    k = k_cache.view(1, n, kvh, d).transpose(1, 2).expand(rows, kvh, n, d)  # [rows, KVH, N, D], no copy
    v = v_cache.view(1, n, kvh, d).transpose(1, 2).expand(rows, kvh, n, d)
    attend = _compiled_flex() if q.is_cuda else flex_attention
    out = attend(qp, k, v, block_mask=block_mask, scale=scale, enable_gqa=kvh != h)
    return out[:b, :, 0]


def sdpa_backend_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The SDPA backend torch picks for these inputs ([B, H, L, D]), to log at load: cuDNN builds a plan per new
    shape (time-to-first-token spikes); flash and efficient do not."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=q.shape[1] != k.shape[1])
        return torch.nn.attention.SDPBackend(choice).name
    except Exception as e:  # a private torch API: a name is worth logging, never worth failing a load
        return f"unknown ({type(e).__name__})"


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Copy whole blocks ([n] ids) out of a flat cache: [n * block_size, kv_heads, head_dim].

    Block-sized rows copy at memcpy speed; a gather per token slot is several times slower, and advanced indexing
    (cache[ids]) is slower still on CPU.
    """
    rows = cache.view(-1, block_size * cache.shape[1] * cache.shape[2])
    return rows.index_select(0, block_ids).view(-1, cache.shape[1], cache.shape[2])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Store this step's keys and values ([T, kv_heads, head_dim]) at their slots."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # sliding window: a query at position p sees keys p - window < j <= p (transformers')
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap) before the mask
) -> torch.Tensor:  # [T, heads, head_dim]
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    nd = meta.num_decode
    if nd and softcap is not None:  # the fused kernels (SDPA, FlexAttention, the C kernel) take no soft-cap
        slide = window is not None and meta.decode_block_tables.shape[1] * meta.block_size > window
        out[:nd] = _decode_attention_gathered(q[:nd], k_cache, v_cache, meta, scale, window if slide else None, softcap)
    elif nd:
        # Whether keys may lie before a sliding window (from the table's shape: no device read). FlexAttention's
        # block mask knows only lengths: such a step takes the C kernel or the gathered path, which take the window.
        slide = window is not None and meta.decode_block_tables.shape[1] * meta.block_size > window
        if meta.decode_block_mask is not None and not slide:
            out[:nd] = decode_attention_flex(q[:nd], k_cache, v_cache, meta.decode_block_mask, scale)
        elif not q.is_cuda and q.dtype == torch.float32 and cpu_kernels.kernel_available():
            out[:nd] = cpu_kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, meta.block_size, scale, window
            )
        else:
            out[:nd] = _decode_attention_gathered(q[:nd], k_cache, v_cache, meta, scale, window if slide else None)
    for chunk in meta.prefills:
        s, n, ctx = chunk.query_start, chunk.num_tokens, chunk.context_len
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        slide = window is not None and ctx > window
        # Past a window, keys start at the block of the chunk's first query's first key: the cost follows the window
        # and the chunk, not the context (and blocks released behind the window are never read).
        lo = max(0, ctx - n - window + 1) // meta.block_size * meta.block_size if slide else 0
        table = chunk.block_table[lo // meta.block_size :]
        kp = gather_blocks(k_cache, table, meta.block_size)[: ctx - lo].transpose(0, 1).unsqueeze(0)
        vp = gather_blocks(v_cache, table, meta.block_size)[: ctx - lo].transpose(0, 1).unsqueeze(0)
        if ctx == n and not slide and softcap is None and not chunk.bidirectional:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [n, ctx - lo]
            for a, b in chunk.bidirectional:  # causal OR same block, then the window (transformers' order)
                assert b <= ctx, f"a bidirectional span [{a}, {b}) ends past the chunk's context {ctx}"
                mask = mask | ((q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b))
            if slide:
                mask = mask & (k_pos > q_pos - window)
            if softcap is None:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
            else:
                op = _softcapped_attention(qp, kp, vp, mask, scale, softcap)
        out[s : s + n] = op.squeeze(0).transpose(0, 1)
    return out


_SOFTCAP_QUERY_ROWS = 256  # queries per score matrix: [H, 256, L] floats (16 heads at 8k keys: 128 MiB)


def _softcapped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's score soft-capping, written out as transformers' eager path computes it (SDPA has no
    soft-cap): q [1, H, n, D], k / v [1, KVH, L, D], mask [n, L] True where a key is seen -> [1, H, n, D].
    Queries go `_SOFTCAP_QUERY_ROWS` at a time, so a long prefill chunk never holds all its scores at once."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = torch.empty_like(q)
    for s in range(0, q.shape[2], _SOFTCAP_QUERY_ROWS):
        rows = slice(s, s + _SOFTCAP_QUERY_ROWS)
        scores = torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~mask[rows], float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, :, rows] = torch.matmul(probs, v)
    return out


def _decode_attention_gathered(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Portable decode attention: copy each request's blocks out of the cache, then attend (SDPA on CUDA).

    With a window, only the blocks that can hold a request's last `window` keys are copied: the same number for every
    request (ceil(window / block_size) + 1, whatever the alignment), starting at its own block, so the cost follows
    the window and not the context, with shapes fixed by the window alone (no device read, graph-capturable)."""
    tables, bs, lens = meta.decode_block_tables, meta.block_size, meta.decode_lens
    b, width = tables.shape
    mask = meta.decode_mask
    if window is not None:
        first = torch.zeros_like(lens)  # each row's logical block at column 0
        n_win = min(width, -(-window // bs) + 1)
        if n_win < width:
            first = ((lens - window).clamp(min=0) // bs).clamp(max=width - n_win)
            tables = tables.gather(1, first[:, None] + torch.arange(n_win, device=tables.device)[None, :])
            width = n_win
        pos = first[:, None] * bs + torch.arange(width * bs, device=lens.device)[None, :]  # [B, L] key positions
        mask = ((pos < lens[:, None]) & (pos >= (lens - window)[:, None])).view(b, 1, 1, -1)
    flat = tables.flatten()
    kd = gather_blocks(k_cache, flat, bs).view(b, -1, *k_cache.shape[1:])  # [B, L, KVH, D]
    vd = gather_blocks(v_cache, flat, bs).view(b, -1, *v_cache.shape[1:])
    if q.is_cuda and softcap is None:
        gqa = q.shape[1] != k_cache.shape[1]
        return F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kd.transpose(1, 2),
            vd.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        ).squeeze(2)
    return _decode_attention_matmul(q, kd, vd, mask, scale, softcap)


def _decode_attention_matmul(q, k, v, mask, scale, softcap: float | None = None):
    """One query per request, written as two batched matmuls: on CPU this beats SDPA's flash kernel, whose
    per-call setup dominates at one query (and, unlike SDPA, it soft-caps scores: Gemma 2).
    q [B, H, D]; k, v [B, L, KVH, D]; mask [B, 1, 1, L]."""
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # query heads grouped under their KV head
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, KVH, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(b, h, d)
