"""Continuous batching: which requests compute how many tokens this step.

Policy in one line: every running request gets its next tokens first (a decode is one token plus any draft tokens to
verify, an unfinished prefill a chunk), then waiting requests are admitted in arrival order while the step's token
budget, the sequence limit and the KV pool allow. When a running request cannot grow, the newest running request is
preempted (its blocks freed, it goes back to the front of the queue and is recomputed later, its prefix likely still
cached). A step that preempted admits nothing: the blocks it freed are for the requests already running.
When decodes are running, the prompt tokens of the step (running prefills and admissions) are bounded by
`StepBudget.prefill_tokens` (engine/step_budget.py), so a mixed step costs about a target ITL; while another engine's
audio is behind its deadline (`schedule(audio_behind=True)`, engine/arbiter.py) every step's prompt tokens are cut
further, to `StepBudget.behind_prefill_tokens`.
A prefill chunk stops before an embedding segment whose encoder is still running, and never ends inside a
bidirectional one (a Gemma 3 image, `whole_blocks`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.request import Request, Status
from omnivox.engine.step_budget import StepBudget


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step (= request.num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step (a decode with drafts: 1 + number of drafts)
    num_verify: int = 0  # logit rows this chunk samples from: its last num_verify positions (0: a mid-prompt chunk)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last committed token, so its logits give the next token."""
        return self.num_verify > 0


def _chunk(req: Request, n: int) -> ScheduledChunk:
    end = req.num_computed_tokens + n
    return ScheduledChunk(req, req.num_computed_tokens, n, max(0, end - req.num_tokens + 1))


@dataclass
class SchedulePlan:
    decodes: list[ScheduledChunk] = field(default_factory=list)  # requests past their prompt: 1 token (+ drafts) each
    prefills: list[ScheduledChunk] = field(default_factory=list)  # prompt chunks (or a recomputed prefix)
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue this step
    admitted: list[Request] = field(default_factory=list)  # taken from the waiting queue this step, in order

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


def is_decoding(req: Request) -> bool:
    """Past its prompt: the step computes its last token (plus drafts), not a prompt chunk."""
    return bool(req.num_output_tokens) and req.num_computed_tokens == req.num_tokens - 1


def computable(req: Request, start: int, n: int) -> int:
    """How many of the n tokens from `start` can be computed now: a chunk stops before an embedding segment whose
    encoder has not finished (its positions need the embeddings); an encoder-decoder request computes nothing until
    its encoder input (the cross-attention K/V every position reads) is ready."""
    if req.encoder_input is not None and not req.encoder_input.ready():
        return 0
    for seg in req.segments:  # sorted by start
        if seg.end > start and seg.start < start + n and not seg.ready():
            return max(0, seg.start - start)
    return whole_blocks(req, start, n)


def whole_blocks(req: Request, start: int, n: int) -> int:
    """n, moved so the chunk [start, start + n) does not end inside a bidirectional segment (a Gemma 3 image: its
    tokens attend to each other both ways, so all of its keys must be in the cache or in the chunk when any of its
    queries runs): cut before the segment when the chunk starts before it, else grown to the segment's end, past the
    step's token budget if need be (by less than one image; a chunk that only stopped short would never progress)."""
    end = start + n
    for seg in req.segments:
        if seg.bidirectional and n and seg.start < end < seg.end:
            return seg.start - start if seg.start > start else seg.end - start
    return n


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, budget: StepBudget | None = None
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.budget = budget or StepBudget(max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, audio_behind: bool = False) -> SchedulePlan:
        """This step's plan; audio_behind: another engine's audio stream is behind (prompt tokens cut further)."""
        plan = SchedulePlan()
        budget = self.max_num_batched_tokens
        decode_tokens = sum(1 + len(r.draft_token_ids) for r in self.running if is_decoding(r))
        # The policy: decodes first, prompts fill the rest
        prefill_budget = self.budget.prefill_tokens(decode_tokens, audio_behind)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.draft_token_ids:  # drafts that do not fit this step's budget are dropped, never half-verified
                del req.draft_token_ids[max(0, budget - (req.num_tokens - req.num_computed_tokens)) :]
            decoding = is_decoding(req)
            n = min(req.num_tokens + len(req.draft_token_ids) - req.num_computed_tokens, budget)
            n = n if decoding else min(n, prefill_budget)
            n = computable(req, req.num_computed_tokens, n)
            if n == 0:  # waiting for an encoder: it keeps its place, the others run
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status != Status.RUNNING:  # preempted itself: nothing newer to free
                break
            (plan.decodes if decoding else plan.prefills).append(_chunk(req, n))
            budget -= n
            prefill_budget -= 0 if decoding else n
            i += 1
        if not plan.preempted:
            self._admit(plan, min(budget, prefill_budget))
        return plan

    def _admit(self, plan: SchedulePlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.match_prefix(req)
            req.num_computed_tokens = cached
            for seg in req.segments:  # a segment the prefix cache covers whole is never encoded
                if seg.end > cached:
                    seg.request()
            if req.encoder_input is not None:  # decode steps read it even when the cache covers the whole prompt
                req.encoder_input.request()
            n = computable(req, cached, min(req.num_tokens - cached, budget))
            if not self.kv.allocate(req, n):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            req.status = Status.RUNNING
            self.running.append(req)
            plan.admitted.append(req)
            if n:  # else admitted to wait for its embeddings; it holds only its cached blocks meanwhile
                plan.prefills.append(_chunk(req, n))
            budget -= n

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
        req.draft_token_ids.clear()
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark req finished and free its blocks at once (completion and abort alike)."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        if req.block_table:
            self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
