"""The penalties' kept token counts (engine/penalty_counts.py) against counts made from the whole id lists every step
(the form they replaced): equal counts, and the same tokens."""

from __future__ import annotations

import random

import torch

from omnivox.engine import sampler as sampler_module
from omnivox.engine.params import SamplingParams
from omnivox.engine.penalty_counts import PenaltyCounts, RunningCounts, gather_counts
from omnivox.engine.request import Request
from omnivox.engine.sampler import Sampler

VOCAB = 300
CPU = torch.device("cpu")


class _EveryThird:
    """Admits the ids of one of three interleaved sets, by output length: the candidates move every step, as the
    Orpheus constraint's frame positions do."""

    def allowed_ids(self, output_token_ids: list[int]) -> torch.Tensor:
        return torch.arange(len(output_token_ids) % 3, VOCAB, 3)

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[self.allowed_ids(output_token_ids)] = True
        return mask


def _request(i: int, constrained: bool, **params) -> Request:
    req = Request(f"r{i}", [3, 7, 7, 11 + i, 250], SamplingParams(**params), 10_000, (299,))
    if params.get("seed") is not None:
        req.generator = torch.Generator().manual_seed(params["seed"])
    req.constraint = _EveryThird() if constrained else None
    return req


def _batch() -> list[Request]:
    return [
        _request(0, False, temperature=0.0, repetition_penalty=1.3),
        _request(1, False, temperature=0.9, seed=1, frequency_penalty=0.4, presence_penalty=0.3),
        _request(2, True, temperature=0.8, top_p=0.9, seed=2, repetition_penalty=1.2, frequency_penalty=0.2),
        _request(3, True, temperature=0.0, presence_penalty=0.7),
        _request(4, True, temperature=1.0, seed=4),  # no penalty
    ]


def _counted(ids: list[int], first_id: int = 0, width: int = VOCAB) -> torch.Tensor:
    """[width] counts of ids first_id..first_id+width-1 in `ids`, from the whole list (the reference)."""
    inside = torch.tensor([i - first_id for i in ids if first_id <= i < first_id + width], dtype=torch.long)
    return torch.bincount(inside, minlength=width).float()


def _run(steps: int, monkeypatch=None) -> list[list[int]]:
    """`steps` sampler calls on the same seeded logits; a row's token is appended to its output each step (a
    rollback of two tokens every 40 steps, as a stop string or rejected drafts cut an output). With `monkeypatch`,
    each step's counts are made afresh from the whole id lists instead of kept."""
    reqs = _batch()
    sampler = Sampler(VOCAB, CPU)
    if monkeypatch is not None:
        monkeypatch.setattr(sampler_module, "penalty_counts_of", lambda req, size, device: PenaltyCounts(size, device))
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        logits = torch.randn(len(reqs), VOCAB, generator=g) * 3  # [B, V]: few ids get most of the mass: repeats
        out = sampler(logits, reqs)
        assert not out.failed
        for r, t in zip(reqs, out.token_ids, strict=True):
            r.output_token_ids.append(t)
            if step % 40 == 39:
                del r.output_token_ids[-2:]
    if monkeypatch is not None:
        monkeypatch.undo()
    return [r.output_token_ids for r in reqs]


def test_a_penalised_batch_draws_the_same_tokens_as_with_counts_made_afresh(monkeypatch) -> None:
    kept = _run(300)
    afresh = _run(300, monkeypatch)
    assert kept == afresh
    assert all(len(set(ids)) < len(ids) for ids in kept)  # ids did repeat: the counts mattered


def test_kept_counts_equal_rebuilt_counts_through_growth_rollback_and_odd_ids() -> None:
    rnd = random.Random(0)
    lists: list[list[int]] = [[], [5, 5, 9], [-1, 299, 400]]  # -1 (a draft placeholder) and 400 (past VOCAB): uncounted
    kept = [RunningCounts(VOCAB, CPU) for _ in lists]
    for step in range(200):
        for ids in lists:
            ids.extend(rnd.randrange(-1, 40) for _ in range(rnd.randrange(0, 3)))
            if step % 17 == 16:
                del ids[rnd.randrange(0, len(ids) + 1) :]
            if step % 29 == 28 and ids:
                ids[0] = rnd.randrange(0, 40)  # changed before its end: recounted
        rows = [k.update(ids) for k, ids in zip(kept, lists, strict=True)]
        cand = torch.stack([torch.sort(torch.randperm(VOCAB)[:64]).values for _ in lists])  # [R, 64] ascending
        whole = torch.stack([_counted(ids) for ids in lists])  # [R, VOCAB]
        assert torch.equal(gather_counts(rows, cand, 0, VOCAB), whole.gather(1, cand))
        assert torch.equal(gather_counts(rows, None, 0, VOCAB), whole)
        # A window over rows of unequal lengths (the form before these counts counted a shorter row's padding there)
        window = torch.stack([_counted(ids, first_id=4, width=32) for ids in lists])  # [R, 32]: ids 4..35
        assert torch.equal(gather_counts(rows, None, 4, 32), window)


def test_a_frequency_penalty_counts_every_repeat_and_forgets_a_rolled_back_one() -> None:
    """Token 5 leads token 7 by 1.0; with 5 twice in the output a 0.6 frequency penalty takes 1.2 off (7 wins),
    counted once (or the rollback not seen) only 0.6 (5 would win)."""
    req = _request(0, False, temperature=0.0, frequency_penalty=0.6)
    sampler = Sampler(VOCAB, CPU)

    def pick() -> int:
        logits = torch.full((1, VOCAB), -10.0)
        logits[0, 5], logits[0, 7] = 1.0, 0.0
        return sampler(logits, [req]).token_ids[0]

    assert pick() == 5
    req.output_token_ids.append(5)
    assert pick() == 5  # 1.0 - 0.6 = 0.4 > 0
    req.output_token_ids.append(5)
    assert pick() == 7  # 1.0 - 1.2 < 0
    del req.output_token_ids[-1:]
    assert pick() == 5
    req.output_token_ids[0] = 9  # replaced, not appended: recounted
    req.output_token_ids.append(5)
    assert pick() == 5
