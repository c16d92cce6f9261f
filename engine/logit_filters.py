"""Row-wise pieces of sampling that see only a logits tensor and token ids: the top-k / top-p / min-p filters and the
token counts the penalties read. The sampler (engine/sampler.py) composes them; speculative verification reuses the
filters through `Sampler.distributions`."""

from __future__ import annotations

import numpy as np
import torch

from omnivox.engine.transfer import to_device

NEG_INF = float("-inf")


def divide_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, V] / temperature [B, 1], shifted by each row's max first. A logit near float32's max (a logit bias
    of 3e38 is accepted) divided by 0.5 was inf, the softmax NaN, and the draw took id 0 (INTERNAL under a grammar).
    Softmax and the filters are shift-invariant; shifted, every value is <= 0 and a division only underflows to -inf,
    where the probability was 0 anyway."""
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [B, V], already divided by temperature
    top_k: torch.Tensor | None,  # [B] int, 0 = off
    top_p: torch.Tensor | None,  # [B] float, 1 = off
    min_p: torch.Tensor | None,  # [B] float, 0 = off
) -> torch.Tensor:
    """Set every token outside the kept support to -inf. Top-k keeps the k largest logits (ties at the k-th value
    are kept); top-p keeps the smallest set of most likely tokens whose probability reaches p; min-p keeps tokens
    whose probability is at least min_p times the most likely one's."""
    if top_k is not None or top_p is not None:
        sorted_logits, sorted_idx = sort_descending(logits)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        vocab = logits.shape[-1]
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
            remove |= sorted_logits < kth
        if top_p is not None:
            probs = sorted_logits.masked_fill(remove, NEG_INF).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # probability mass of strictly more likely tokens
            remove |= before >= top_p.unsqueeze(1)
            remove[:, 0] = False
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), NEG_INF)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    return logits


def sort_descending(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's values largest first, and their columns (both [B, V]). On a CPU by numpy's sort: 2 x 4096 speech
    candidates (the Orpheus constraint's window, top-p 0.8) took 0.57 ms in torch's sort, a fifth of the speech
    engine's step, and 0.13 ms in numpy's (x86-simd-sort). Equal values may come in another order than torch's (whose
    own order of ties is not stable either); the values are the same."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad:
        return logits.sort(dim=-1, descending=True)
    idx = torch.from_numpy(np.argsort(-logits.numpy(), axis=-1))
    return logits.gather(1, idx), idx


def filters_of(reqs: list, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row top-k, top-p and min-p tensors, each None when no row uses that filter."""
    top_k = top_p = min_p = None
    if any(r.params.top_k > 0 for r in reqs):
        top_k = to_device([r.params.top_k for r in reqs], dev)
    if any(r.params.top_p < 1.0 for r in reqs):
        top_p = to_device([r.params.top_p for r in reqs], dev)
    if any(r.params.min_p > 0.0 for r in reqs):
        min_p = to_device([r.params.min_p for r in reqs], dev)
    return top_k, top_p, min_p
