"""The penalties' kept token counts (engine/penalty_counts.py) against the counts rebuilt from the id lists every
step (logit_filters.counts_among / token_counts, the form they replaced): equal counts, and the same tokens."""

from __future__ import annotations

import random

import torch

from omnivox.engine.logit_filters import counts_among, token_counts
from omnivox.engine.params import SamplingParams
from omnivox.engine.penalty_counts import RunningCounts, gather_counts
from omnivox.engine.request import Request
from omnivox.engine.sampler import Sampler
from omnivox.engine.transfer import take_rows, to_device

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


def rebuilt_penalties(self, logits, reqs, cand, first_id=0) -> None:
    """Sampler._apply_penalties as it was before the counts were kept (commit 8b16320): counts rebuilt every step."""
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
    ]
    if not rows:
        return
    dev = logits.device

    def counts_of(id_lists):
        if cand is None:
            return token_counts(id_lists, len(rows), logits.shape[1], dev, first_id)
        return counts_among(id_lists, take_rows(cand, rows))

    params = [reqs[i].params for i in rows]
    sub = take_rows(logits, rows)
    counts = counts_of([reqs[i].output_token_ids for i in rows])
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = to_device([p.repetition_penalty for p in params], dev).unsqueeze(1)
        seen = (counts_of([reqs[i].prompt_token_ids for i in rows]) > 0) | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        freq = to_device([p.frequency_penalty for p in params], dev).unsqueeze(1)
        pres = to_device([p.presence_penalty for p in params], dev).unsqueeze(1)
        sub = sub - freq * counts - pres * (counts > 0).float()
    if sub is not logits:
        logits.index_copy_(0, to_device(rows, dev, torch.long), sub)


def _run(steps: int, monkeypatch=None) -> list[list[int]]:
    """`steps` sampler calls on the same seeded logits; a row's token is appended to its output each step (a
    rollback of two tokens every 40 steps, as a stop string or rejected drafts cut an output)."""
    reqs = _batch()
    sampler = Sampler(VOCAB, CPU)
    if monkeypatch is not None:
        monkeypatch.setattr(Sampler, "_apply_penalties", rebuilt_penalties)
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


def test_a_penalised_batch_draws_the_same_tokens_as_with_rebuilt_counts(monkeypatch) -> None:
    kept = _run(300)
    rebuilt = _run(300, monkeypatch)
    assert kept == rebuilt
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
        assert torch.equal(gather_counts(rows, cand, 0, VOCAB), counts_among(lists, cand))
        assert torch.equal(gather_counts(rows, None, 0, VOCAB), token_counts(lists, len(lists), VOCAB, CPU))
        # A window row by row: over rows of unequal lengths the rebuilt form counted its padding (id `vocab`, shifted
        # by first_id into the window) as token 32 in every shorter row; the kept counts do not.
        window = torch.cat([token_counts([ids], 1, 32, CPU, first_id=4) for ids in lists])  # [R, 32]: ids 4..35
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
