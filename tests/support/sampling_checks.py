"""The sampler's distribution against an independent computation: a tiny model with spread-out logits, the expected
probabilities after temperature / top-k / top-p / min-p, and a chi-square check of drawn counts."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from support.checkpoints import load_reference, make_checkpoint

PROMPT = [5, 17, 33, 48, 71, 90, 101]


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    """A tiny Llama whose logits span ~10 nats, and transformers' logits for PROMPT's next token."""
    root = tmp_path_factory.mktemp("spread")
    base = make_checkpoint(root / "base", "llama", seed=3)
    model = load_reference(base)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    out = root / "spread"
    model.save_pretrained(out)
    for f in base.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    return out, logits


def expected_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    z = logits / temperature
    keep = np.ones_like(z, dtype=bool)
    order = np.argsort(-z, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = np.exp(z - z.max()) * keep
        p /= p.sum()
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= top_p]] = False
    if min_p > 0.0:
        p = np.exp(z - z.max())
        p /= p.sum()
        keep &= p >= min_p * p.max()
    p = np.exp(z - z.max()) * keep
    return p / p.sum()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Pearson's test over bins with >= 5 expected draws (the rest pooled); threshold at p = 1e-4."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if exp[~big].sum() > 0:
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b, float), np.array(exp_b, float)
    if (obs_b[exp_b == 0] > 0).any():
        return False, math.inf, 0.0
    stat = float(((obs_b - exp_b) ** 2 / np.where(exp_b > 0, exp_b, 1)).sum())
    df = max(len(obs_b) - 1, 1)
    z = 3.72  # one-sided p = 1e-4
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat <= limit, stat, limit
