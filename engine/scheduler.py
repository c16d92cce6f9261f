"""Continuous batching: which requests compute how many tokens this step.

Policy in one line: every running request gets its next tokens first (a decode is one token, an unfinished prefill a
chunk), then waiting requests are admitted in arrival order while the step's token budget, the sequence limit and the
KV pool allow. When a running request cannot grow, the newest running request is preempted (its blocks freed, it goes
back to the front of the queue and is recomputed later, its prefix likely still cached).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step (= request.num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits give the next token."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulePlan:
    decodes: list[ScheduledChunk] = field(default_factory=list)  # one token each, batched together
    prefills: list[ScheduledChunk] = field(default_factory=list)  # chunks of several tokens (or a lone prompt token)
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status != Status.RUNNING:  # preempted itself: nothing newer to free
                break
            chunk = ScheduledChunk(req, req.num_computed_tokens, n)
            (plan.decodes if n == 1 and req.num_output_tokens else plan.prefills).append(chunk)
            scheduled.append(req)
            budget -= n
            i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _admit(self, plan: SchedulePlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.match_prefix(req)
            req.num_computed_tokens = cached
            n = min(req.num_tokens - cached, budget)
            if not self.kv.allocate(req, n):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            req.status = Status.RUNNING
            self.running.append(req)
            plan.prefills.append(ScheduledChunk(req, cached, n))
            budget -= n

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
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
