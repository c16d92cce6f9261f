"""Token times from Whisper's cross-attention, as transformers' `generate(return_token_timestamps=True)` computes
them (`_extract_token_timestamps`; openai-whisper's `find_alignment` is the same method):

  the decoder re-run densely over [prompt, generated tokens but the last] with the window's cross K/V
  -> the cross-attention weights of the checkpoint's `alignment_heads` (generation_config.json), [heads, T, 1500]
  -> cut to the audio's frames (num_mel_frames // 2), the prompt's rows dropped
  -> each head normalised over the tokens (mean 0, std 1), a median filter of MEDIAN_FILTER_WIDTH over time
  -> the heads' mean, dynamic time warping of its negation (the monotonic token-to-frame path of least cost)
  -> a row's time is where the path first reaches it, in 0.02 s encoder frames (`row_times`). transformers gives
     token k the time of the row where k is the decoder's input (the prompt's tokens 0, the last token the time of
     the one before it: it was never fed back); services/output/whisper_words.py gives it the row that predicts it, as
     openai-whisper does, so the end-of-text row ends the last word.

The dense re-run reads the same weights as the engine's paged decode step; it holds no KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

MEDIAN_FILTER_WIDTH = 7  # transformers' WhisperConfig.median_filter_width and openai-whisper's medfilt_width
SECONDS_PER_FRAME = 0.02  # one encoder frame: two 10 ms mel frames


def alignment_heads(generation_config: dict) -> list[tuple[int, int]]:
    """The (layer, head) pairs the checkpoint names for alignment; [] when it names none."""
    return [(int(layer), int(head)) for layer, head in generation_config.get("alignment_heads") or []]


@torch.inference_mode()
def cross_attention_weights(
    model: torch.nn.Module, token_ids: Sequence[int], cross: torch.Tensor, heads: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """The decoder over `token_ids` (one sequence, no cache) with `cross` ([L, 2, H, T_enc, hd], as the encoder
    worker's `cross_kv` gives it): each of `heads`' cross-attention probabilities, [len(heads), T, T_enc] float32."""
    dec = model.decoder
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=dec.embed_tokens.weight.device)
    t = ids.shape[0]
    x = dec.embed_tokens(ids) + dec.embed_positions.weight[:t]  # [T, d]
    found: dict[tuple[int, int], torch.Tensor] = {}
    last = max(layer for layer, _ in heads)
    for i, layer in enumerate(dec.layers[: last + 1]):
        h, hd, d = layer.heads, layer.head_dim, x.shape[1]
        qkv = layer.self_attn.qkv_proj(layer.self_attn_layer_norm(x)).view(t, 3, h, hd)
        q, k, v = (z.transpose(0, 1)[None] for z in qkv.unbind(1))  # each [1, H, T, hd]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale)[0]  # [H, T, hd]
        x = x + layer.self_attn.out_proj(att.transpose(0, 1).reshape(t, d))
        qc = layer.encoder_attn.q_proj(layer.encoder_attn_layer_norm(x)).view(t, h, hd).transpose(0, 1)  # [H, T, hd]
        kc, vc = cross[i, 0].to(qc.dtype), cross[i, 1].to(qc.dtype)  # [H, T_enc, hd]
        weights = torch.softmax((qc @ kc.transpose(-1, -2)).float() * layer.scale, dim=-1)  # [H, T, T_enc]
        for layer_index, head in heads:
            if layer_index == i:
                found[(layer_index, head)] = weights[head]
        x = x + layer.encoder_attn.out_proj((weights.to(vc.dtype) @ vc).transpose(0, 1).reshape(t, d))
        x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    return torch.stack([found[pair] for pair in heads])


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """A median over `width` along the last dimension, edges reflected (transformers' `_median_filter`)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = F.pad(x[None], (pad, pad, 0, 0), mode="reflect")[0]
    return padded.unfold(-1, width, 1).sort()[0][..., pad]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The monotonic path of least total cost through `cost` [tokens, frames], from (0, 0) to the last corner, by
    diagonal, down or right steps (ties broken as transformers' `_dynamic_time_warping`): (token, frame) indices."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf, dtype=np.float32)  # float32 as transformers' table
    trace = -np.ones((n + 1, m + 1), dtype=np.int8)
    total[0, 0] = 0.0
    # Anti-diagonal by anti-diagonal (i + j = k): each cell needs only the two diagonals before, so a diagonal is one
    # vectorised step (transformers loops cell by cell in Python: 150k steps for a 30 s window of 100 tokens).
    for k in range(2, n + m + 1):
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        best = np.where(step == 0, c0, np.where(step == 1, c1, c2))
        total[i, j] = cost[i - 1, j - 1].astype(np.float32) + best
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j = n, m
    tokens, frames = [], []
    while i > 0 or j > 0:
        tokens.append(i - 1)
        frames.append(j - 1)
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return np.array(tokens[::-1]), np.array(frames[::-1])


def row_times(weights: torch.Tensor, first_row: int, num_mel_frames: int) -> np.ndarray:
    """`weights` [heads, T, T_enc] (cross_attention_weights) -> for each row from `first_row` on, the time in seconds
    at which the alignment path first reaches it. transformers' token timestamps of a generate from a prompt of P
    tokens are [0] * P + row_times(weights over prompt + generated[:-1], P, frames) + its last value again."""
    w = weights[:, first_row:, : num_mel_frames // 2].float()
    if w.shape[1] == 0:
        return np.zeros(0)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = median_filter((w - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = w.mean(dim=0)  # [rows, frames]
    text_indices, time_indices = dtw(-matrix.double().numpy())
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    return time_indices[jumps] * SECONDS_PER_FRAME
