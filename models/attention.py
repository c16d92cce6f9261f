"""Attention over the paged KV cache.

The KV cache of one layer is two flat tensors `k_cache`, `v_cache` of shape [num_blocks * block_size, kv_heads, head_dim]:
slot `block * block_size + offset` holds one token. A step's tokens are flattened into one batch of T rows:
first the decode tokens (one per request, attended together in one padded SDPA call), then each prefill chunk
(attended per request with a causal mask offset by the tokens it already has in the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnivox.models import cpu_kernels


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flattened batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens in the cache after this step (cached before + this chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] blocks holding the context, in order


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] where each row's k/v is written
    num_decode: int  # rows [0, num_decode) are decode tokens
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] blocks to read (padding: any block)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] True where a key is real
    decode_lens: torch.Tensor | None  # [num_decode] context length of each decode request
    prefills: list[PrefillChunk]


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
) -> torch.Tensor:  # [T, heads, head_dim]
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    nd = meta.num_decode
    if nd:
        if not q.is_cuda and q.dtype == torch.float32 and cpu_kernels.kernel_available():
            out[:nd] = cpu_kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, meta.block_size, scale
            )
        else:
            out[:nd] = _decode_attention_gathered(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        s, n, ctx = chunk.query_start, chunk.num_tokens, chunk.context_len
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = gather_blocks(k_cache, chunk.block_table, meta.block_size)[:ctx].transpose(0, 1).unsqueeze(0)
        vp = gather_blocks(v_cache, chunk.block_table, meta.block_size)[:ctx].transpose(0, 1).unsqueeze(0)
        if ctx == n:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s : s + n] = op.squeeze(0).transpose(0, 1)
    return out


def _decode_attention_gathered(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Portable decode attention: copy each request's blocks out of the cache, then attend (SDPA on CUDA)."""
    b = meta.decode_block_tables.shape[0]
    flat = meta.decode_block_tables.flatten()
    kd = gather_blocks(k_cache, flat, meta.block_size).view(b, -1, *k_cache.shape[1:])  # [B, L, KVH, D]
    vd = gather_blocks(v_cache, flat, meta.block_size).view(b, -1, *v_cache.shape[1:])
    if q.is_cuda:
        gqa = q.shape[1] != k_cache.shape[1]
        return F.scaled_dot_product_attention(
            q.unsqueeze(2),
            kd.transpose(1, 2),
            vd.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        ).squeeze(2)
    return _decode_attention_matmul(q, kd, vd, meta.decode_mask, scale)


def _decode_attention_matmul(q, k, v, mask, scale):
    """One query per request, written as two batched matmuls: on CPU this beats SDPA's flash kernel, whose
    per-call setup dominates at one query. q [B, H, D]; k, v [B, L, KVH, D]; mask [B, 1, 1, L]."""
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # query heads grouped under their KV head
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, KVH, G, L]
    scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(b, h, d)
