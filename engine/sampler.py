"""The sampler, vectorised over the batch: logits [B, V] in, one token per row out.

Order: logit bias and min_tokens bans (sparse, on the full vocabulary) -> the request's token constraint -> penalties
(repetition over prompt+output, presence/frequency over output) -> logprobs (of these processed logits) -> greedy
rows take argmax; sampled rows are divided by temperature, filtered by top-k / top-p / min-p and drawn with the
exponential-noise trick: argmax(p / E) with E ~ Exp(1) is a draw from p, needs no cumulative sum and no host sync,
and lets each seeded row use its own generator, so a seeded request's draws do not depend on which other requests
share the batch.

Rows whose constraint names its admitted ids (`allowed_ids`, e.g. the 4096 codes of a TTS frame position out of a
~157k vocabulary) are compacted to those candidates first, so everything after the constraint costs O(candidates)
instead of O(vocabulary) for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import torch

from omnivox.engine.logit_filters import (
    NEG_INF,
    apply_top_k_top_p_min_p,
    divide_by_temperature,
    filters_of,
)
from omnivox.engine.outputs import TokenLogprob
from omnivox.engine.penalty_counts import gather_counts, penalty_counts_of
from omnivox.engine.request import Request
from omnivox.engine.transfer import HostTransfer, take_rows, to_device

log = logging.getLogger(__name__)


# The token a row gets when nothing is left to draw: every id its constraint admits is banned (-inf bias, min_tokens).
# Drawn by argmax, such a row took id 0, which the grammar then rejected: INTERNAL for what is the request's own doing.
NOTHING_ALLOWED = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]  # NOTHING_ALLOWED for a row whose processed logits were all -inf
    logprobs: list[TokenLogprob | None]
    failed: list[int]  # rows whose own token constraint raised: no token for them, the rest sampled normally


@dataclass
class _Drawn:
    """One group's draws, still on the device: the tensors `HostTransfer` copies, and how to read them back."""

    tokens: torch.Tensor  # [R] long: the vocabulary id drawn for each row
    lp_rows: list[int]  # rows (of the group) that asked for logprobs
    chosen: torch.Tensor | None = None  # [L] float32: the logprob of each lp row's token
    top_vals: torch.Tensor | None = None  # [L, n] float32: the n largest logprobs
    top_ids: torch.Tensor | None = None  # [L, n] long: their ids

    def parts(self) -> list[torch.Tensor]:
        return [t for t in (self.tokens, self.chosen, self.top_vals, self.top_ids) if t is not None]

    def unpack(self, values: Iterator[float], reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Read this group's parts back from the transferred values, in the order `parts` gave them."""
        tokens = [int(v) for v in islice(values, self.tokens.numel())]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if self.lp_rows:
            num = len(self.lp_rows)
            n = self.top_vals.shape[1] if self.top_vals is not None else 0
            chosen = list(islice(values, num))
            vals = list(islice(values, num * n))
            ids = [int(v) for v in islice(values, num * n)]
            for j, i in enumerate(self.lp_rows):
                k = reqs[i].params.logprobs
                top = tuple(zip(ids[j * n : j * n + k], vals[j * n : j * n + k], strict=True)) if k else ()
                out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return tokens, out


@dataclass
class PendingSample:
    """A sampler call drawn on the device and not read back yet: `parts()` go down in the step's one device-to-host
    copy (with whatever else the step reads, e.g. a speculative verification's draws), `read` turns their values,
    in the order `parts()` gave them, into the output."""

    reqs: list[Request]
    groups: list[tuple[list[int], _Drawn]]  # (rows of reqs, their draws), full-vocabulary rows first
    failed: list[int]  # rows whose own token constraint raised

    def parts(self) -> list[torch.Tensor]:
        return [t for _, g in self.groups for t in g.parts()]

    def read(self, values: Iterator[float]) -> SamplerOutput:
        """Consumes exactly this call's values from `values`."""
        tokens: list[int] = [0] * len(self.reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(self.reqs)
        for rows, g in self.groups:
            toks, lps = g.unpack(values, [self.reqs[i] for i in rows])
            for j, i in enumerate(rows):
                tokens[i], logprobs[i] = toks[j], lps[j]
        return SamplerOutput(tokens, logprobs, self.failed)


def _checked_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A constraint's mask as given, if it is bool [vocab] (else the constraint fails, as a mask it raised)."""
    if mask.dtype != torch.bool or tuple(mask.shape) != (vocab,):
        raise ValueError(f"a token mask must be bool [{vocab}], got {mask.dtype} {list(mask.shape)}")
    return mask


def _adjust(logits: torch.Tensor, reqs: list, failed: list[int] | None) -> None:
    """Constraints with an `adjust_logits` hook edit their row in place (after bias and mask; Whisper's timestamp
    rule reads the distribution), on the device, with no host sync. One that raises is added to `failed` (None:
    the exception propagates)."""
    for i, r in enumerate(reqs):
        adjust = getattr(r.constraint, "adjust_logits", None)
        if adjust is None or (failed is not None and i in failed):
            continue
        try:
            adjust(logits[i], r.output_token_ids)
        except Exception:
            if failed is None:
                raise
            log.exception("token constraint of %s failed", r.request_id)
            failed.append(i)


def _apply_masks(logits: torch.Tensor, masked: list[tuple[int, torch.Tensor]], first_id: int = 0) -> None:
    """Set what each row's mask forbids to -inf (masks [V] bool; host masks go to the device in one copy). Logits of a
    vocabulary window (column j = token first_id + j) take the masks' columns of that window."""
    dev = logits.device
    if masked and (first_id or logits.shape[1] < masked[0][1].shape[0]):
        masked = [(i, m[first_id : first_id + logits.shape[1]]) for i, m in masked]
    moved = [(i, m) for i, m in masked if m.device == dev]
    host = [(i, m) for i, m in masked if m.device != dev]
    if host:
        stacked = to_device(torch.stack([m.cpu() for _, m in host]), dev)  # [R, V]
        moved += [(i, stacked[j]) for j, (i, _) in enumerate(host)]
    for i, m in moved:
        logits[i].masked_fill_(~m, NEG_INF)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.transfer = HostTransfer()

    def __call__(self, logits: torch.Tensor, reqs: list[Request], first_id: int = 0) -> SamplerOutput:
        """One token per row. Writes into `logits` (no copy: the engine passes rows it does not read again) and makes
        one device-to-host copy in all (`HostTransfer`): ids, chosen logprobs and top-N together.

        logits: [B, V] float32, or [B, W] over a vocabulary window (column j = token first_id + j) that holds every
        id the rows' constraints admit (engine/vocab_window.py); ids outside it are never drawn."""
        pending = self.draw(logits, reqs, first_id)
        return pending.read(iter(self.transfer(pending.parts())))

    def draw(self, logits: torch.Tensor, reqs: list[Request], first_id: int = 0) -> PendingSample:
        """`__call__` without the read back: every draw queued on the device, nothing read on the host. The engine
        reads it together with the step's other draws (one copy per step)."""
        self._apply_bias_and_bans(logits, reqs, first_id)
        candidates: list[torch.Tensor | None] = []
        failed: list[int] = []
        masked: list[tuple[int, torch.Tensor]] = []
        for i, r in enumerate(reqs):
            c = r.constraint
            ids = None
            if c is not None:
                try:
                    fast = getattr(c, "allowed_ids", None)
                    ids = fast(r.output_token_ids) if callable(fast) else None
                    if ids is None:
                        allowed = c.allowed(r.output_token_ids)
                        if allowed is not None:
                            masked.append((i, _checked_mask(allowed, logits.shape[1])))
                except Exception:
                    log.exception("token constraint of %s failed", r.request_id)
                    failed.append(i)
                    ids = None
            candidates.append(ids)
        _apply_masks(logits, masked, first_id)
        _adjust(logits, reqs, failed)
        full = [i for i, c in enumerate(candidates) if c is None and i not in failed]
        compact = [i for i, c in enumerate(candidates) if c is not None and i not in failed]
        groups: list[tuple[list[int], _Drawn]] = []
        for rows, cands in ((full, None), (compact, [candidates[i] for i in compact])):
            if rows:
                sub = take_rows(logits, rows)
                groups.append((rows, self._sample_group(sub, [reqs[i] for i in rows], cands, first_id)))
        return PendingSample(reqs, groups, failed)

    def distributions(
        self, logits: torch.Tensor, reqs: list, logprob_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next-token distributions [B, V] plain sampling would draw from, without drawing: the same processing
        (bias and bans, the constraint's mask, penalties; for sampled rows temperature and top-k / top-p / min-p).
        Greedy rows get the softmax of their processed logits: their token is its argmax. With `logprob_rows`, also
        those rows' log-softmax of the processed logits before temperature ([L, V]: what plain sampling reports as
        logprobs). Speculative verification uses this; a constraint that raises propagates (the caller fails that
        request). Writes into `logits`."""
        self._apply_bias_and_bans(logits, reqs)
        masked = []
        for i, r in enumerate(reqs):
            allowed = r.constraint.allowed(r.output_token_ids) if r.constraint is not None else None
            if allowed is not None:
                masked.append((i, _checked_mask(allowed, logits.shape[1])))
        _apply_masks(logits, masked)
        _adjust(logits, reqs, None)
        self._apply_penalties(logits, reqs, None)
        logprobs = take_rows(logits, logprob_rows).log_softmax(dim=-1) if logprob_rows else None
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if sampled:
            dev = logits.device
            temp = to_device([reqs[i].params.temperature for i in sampled], dev)[:, None]
            rows = [reqs[i] for i in sampled]
            scaled = divide_by_temperature(take_rows(logits, sampled), temp)
            filtered = apply_top_k_top_p_min_p(scaled, *filters_of(rows, dev))
            logits.index_copy_(0, to_device(sampled, dev, torch.long), filtered)
        return logits.softmax(dim=-1), logprobs

    def _sample_group(
        self, logits: torch.Tensor, reqs: list[Request], cands: list[torch.Tensor] | None, first_id: int = 0
    ) -> _Drawn:
        """Draw one token per row of a group (all rows on the full vocabulary or window, or all compacted to
        candidates); returns the draws on the device, read back by the caller's one transfer."""
        dev = logits.device
        cand = None
        sizes = [logits.shape[1]] * len(reqs)
        if cands is not None:  # compact each row to its candidate ids, padded with -inf
            sizes = [len(c) for c in cands]
            width = max(sizes)
            cand = to_device(torch.stack([torch.cat([c, c[-1:].expand(width - len(c))]) for c in cands]), dev)  # [R,K]
            logits = logits.gather(1, cand - first_id if first_id else cand)
            if min(sizes) < width:
                logits.masked_fill_(torch.arange(width, device=dev)[None, :] >= to_device(sizes, dev)[:, None], NEG_INF)
        self._apply_penalties(logits, reqs, cand, first_id)

        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        logprobs_all = take_rows(logits, lp_rows).log_softmax(dim=-1) if lp_rows else None
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if not sampled:  # column in this group's logits
            picked = logits.argmax(dim=-1)
        elif not greedy:
            picked = self._sample(logits, reqs, sizes)
        else:
            picked = torch.empty(len(reqs), dtype=torch.long, device=dev)
            g, s = to_device(greedy, dev, torch.long), to_device(sampled, dev, torch.long)
            picked.index_copy_(0, g, logits.index_select(0, g).argmax(dim=-1))
            sub = self._sample(logits.index_select(0, s), [reqs[i] for i in sampled], [sizes[i] for i in sampled])
            picked.index_copy_(0, s, sub)
        tokens = picked + first_id if cand is None else cand.gather(1, picked.unsqueeze(1)).squeeze(1)
        # A row's pick is -inf only when all of it is (a sampled row's NaN softmax included): marked on the device,
        # read back with the tokens, so it costs no host sync.
        dead = logits.gather(1, picked.unsqueeze(1)).squeeze(1) == NEG_INF
        drawn = _Drawn(tokens.masked_fill(dead, NOTHING_ALLOWED), lp_rows)
        if lp_rows:
            assert logprobs_all is not None
            top_n = max(reqs[i].params.logprobs for i in lp_rows)
            lp_picked = take_rows(picked, lp_rows)
            drawn.chosen = logprobs_all.gather(1, lp_picked.unsqueeze(1)).squeeze(1)  # [L]
            if top_n:
                drawn.top_vals, top_cols = logprobs_all.topk(min(top_n, logprobs_all.shape[1]), dim=-1)  # [L, n]
                drawn.top_ids = top_cols + first_id if cand is None else take_rows(cand, lp_rows).gather(1, top_cols)
        return drawn

    def _apply_bias_and_bans(self, logits: torch.Tensor, reqs: list[Request], first_id: int = 0) -> None:
        """Bans (-inf) and bias at vocabulary ids; over a window (column j = token first_id + j) ids outside it are
        skipped: the rows' constraints forbid them anyway."""
        width = logits.shape[1]
        bias_rows, bias_cols, bias_vals = [], [], []
        ban_rows, ban_cols = [], []
        for i, r in enumerate(reqs):
            p = r.params
            if p.logit_bias:
                for tok, b in p.logit_bias.items():
                    if first_id <= tok < first_id + width:
                        bias_rows.append(i)
                        bias_cols.append(tok - first_id)
                        bias_vals.append(float(b))
            if r.num_output_tokens < p.min_tokens and not getattr(r.constraint, "must_end", False):
                # a finished grammar admits only EOS: it wins over min_tokens (engine/structured.py)
                banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(r.eos_token_ids))
                banned = [t - first_id for t in banned if first_id <= t < first_id + width]
                ban_rows += [i] * len(banned)
                ban_cols += banned
        dev = logits.device
        if ban_rows:  # bans first, then bias: a banned token stays -inf whatever its bias
            idx = (to_device(ban_rows, dev, torch.long), to_device(ban_cols, dev, torch.long))
            logits.index_put_(idx, torch.full((), NEG_INF, device=dev))  # a fill kernel: no host copy
        if bias_rows:
            idx = (to_device(bias_rows, dev, torch.long), to_device(bias_cols, dev, torch.long))
            logits.index_put_(idx, to_device(bias_vals, dev), accumulate=True)

    def _apply_penalties(
        self, logits: torch.Tensor, reqs: list[Request], cand: torch.Tensor | None, first_id: int = 0
    ) -> None:
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        ]
        if not rows:
            return
        dev = logits.device
        size = max(self.vocab_size, first_id + logits.shape[1])
        kept = [penalty_counts_of(reqs[i], size, dev) for i in rows]

        def counts_of(rows_counts: list[torch.Tensor]) -> torch.Tensor:  # [R, K] (or [R, V] / [R, W])
            return gather_counts(
                rows_counts, None if cand is None else take_rows(cand, rows), first_id, logits.shape[1]
            )

        # Which penalties apply is read from the host values: `(t != 0).any()` on a device tensor waits for the GPU.
        params = [reqs[i].params for i in rows]
        sub = take_rows(logits, rows)
        counts = counts_of([k.output.update(reqs[i].output_token_ids) for k, i in zip(kept, rows, strict=True)])
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = to_device([p.repetition_penalty for p in params], dev).unsqueeze(1)
            prompt = counts_of([k.prompt.update(reqs[i].prompt_token_ids) for k, i in zip(kept, rows, strict=True)])
            seen = (prompt > 0) | (counts > 0)
            penalised = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalised, sub)
        if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
            freq = to_device([p.frequency_penalty for p in params], dev).unsqueeze(1)
            pres = to_device([p.presence_penalty for p in params], dev).unsqueeze(1)
            sub = sub - freq * counts - pres * (counts > 0).float()
        if sub is not logits:
            logits.index_copy_(0, to_device(rows, dev, torch.long), sub)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], sizes: list[int]) -> torch.Tensor:
        dev = logits.device
        temp = to_device([r.params.temperature for r in reqs], dev).unsqueeze(1)
        logits = divide_by_temperature(logits, temp)
        logits = apply_top_k_top_p_min_p(logits, *filters_of(reqs, dev))
        probs = logits.softmax(dim=-1)
        unseeded = [j for j, r in enumerate(reqs) if r.generator is None]
        if len(unseeded) == len(reqs):
            noise = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
        else:
            noise = torch.ones_like(probs)
            if unseeded:
                draws = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
                noise.index_copy_(0, to_device(unseeded, dev, torch.long), draws)
        for j, r in enumerate(reqs):
            if r.generator is not None:  # exactly this row's own number of draws, whatever shares the batch
                noise[j, : sizes[j]].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)
