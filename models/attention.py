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


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flattened batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens in the cache after this step (cached before + this chunk)
    slots: torch.Tensor  # [context_len] cache slots of the whole context, in order


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each row's k/v is written
    num_decode: int  # rows [0, num_decode) are decode tokens
    decode_slots: torch.Tensor | None  # [num_decode, max_context] cache slots to read (padding repeats slot 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_context] True where a key is real
    prefills: list[PrefillChunk]


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
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out[:nd] = od.squeeze(2)
    for chunk in meta.prefills:
        s, n, ctx = chunk.query_start, chunk.num_tokens, chunk.context_len
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = k_cache[chunk.slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        vp = v_cache[chunk.slots].transpose(0, 1).unsqueeze(0)
        if ctx == n:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s : s + n] = op.squeeze(0).transpose(0, 1)
    return out
