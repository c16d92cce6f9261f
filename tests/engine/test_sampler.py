"""Sampler filters on a fixed logits vector: exactly the right support."""

from __future__ import annotations

import math

import torch

from omnivox.engine import logit_filters
from omnivox.engine.logit_filters import apply_top_k_top_p_min_p, sort_descending

# Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (token ids shuffled so that order is not index order).
PROBS = torch.tensor([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
LOGITS = PROBS.log().unsqueeze(0)


def support(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_top_k_keeps_the_k_most_likely():
    for k, expected in [(1, {1}), (2, {1, 3}), (3, {1, 3, 5}), (6, set(range(6))), (0, set(range(6)))]:
        out = apply_top_k_top_p_min_p(LOGITS, torch.tensor([k]), None, None)
        assert support(out) == expected, k
        kept = out[0][torch.isfinite(out[0])]
        assert torch.equal(kept, LOGITS[0][sorted(expected)])  # kept logits unchanged


def test_top_p_keeps_the_smallest_set_reaching_p():
    cases = [(0.3, {1}), (0.41, {1, 3}), (0.64, {1, 3}), (0.66, {1, 3, 5}), (0.85, {1, 3, 5, 0}), (1.0, set(range(6)))]
    for p, expected in cases:
        out = apply_top_k_top_p_min_p(LOGITS, None, torch.tensor([p]), None)
        assert support(out) == expected, p


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    for m, expected in [(0.5, {1, 3}), (0.3, {1, 3, 5}), (0.2, {1, 3, 5, 0}), (0.0, set(range(6))), (1.0, {1})]:
        out = apply_top_k_top_p_min_p(LOGITS, None, None, torch.tensor([m]))
        assert support(out) == expected, m


def test_filters_combine_per_row():
    logits = LOGITS.repeat(3, 1)
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.41, 1.0]), torch.tensor([0.0, 0.0, 0.3])
    )
    assert [support(out[i : i + 1]) for i in range(3)] == [{1, 3}, {1, 3}, {1, 3, 5}]
    assert not math.isinf(out[0, 1].item())


def test_the_cpu_sort_matches_torchs_and_top_p_keeps_the_same_support(monkeypatch):
    """sort_descending on a CPU (numpy's sort, 4x torch's at the speech window's 2 x 4096) gives torch's sorted
    values with columns that are a permutation holding them, ties and -inf included; top-p and top-k over it keep
    what torch's own sort keeps on rows without ties."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4096, generator=g) / 0.6
    logits[1, 100:4000:7] = 0.5  # ties
    logits[2, :50] = float("-inf")  # masked columns
    values, cols = sort_descending(logits)
    reference, _ = logits.sort(dim=-1, descending=True)
    assert torch.equal(values, reference) and torch.equal(logits.gather(1, cols), values)
    assert all(sorted(row) == list(range(4096)) for row in cols.tolist())
    rows = torch.randn(4, 4096, generator=g) / 0.6
    top_k, top_p = torch.tensor([0, 50, 0, 3000]), torch.tensor([0.8, 1.0, 0.95, 0.5])
    fast = apply_top_k_top_p_min_p(rows, top_k, top_p, None)
    monkeypatch.setattr(logit_filters, "sort_descending", lambda x: x.sort(dim=-1, descending=True))
    slow = apply_top_k_top_p_min_p(rows, top_k, top_p, None)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(slow)) and torch.equal(fast, slow)
