"""Speculative decoding: proposals, and their exact verification in the step that computes them.

A proposer gives a decoding request k draft tokens (and, for a draft model, the distributions q it drew them from;
n-gram proposals are point masses). The step computes the last committed token plus the drafts in one chunk, so the
target model's logits for every position come from one forward pass. Verification then processes row j of each
request exactly as plain sampling would have with the drafts before it accepted (penalties over output + drafts,
logit bias, min-tokens bans, the request's own constraint advanced over the drafts, temperature, top-k / top-p /
min-p) into p_j, and:
- greedy rows accept d_j while d_j == argmax p_j, then take argmax p_j;
- sampled rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection they draw from
  norm(max(p_j - q_j, 0)); when every draft is accepted, a bonus token comes from p_k.
This is the standard rejection scheme (Leviathan et al. 2023; vLLM's rejection_sampler.py): the accepted tokens are
distributed exactly as plain sampling's. Seeded requests draw their uniforms and noise from their own generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from omnivox.engine.outputs import TokenLogprob
from omnivox.engine.request import Request
from omnivox.engine.sampler import NOTHING_ALLOWED
from omnivox.engine.transfer import to_device

NEG_INF = float("-inf")


@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), vocab] draft distributions; None = point masses on the tokens


# A proposer returns the draft tokens for a request (a list, or a Proposal with the draft's distributions).
Proposer = Callable[[Request], "list[int] | Proposal"]


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram of the context (between min_n and max_n tokens) that occurred earlier
    proposes the (up to) k tokens that followed its most recent earlier occurrence. Costs no model at all; pays off on
    text that repeats its context (editing, summarising, code), and is turned off per request when it does not."""

    def __init__(self, k: int = 4, min_n: int = 2, max_n: int = 5, window: int = 2048) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.k, self.min_n, self.max_n, self.window = k, min_n, max_n, window

    def __call__(self, req: Request) -> list[int]:
        ctx = req.token_slice(max(0, req.num_tokens - self.window), req.num_tokens)
        n_ctx = len(ctx)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            suffix = ctx[n_ctx - n :]
            first = suffix[0]
            for i in range(n_ctx - n - 1, -1, -1):  # most recent earlier occurrence first
                if ctx[i] == first and ctx[i : i + n] == suffix:
                    follow = ctx[i + n : i + n + self.k]
                    if follow:
                        return follow
        return []


@dataclass
class AcceptanceGate:
    """Speculation turns itself off where it cannot pay: for the whole step when the batch is large enough to be
    compute-bound (verifying k extra tokens per request then costs real time), and per request while its measured
    acceptance rate (an exponential average) is poor. A request that was switched off is probed again now and then."""

    max_batch: int = 8
    min_acceptance: float = 0.25
    retry_every: int = 16
    _rate: dict[str, float] = field(default_factory=dict)
    _skipped: dict[str, int] = field(default_factory=dict)

    def wants(self, req: Request, batch: int) -> bool:
        if batch > self.max_batch:
            return False
        rate = self._rate.get(req.request_id, 1.0)
        if rate >= self.min_acceptance:
            return True
        skipped = self._skipped.get(req.request_id, 0) + 1
        self._skipped[req.request_id] = skipped
        return skipped % self.retry_every == 0

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        if drafted:
            old = self._rate.get(req.request_id, 1.0)
            self._rate[req.request_id] = 0.7 * old + 0.3 * (accepted / drafted)

    def forget(self, request_id: str) -> None:
        self._rate.pop(request_id, None)
        self._skipped.pop(request_id, None)


def resolve(
    p: torch.Tensor,  # [N, V] target distributions at one position
    q: torch.Tensor | None,  # [N, V] draft distributions, None = point masses on the drafts
    drafts: torch.Tensor,  # [N] draft tokens (drawn from q)
    u: torch.Tensor,  # [N] uniforms in [0, 1)
    noise: torch.Tensor,  # [N, V] Exp(1) draws for the residual sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the rejection scheme for N rows: (accepted [N] bool, the token each row ends with)."""
    idx = drafts.unsqueeze(1)
    p_d = p.gather(1, idx).squeeze(1)
    if q is None:
        q_d = torch.ones_like(p_d)
        residual = p.scatter(1, idx, 0.0)
    else:
        q_d = q.gather(1, idx).squeeze(1)
        residual = (p - q).clamp_min(0.0)
    accept = (q_d > 0) & (u < torch.clamp(p_d / q_d.clamp_min(1e-30), max=1.0))
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: a rejection cannot happen; keep the draw well defined
    residual = torch.where(empty, p, residual)
    resampled = (residual / noise).argmax(dim=1)  # exponential-noise draw: no normalisation needed
    return accept, torch.where(accept, drafts, resampled)


@dataclass
class _Logprobs:
    """Where one request's logprobs lie in the step's copy: for each of its `rows` verification rows the logprob of
    the row's token (the token the row ends with if reached), then the rows' top-`top` values and ids."""

    offset: int
    rows: int
    top: int

    @property
    def size(self) -> int:
        return self.rows * (1 + 2 * self.top)

    def read(self, values: list[float], tokens: list[int]) -> list[TokenLogprob | None]:
        o, n, t = self.offset, self.rows, self.top
        vals, ids = values[o + n : o + n + n * t], values[o + n + n * t : o + n + 2 * n * t]
        return [
            TokenLogprob(
                tok,
                values[o + j],
                tuple((int(i), v) for i, v in zip(ids[j * t : j * t + t], vals[j * t : j * t + t], strict=True)),
            )
            for j, tok in enumerate(tokens)
        ]


@dataclass
class _Draws:
    """One request's verification, drawn on the device and read back with the step's other requests in one copy."""

    drafts: list[int]
    greedy: bool
    offset: int  # greedy: its first row in the step's argmax picks; sampled: where its draws start in the copy
    gen: torch.Generator | None = None
    state: torch.Tensor | None = None  # gen's state before the bonus draw (restored when a draft is rejected)
    lp: _Logprobs | None = None  # when the request asked for logprobs

    def tokens(self, values: list[float]) -> list[int]:
        """The tokens this request accepts: the accepted drafts, then one corrected or bonus token."""
        k, o = len(self.drafts), self.offset
        if self.greedy:  # values[o + j]: argmax p_j
            picks = [int(v) for v in values[o : o + k + 1]]
            n = next((j for j in range(k) if self.drafts[j] != picks[j]), k)
            return self.drafts[:n] + [picks[n]]
        accept, tokens, bonus = values[o : o + k], values[o + k : o + 2 * k], values[o + 2 * k]
        n = next((j for j in range(k) if not accept[j]), k)
        if n == k:
            return self.drafts + [int(bonus)]
        if self.gen is not None:  # the bonus draw was not needed: the generator continues as if never made
            self.gen.set_state(self.state)
        return self.drafts[:n] + [int(tokens[n])]


def _draw_sampled(
    probs: torch.Tensor,  # [k + 1, V] processed target distributions p_0..p_k
    drafts: list[int],  # k draft tokens
    q: torch.Tensor | None,  # [k, V] draft distributions, None = point masses
    gen: torch.Generator | None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The rejection scheme's draws for one sampled request, on the device: [accepted k | token k | bonus 1], and the
    generator's state before the bonus draw. The bonus is drawn before knowing whether every draft is accepted (that
    would need a host read per request); a seeded request's generator is set back when it was not needed, so its
    stream is the one it would be with the bonus drawn only when needed."""
    k = len(drafts)
    dev = probs.device
    u = torch.rand(k, generator=gen, device=dev) if gen is not None else torch.rand(k, device=dev)
    noise = torch.empty_like(probs[:k]).exponential_(generator=gen)
    accept, tokens = resolve(probs[:k], q, to_device(drafts, dev, torch.long), u, noise)
    state = gen.get_state() if gen is not None else None
    bonus = (probs[k] / torch.empty_like(probs[k]).exponential_(generator=gen)).argmax()
    dead = probs[:, 0].isnan()  # [k + 1]: nothing allowed at that row (all -inf: a NaN softmax)
    tokens = tokens.masked_fill(dead[:k], NOTHING_ALLOWED)
    return [accept, tokens, bonus.masked_fill(dead[k], NOTHING_ALLOWED)], state


class _FixedMask:
    """A constraint stand-in that answers with one precomputed mask (a verification row's), and whether the grammar
    was finished at that row (`must_end`: only EOS may follow, which wins over min_tokens). The constraint's
    `adjust_logits` hook comes along (Whisper's timestamp rule): it reads the row's output, drafts included, so it
    must be a function of that output alone (the sampler calls it for rows that may then be rejected)."""

    def __init__(self, mask: torch.Tensor | None, must_end: bool = False, adjust: Callable | None = None) -> None:
        self.mask = mask
        self.must_end = must_end
        if adjust is not None:  # the sampler looks the hook up by name: absent, not None, when there is none
            self.adjust_logits = adjust

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor | None:
        return self.mask


class _RowView:
    """What the sampler reads of a request, as it stands after `extra` drafts were accepted (verification row j)."""

    def __init__(self, req: Request, extra: list[int], mask: torch.Tensor | None, must_end: bool = False) -> None:
        self.request_id = req.request_id
        self.params = req.params
        self.prompt_token_ids = req.prompt_token_ids
        self.eos_token_ids = req.eos_token_ids
        self.generator = req.generator
        self.output_token_ids = req.output_token_ids + extra
        c = req.constraint
        self.constraint = _FixedMask(mask, must_end, getattr(c, "adjust_logits", None)) if c is not None else None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def constraint_masks(req: Request, drafts: list[int]) -> tuple[list[int], list[torch.Tensor | None], list[bool]]:
    """The request's constraint masks and finished flags for rows 0..len(drafts) (its state advanced over the drafts,
    then rolled back), with the drafts cut at the first one the constraint rejects."""
    c = req.constraint
    if c is None:
        return drafts, [None] * (len(drafts) + 1), [False] * (len(drafts) + 1)
    advance, rollback = getattr(c, "advance", None), getattr(c, "rollback", None)
    masks: list[torch.Tensor | None] = []
    ends: list[bool] = []
    out = list(req.output_token_ids)
    advanced = 0
    try:
        for j in range(len(drafts) + 1):
            mask = c.allowed(out)
            masks.append(mask)
            ends.append(bool(getattr(c, "must_end", False)))
            if j == len(drafts):
                break
            if mask is not None and not bool(mask[drafts[j]]):
                drafts = drafts[:j]
                break
            if advance is not None:
                advance([drafts[j]])
                advanced += 1
            out.append(drafts[j])
    finally:
        if advanced and rollback is not None:
            rollback(advanced)
    return drafts, masks, ends


@dataclass
class PendingVerification:
    """A verification drawn on the device and not read back yet: `parts` go down in the step's one device-to-host
    copy (with the plain rows' draws), `read` takes their values (this verification's own, from index 0)."""

    reqs: list[Request]
    parts: list[torch.Tensor]
    draws: list[_Draws | None]  # per request; None: its constraint raised

    def read(self, values: list[float]) -> list[tuple[list[int], list[TokenLogprob | None]] | None]:
        """Per request: (its accepted tokens, their logprobs: None each unless asked for), or None."""
        out: list[tuple[list[int], list[TokenLogprob | None]] | None] = []
        for d in self.draws:
            if d is None:
                out.append(None)
                continue
            tokens = d.tokens(values)
            out.append((tokens, d.lp.read(values, tokens) if d.lp is not None else [None] * len(tokens)))
        return out


def verify_requests(
    sampler, rows: list[torch.Tensor], reqs: list[Request], qs: list[torch.Tensor | None]
) -> list[list[int] | None]:
    """Each request's accepted tokens (None: its constraint raised). rows[i]: the logits [1 + drafts, V] of request i
    (whose draft_token_ids are cut here to what its constraint admits). One device-to-host copy."""
    pending = draw_verification(sampler, rows, reqs, qs)
    return [got[0] if got is not None else None for got in pending.read(sampler.transfer(pending.parts))]


def draw_verification(
    sampler, rows: list[torch.Tensor], reqs: list[Request], qs: list[torch.Tensor | None]
) -> PendingVerification:
    """`verify_requests` without the read back: the target distributions and every draw queued on the device."""
    views, spans, cut = [], [], []
    for req, logits in zip(reqs, rows, strict=True):
        try:
            drafts, masks, ends = constraint_masks(req, list(req.draft_token_ids))
        except Exception:
            cut.append(None)
            continue
        req.draft_token_ids = drafts
        start = len(views)
        views += [_RowView(req, drafts[:j], masks[j], ends[j]) for j in range(len(drafts) + 1)]
        spans.append((start, len(drafts) + 1))
        cut.append(logits[: len(drafts) + 1])
    if not views:
        return PendingVerification(reqs, [], [None] * len(reqs))
    lp_views = [i for i, v in enumerate(views) if v.params.logprobs is not None]
    probs, logprobs = sampler.distributions(torch.cat([c for c in cut if c is not None]), views, lp_views)
    lp_first = {row: j for j, row in reversed(list(enumerate(lp_views)))}  # a request's rows are contiguous
    # Everything the host needs goes down in one copy (the sampler's transfer, shared with the step's plain rows):
    # greedy picks for every row at once, then each sampled request's draws.
    greedy = any(req.params.is_greedy for req, c in zip(reqs, cut, strict=True) if c is not None)
    # A row with nothing allowed (all -inf: its softmax is NaN) picks NOTHING_ALLOWED; reached, it fails the request.
    picks = probs.argmax(dim=-1).masked_fill(probs[:, 0].isnan(), NOTHING_ALLOWED) if greedy else None
    parts: list[torch.Tensor] = [picks] if picks is not None else []
    offset = probs.shape[0] if greedy else 0
    pending: list[_Draws | None] = []
    spans_iter = iter(spans)
    for req, c, q in zip(reqs, cut, qs, strict=True):
        if c is None:
            pending.append(None)
            continue
        start, n = next(spans_iter)
        drafts = req.draft_token_ids
        if req.params.is_greedy:
            draw = _Draws(drafts, True, start)
        else:
            q_rows = q[: n - 1] if q is not None else None
            draws, state = _draw_sampled(probs[start : start + n], drafts, q_rows, req.generator)
            draw = _Draws(drafts, False, offset, req.generator, state)
            parts += draws
            offset += 2 * len(drafts) + 1
        if logprobs is not None and req.params.logprobs is not None:
            if req.params.is_greedy:  # each reached row's token: its argmax
                assert picks is not None
                row_tokens = picks[start : start + n]
            else:  # a reached row's token: its accepted draft or correction, then the bonus
                row_tokens = torch.cat([draws[1], draws[2].view(1)])
            lp = logprobs[lp_first[start] : lp_first[start] + n]  # [n, V]
            draw.lp = _Logprobs(offset, n, min(req.params.logprobs, lp.shape[1]))
            parts.append(lp.gather(1, row_tokens.clamp_min(0).unsqueeze(1)).squeeze(1))  # [n]
            if draw.lp.top:
                top_vals, top_ids = lp.topk(draw.lp.top, dim=-1)  # [n, top]
                parts += [top_vals.flatten(), top_ids.flatten()]
            offset += draw.lp.size
        pending.append(draw)
    return PendingVerification(reqs, parts, pending)
