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
from dataclasses import dataclass

import torch

from omnivox.engine.outputs import TokenLogprob
from omnivox.engine.request import Request

NEG_INF = float("-inf")
log = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    failed: list[int]  # rows whose own token constraint raised: no token for them, the rest sampled normally


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
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
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


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:  # logits [B, V] float32
        logits = logits.clone()
        self._apply_bias_and_bans(logits, reqs)
        candidates: list[torch.Tensor | None] = []
        failed: list[int] = []
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
                            logits[i].masked_fill_(~allowed.to(logits.device), NEG_INF)
                except Exception:
                    log.exception("token constraint of %s failed", r.request_id)
                    failed.append(i)
                    ids = None
            candidates.append(ids)
        tokens: list[int] = [0] * len(reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        full = [i for i, c in enumerate(candidates) if c is None and i not in failed]
        compact = [i for i, c in enumerate(candidates) if c is not None]
        for rows, cands in ((full, None), (compact, [candidates[i] for i in compact])):
            if rows:
                toks, lps = self._sample_group(logits[rows], [reqs[i] for i in rows], cands)
                for j, i in enumerate(rows):
                    tokens[i], logprobs[i] = toks[j], lps[j]
        return SamplerOutput(tokens, logprobs, failed)

    def distributions(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The next-token distributions [B, V] plain sampling would draw from, without drawing: the same processing
        (bias and bans, the constraint's mask, penalties; for sampled rows temperature and top-k / top-p / min-p).
        Greedy rows get the softmax of their processed logits: their token is its argmax. Speculative verification
        uses this; a constraint that raises propagates (the caller fails that request)."""
        logits = logits.clone()
        self._apply_bias_and_bans(logits, reqs)
        for i, r in enumerate(reqs):
            allowed = r.constraint.allowed(r.output_token_ids) if r.constraint is not None else None
            if allowed is not None:
                logits[i].masked_fill_(~allowed.to(logits.device), NEG_INF)
        self._apply_penalties(logits, reqs, None)
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if sampled:
            dev = logits.device
            sub = logits[sampled] / torch.tensor([reqs[i].params.temperature for i in sampled], device=dev)[:, None]
            rows = [reqs[i] for i in sampled]
            logits[sampled] = apply_top_k_top_p_min_p(sub, *_filters(rows, dev))
        return logits.softmax(dim=-1)

    def _sample_group(
        self, logits: torch.Tensor, reqs: list[Request], cands: list[torch.Tensor] | None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        dev = logits.device
        cand = None
        sizes = [logits.shape[1]] * len(reqs)
        if cands is not None:  # compact each row to its candidate ids, padded with -inf
            sizes = [len(c) for c in cands]
            width = max(sizes)
            cand = torch.stack([torch.cat([c, c[-1:].expand(width - len(c))]) for c in cands]).to(dev)  # [R, K]
            logits = logits.gather(1, cand)
            if min(sizes) < width:
                logits.masked_fill_(
                    torch.arange(width, device=dev)[None, :] >= torch.tensor(sizes, device=dev)[:, None], NEG_INF
                )
        self._apply_penalties(logits, reqs, cand)

        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        logprobs_all = logits[lp_rows].log_softmax(dim=-1) if lp_rows else None
        picked = torch.empty(len(reqs), dtype=torch.long, device=dev)  # column in this group's logits
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if greedy:
            picked[greedy] = logits[greedy].argmax(dim=-1)
        if sampled:
            picked[sampled] = self._sample(logits[sampled], [reqs[i] for i in sampled], [sizes[i] for i in sampled])
        token_t = picked if cand is None else cand.gather(1, picked.unsqueeze(1)).squeeze(1)
        token_list = token_t.tolist()

        out_lp: list[TokenLogprob | None] = [None] * len(reqs)
        if lp_rows:
            top_n = max(reqs[i].params.logprobs for i in lp_rows)
            chosen = logprobs_all.gather(1, picked[lp_rows].unsqueeze(1)).squeeze(1).tolist()
            if top_n:
                top_vals, top_cols = logprobs_all.topk(min(top_n, logprobs_all.shape[1]), dim=-1)
                top_ids = top_cols if cand is None else cand[lp_rows].gather(1, top_cols)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(lp_rows):
                n = reqs[i].params.logprobs
                top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else ()
                out_lp[i] = TokenLogprob(token_list[i], chosen[j], top)
        return token_list, out_lp

    def _apply_bias_and_bans(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, r in enumerate(reqs):
            p = r.params
            if p.logit_bias:
                for tok, b in p.logit_bias.items():
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(float(b))
            if r.num_output_tokens < p.min_tokens and not getattr(r.constraint, "must_end", False):
                # a finished grammar admits only EOS: it wins over min_tokens (engine/structured.py)
                banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if banned:
                    logits[i, banned] = NEG_INF
        if bias_rows:
            idx = (torch.tensor(bias_rows, device=logits.device), torch.tensor(bias_cols, device=logits.device))
            logits.index_put_(idx, torch.tensor(bias_vals, device=logits.device), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request], cand: torch.Tensor | None) -> None:
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        ]
        if not rows:
            return
        dev, vocab = logits.device, self.vocab_size

        def counts_of(id_lists: list[list[int]]) -> torch.Tensor:
            if cand is None:
                return _counts(id_lists, len(rows), vocab, dev)  # [R, V]
            return _counts_among(id_lists, cand[rows])  # [R, K]

        sub = logits[rows]
        counts = counts_of([reqs[i].output_token_ids for i in rows])
        rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows], device=dev).unsqueeze(1)
        if (rep != 1.0).any():
            seen = (counts_of([reqs[i].prompt_token_ids for i in rows]) > 0) | (counts > 0)
            penalised = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalised, sub)
        freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows], device=dev).unsqueeze(1)
        pres = torch.tensor([reqs[i].params.presence_penalty for i in rows], device=dev).unsqueeze(1)
        if (freq != 0).any() or (pres != 0).any():
            sub = sub - freq * counts - pres * (counts > 0).float()
        logits[rows] = sub

    def _sample(self, logits: torch.Tensor, reqs: list[Request], sizes: list[int]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev).unsqueeze(1)
        logits = logits / temp
        logits = apply_top_k_top_p_min_p(logits, *_filters(reqs, dev))
        probs = logits.softmax(dim=-1)
        noise = torch.ones_like(probs)
        unseeded = [j for j, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
        for j, r in enumerate(reqs):
            if r.generator is not None:  # exactly this row's own number of draws, whatever shares the batch
                noise[j, : sizes[j]].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)


def _filters(reqs: list, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row top-k, top-p and min-p tensors, each None when no row uses that filter."""
    top_k = top_p = min_p = None
    if any(r.params.top_k > 0 for r in reqs):
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
    if any(r.params.top_p < 1.0 for r in reqs):
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
    if any(r.params.min_p > 0.0 for r in reqs):
        min_p = torch.tensor([r.params.min_p for r in reqs], device=dev)
    return top_k, top_p, min_p


def _counts(id_lists: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id per row."""
    counts = torch.zeros(rows, vocab + 1, device=device)
    longest = max((len(x) for x in id_lists), default=0)
    if longest:
        padded = torch.full((rows, longest), vocab, dtype=torch.long)
        for i, ids in enumerate(id_lists):
            if ids:
                padded[i, : len(ids)] = torch.tensor(ids)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _counts_among(id_lists: list[list[int]], cand: torch.Tensor) -> torch.Tensor:
    """[rows, K] counts of each row's candidate ids (cand [rows, K], ascending per row) in that row's id list."""
    counts = torch.zeros(cand.shape, device=cand.device)
    for i, ids in enumerate(id_lists):
        if ids:
            ids_t = torch.tensor(ids, device=cand.device)
            pos = torch.searchsorted(cand[i], ids_t).clamp(max=cand.shape[1] - 1)
            hit = cand[i, pos] == ids_t
            counts[i].scatter_add_(0, pos[hit], torch.ones(int(hit.sum()), device=cand.device))
    return counts
