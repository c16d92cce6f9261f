"""Token counts the penalties read, kept on the request between steps: each step adds only the ids that are new.

Rebuilt every step from the Python id lists (before b11fbd1), the counts were 0.18 s of a 1.66 s run of
2 Orpheus-layout speech streams (700 engine steps, repetition penalty, cProfile, this AVX-512 host, shared): one
`torch.tensor(list)` per row and list per step, growing with the output. Kept here, a step costs a list compare (C
speed), one small index add of the new ids, and a gather of the row's columns. The counts are whole numbers in
float32, so the penalised logits, and the tokens, are exactly those of the rebuilt counts.
"""

from __future__ import annotations

import torch

from omnivox.engine.transfer import to_device


class RunningCounts:
    """Counts of each id 0..size-1 in one id list that grows at its end, updated with what was appended since the
    last call. A list that shrank or changed before its end (a rollback, a request's ids replaced) is recounted."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.counts = torch.zeros(size + 1, device=device)  # [size + 1]: the last column takes ids outside 0..size-1
        self.counted: list[int] = []  # the ids counted so far, in order

    def update(self, ids: list[int]) -> torch.Tensor:
        """[size] float counts of `ids` (a view: valid until the next update)."""
        n = len(self.counted)
        if len(ids) < n or ids[:n] != self.counted:
            self.counts.zero_()
            self.counted, n = [], 0
        if len(ids) > n:
            new = torch.tensor(ids[n:], dtype=torch.long)
            new.masked_fill_((new < 0) | (new >= self.size), self.size)
            new = to_device(new, self.counts.device)
            self.counts.index_add_(0, new, torch.ones(new.shape, device=self.counts.device))
            self.counted.extend(ids[n:])
        return self.counts[: self.size]


class PenaltyCounts:
    """One request's counts of its output ids and of its prompt ids (the repetition penalty's `seen`), over
    vocabulary ids 0..size-1. float32 [size] each: 0.6 MB a penalised request at a 157k vocabulary."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.output = RunningCounts(size, device)
        self.prompt = RunningCounts(size, device)

    def fits(self, size: int, device: torch.device) -> bool:
        return self.output.size >= size and self.output.counts.device == device


def penalty_counts_of(req: object, size: int, device: torch.device) -> PenaltyCounts:
    """The request's kept counts over at least ids 0..size-1, made (or remade, larger) on first use. An object with
    no `penalty_counts` slot (speculative verification's row views) gets fresh counts each call."""
    kept = getattr(req, "penalty_counts", None)
    if kept is None or not kept.fits(size, device):
        kept = PenaltyCounts(size, device)
        if hasattr(req, "penalty_counts"):
            req.penalty_counts = kept  # type: ignore[attr-defined]
    return kept


def gather_counts(
    rows: list[torch.Tensor],  # R x [size] counts
    cand: torch.Tensor | None,  # [R, K] candidate ids per row, or None: a window of columns
    first_id: int,
    width: int,
) -> torch.Tensor:
    """[R, K] counts of each row's candidate ids, or [R, width] of ids first_id..first_id+width-1."""
    if cand is None:
        return torch.stack([r[first_id : first_id + width] for r in rows])
    return torch.stack([r.index_select(0, c) for r, c in zip(rows, cand, strict=True)])
