"""The engine core: one step = schedule, run the model, sample, verify drafts. Nothing about text or consumers.

`EngineCore.step()` returns a typed `StepResult`: the plan it ran, the tokens each request accepted, the requests
that failed, and the step's statistics (what metrics read). Stop rules live on the output side
(engine/output_processor.py), which tells the core which requests to finish.

Multi-token steps: a proposer may give a decoding request draft tokens; the step computes the last committed token
plus the drafts in one chunk and engine/speculative.py verifies every position as plain sampling would have produced
it (greedy rows by argmax, sampled rows by rejection sampling, exact in distribution; each accepted token's logprobs
when asked for). The K/V of rejected drafts is rolled back (its blocks freed) and never enters the prefix cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from omnivox.engine.block_pool import BlockPool
from omnivox.engine.errors import InvalidRequest, ModelGroupBroken
from omnivox.engine.frame_step import FrameStep
from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.outputs import TokenLogprob
from omnivox.engine.request import Request
from omnivox.engine.runner import ModelRunner
from omnivox.engine.sampler import NOTHING_ALLOWED, PendingSample, Sampler
from omnivox.engine.scheduler import ScheduledChunk, SchedulePlan, Scheduler
from omnivox.engine.speculative import AcceptanceGate, PendingVerification, Proposal, Proposer, draw_verification
from omnivox.engine.structured import GrammarMasks
from omnivox.engine.transfer import take_rows
from omnivox.engine.vocab_window import logit_window
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one step did (the numbers metrics are made of)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # one per decoding request plus its drafts
    num_admitted: int = 0
    num_preempted: int = 0
    num_drafted: int = 0  # draft tokens verified this step
    num_accepted: int = 0  # of those, accepted
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at position 0, 1, ...
    num_running: int = 0  # after the step
    num_waiting: int = 0  # after the step
    kv_free_blocks: int = 0  # after the step
    seconds: float = 0.0  # wall time of schedule + run + sample


@dataclass
class Accepted:
    """The tokens one request accepted this step, in order, with their logprobs when asked for."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class StepResult:
    plan: SchedulePlan
    accepted: list[Accepted] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # their step or their own constraint failed
    stats: StepStats = field(default_factory=StepStats)


class EngineCore:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        static_decode: bool | None = None,
        proposer: Proposer | None = None,
        max_model_len: int | None = None,
    ) -> None:
        param = next(model.parameters())
        # A frame model's step ends with its depth decoder (engine/frame_step.py); its next inputs are embedding
        # segments, which the fixed-shape decode path does not read, and a draft's frames would have no codes.
        self.frame_step = FrameStep(model) if getattr(model, "emits_frames", False) else None
        if self.frame_step is not None:
            static_decode = False
            if proposer is not None:
                raise ValueError("speculative decoding does not apply to models that emit frames")
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # Blocks behind the window are released only when every layer slides (a full-attention layer reads them all).
        self.kv = KVCacheManager(self.pool, model.config.window_everywhere)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(
            model, num_blocks, block_size, param.device, param.dtype, max_num_seqs, static_decode=static_decode
        )
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(model.config.vocab_size, param.device)
        self.grammar_masks = GrammarMasks(model.config.vocab_size)  # filled while the model runs (structured.py)
        self.proposer = proposer
        self.gate = AcceptanceGate() if proposer is not None else None
        self._draft_q: dict[str, torch.Tensor] = {}  # a draft model's distributions for this step's drafts
        self.max_model_len = max_model_len or model.config.max_model_len
        self.num_steps = 0

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request (stop, length, abort, error) and free its blocks at once."""
        req.draft_token_ids.clear()
        if self.gate is not None:
            self.gate.forget(req.request_id)
            forget = getattr(self.proposer, "forget", None)  # a draft model frees its shadow's blocks
            if forget is not None:
                forget(req.request_id)
        self.scheduler.finish(req, reason)
        for seg in req.segments:  # encoder-cache references go with the request, whatever ended it
            seg.release()
        if req.encoder_input is not None:
            req.encoder_input.release()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _propose(self) -> None:
        if self.proposer is None or self.gate is None:
            return
        self._draft_q.clear()
        batch = len(self.scheduler.running)
        for req in self.scheduler.running:
            if not (req.num_output_tokens and req.num_computed_tokens == req.num_tokens - 1):
                continue  # still prefilling
            if not self.gate.wants(req, batch):
                continue
            proposal = self.proposer(req)
            tokens, q = (proposal.tokens, proposal.q) if isinstance(proposal, Proposal) else (list(proposal), None)
            # Never past the context or max_tokens: a step yields at most drafts + 1 tokens.
            room = max(min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1, 0)
            req.draft_token_ids = list(tokens[:room])
            if q is not None and req.draft_token_ids:
                self._draft_q[req.request_id] = q[:room]

    def step(self, audio_behind: bool = False) -> StepResult:
        """One step; audio_behind: another engine's audio is behind its deadline (engine/scheduler.py)."""
        t0 = time.perf_counter()
        self._propose()
        plan = self.scheduler.schedule(audio_behind)
        result = StepResult(plan)
        self._drop_failed_segments(plan, result)
        if not plan.is_empty:
            self.num_steps += 1
            self._run(plan, result)
        s = result.stats
        s.num_prefill_tokens = sum(c.num_tokens for c in plan.prefills)
        s.num_decode_tokens = sum(c.num_tokens for c in plan.decodes)
        s.num_admitted, s.num_preempted = len(plan.admitted), len(plan.preempted)
        s.num_running, s.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.kv_free_blocks = self.pool.num_free
        s.seconds = time.perf_counter() - t0
        return result

    @staticmethod
    def _drop_failed_segments(plan: SchedulePlan, result: StepResult) -> None:
        """A chunk whose embeddings can never come (its encoder failed) fails its request, not the step."""
        for chunks in (plan.decodes, plan.prefills):
            for c in list(chunks):
                enc = c.request.encoder_input
                if (enc is not None and enc.failed()) or any(
                    s.failed() and s.end > c.start and s.start < c.end for s in c.request.segments
                ):
                    chunks.remove(c)
                    result.failed.append(c.request)

    def _run(self, plan: SchedulePlan, result: StepResult) -> None:
        try:
            window = self._logit_window(plan)  # project only the vocabulary rows the samples can be (vocab_window.py)
            with self.grammar_masks.overlap(c.request for c in plan.chunks):
                logits, sampling = self.runner.execute(plan, window)
        except ModelGroupBroken:  # no request can run another step: the engine stops (engine.py _fail_all)
            raise
        except Exception:
            log.exception("engine step failed; failing the %d requests in it", len(plan.chunks))
            result.failed += [c.request for c in plan.chunks]
            return
        for c in plan.chunks:  # committed positions computed; drafts are settled after verification
            c.request.num_computed_tokens = min(c.end, c.request.num_tokens)
            self.kv.commit_computed(c.request)
        if not sampling:
            return
        assert logits is not None
        firsts, row = [], 0
        for c in sampling:
            firsts.append(row)
            row += c.num_verify
        plain = [(c, f) for c, f in zip(sampling, firsts, strict=True) if c.num_verify == 1]
        spec = [(c, f) for c, f in zip(sampling, firsts, strict=True) if c.num_verify > 1]
        sample = verify = None
        if plain:
            with torch.inference_mode():  # the sampler writes into the runner's logits, which are inference tensors
                sample = self._draw_plain(logits, plain, result, window[0] if window else 0)
        if spec:
            verify = self._draw_verify(logits, spec, result)
        self._read_back(sample, verify, result)
        if self.frame_step is not None:
            self._complete_frames(sampling, result)

    def _complete_frames(self, sampling: list[ScheduledChunk], result: StepResult) -> None:
        """A frame model: codebooks 1..N-1 of every accepted request's frame, in one depth-decoder batch."""
        assert self.frame_step is not None
        rows = {id(c.request): i for i, c in enumerate(sampling)}  # one row each: frame models take no drafts
        accepted = [a for a in result.accepted if id(a.request) in rows]
        if not accepted or self.runner.sampled_hidden is None:
            return
        try:
            index = torch.tensor([rows[id(a.request)] for a in accepted], device=self.runner.device)
            hidden = self.runner.sampled_hidden.index_select(0, index)
            self.frame_step.complete([a.request for a in accepted], [a.token_ids[-1] for a in accepted], hidden)
        except Exception:
            log.exception("the depth decoder failed; failing the %d requests of its frame", len(accepted))
            for a in accepted:
                result.accepted.remove(a)
                result.failed.append(a.request)

    def _logit_window(self, plan: SchedulePlan) -> tuple[int, int] | None:
        """The vocabulary rows this step's samples need (None: all); a step with drafts to verify needs them all."""
        sampling = [c for c in plan.chunks if c.samples]
        if any(c.num_verify > 1 for c in sampling):
            return None
        return logit_window([c.request for c in sampling], self.vocab_size)

    def _draw_plain(
        self, logits: torch.Tensor, chunks: list[tuple[ScheduledChunk, int]], result: StepResult, first_id: int = 0
    ) -> PendingSample | None:
        """first_id: the logits are a vocabulary window, column j being token first_id + j (0 with a full row)."""
        reqs = [c.request for c, _ in chunks]
        try:
            # Every step without drafts samples all rows in order: the logits themselves go in (the sampler writes
            # into them; nothing reads them after). With drafts in the step, the plain rows are copied out.
            return self.sampler.draw(take_rows(logits, [f for _, f in chunks]), reqs, first_id)
        except Exception:  # a sampler bug must not take the engine down: fail these requests, serve the rest
            log.exception("sampling failed; failing the %d requests it served", len(reqs))
            result.failed += reqs
            return None

    def _draw_verify(
        self, logits: torch.Tensor, chunks: list[tuple[ScheduledChunk, int]], result: StepResult
    ) -> PendingVerification | None:
        """Requests with drafts: every row processed as plain sampling would, drafts accepted by rejection sampling
        (exact in distribution; greedy rows by argmax), rejected drafts rolled back when read back."""
        reqs = [c.request for c, _ in chunks]
        rows = [logits[f : f + c.num_verify] for c, f in chunks]
        qs = [self._draft_q.get(r.request_id) for r in reqs]
        try:
            return draw_verification(self.sampler, rows, reqs, qs)
        except Exception:
            log.exception("verifying drafts failed; failing the %d requests it served", len(reqs))
            self._fail_drafted(reqs, result)
            return None

    def _read_back(self, sample: PendingSample | None, verify: PendingVerification | None, result: StepResult) -> None:
        """The plain rows' draws and the verification's, read in one device-to-host copy (on a GPU every read waits
        for the stream: a second one would wait for the step twice), then committed."""
        parts = (sample.parts() if sample else []) + (verify.parts if verify else [])
        try:
            values = self.sampler.transfer(parts)
        except Exception:
            log.exception("reading the step's samples failed; failing its requests")
            result.failed += sample.reqs if sample else []
            self._fail_drafted(verify.reqs if verify else [], result)
            return
        num_plain = sum(p.numel() for p in sample.parts()) if sample else 0
        if sample:
            self._commit_sampled(sample, iter(values[:num_plain]), result)
        if verify:
            self._commit_verified(verify, values[num_plain:], result)

    def _commit_sampled(self, sample: PendingSample, values: Iterator[float], result: StepResult) -> None:
        try:
            out = sample.read(values)
        except Exception:
            log.exception("sampling failed; failing the %d requests it served", len(sample.reqs))
            result.failed += sample.reqs
            return
        for i, req in enumerate(sample.reqs):
            if i in out.failed:
                result.failed.append(req)
            elif out.token_ids[i] == NOTHING_ALLOWED:
                self._fail_nothing_allowed(req, req.num_output_tokens, result)
            else:
                self._commit(req, [out.token_ids[i]], [out.logprobs[i]], result)

    def _commit_verified(self, verify: PendingVerification, values: list[float], result: StepResult) -> None:
        try:
            accepted = verify.read(values)
        except Exception:
            log.exception("verifying drafts failed; failing the %d requests it served", len(verify.reqs))
            accepted = [None] * len(verify.reqs)
        for req, got in zip(verify.reqs, accepted, strict=True):
            if got is None:
                self._fail_drafted([req], result)
                continue
            tokens, lps = got
            if tokens[-1] == NOTHING_ALLOWED:  # reached after the accepted drafts: plain decoding would get there too
                req.draft_token_ids.clear()
                self._fail_nothing_allowed(req, req.num_output_tokens + len(tokens) - 1, result)
                continue
            drafted = len(req.draft_token_ids)
            result.stats.accepted_by_position += [0] * (drafted - len(result.stats.accepted_by_position))
            for j in range(len(tokens) - 1):
                result.stats.accepted_by_position[j] += 1
            if self.gate is not None:
                self.gate.record(req, drafted, len(tokens) - 1)
            self._commit(req, tokens, lps, result)

    @staticmethod
    def _fail_nothing_allowed(req: Request, position: int, result: StepResult) -> None:
        """A row left with no token at all: the request's own doing when its -inf biases (or min_tokens) banned
        everything its constraint admits there. Failed with that InvalidRequest (INVALID_ARGUMENT at the service);
        anything else is an engine fault, failed as one."""
        p = req.params
        rules = "the request's constraint (response format, tool call, speech or transcription rules)"
        if p.logit_bias and any(b == float("-inf") for b in p.logit_bias.values()):
            what = f"every token {rules} allows there" if req.constraint is not None else "every token"
            req.error = InvalidRequest("logit_bias", f"-inf biases ban {what}: output position {position}")
        elif position < p.min_tokens:
            req.error = InvalidRequest(
                "min_tokens", f"output position {position}: {rules} allows only tokens that end the output there"
            )
        else:
            log.error("request %s has no token left to sample at output position %d", req.request_id, position)
        result.failed.append(req)

    @staticmethod
    def _fail_drafted(reqs: list[Request], result: StepResult) -> None:
        for req in reqs:
            req.draft_token_ids.clear()
            result.failed.append(req)

    def _commit(self, req: Request, tokens: list[int], lps: list, result: StepResult) -> None:
        try:
            self._accept(req, tokens, result)
        except Exception:  # its own constraint raised in advance(): fail this request only
            log.exception("token constraint of %s failed", req.request_id)
            result.failed.append(req)
            return
        result.accepted.append(Accepted(req, tokens, lps))

    def _accept(self, req: Request, tokens: list[int], result: StepResult) -> None:
        """Commit the accepted tokens; roll the computed length back past rejected drafts."""
        drafted = len(req.draft_token_ids)
        num_accepted_drafts = len(tokens) - 1
        before = req.num_tokens
        req.draft_token_ids = []
        req.output_token_ids.extend(tokens)
        if drafted:
            result.stats.num_drafted += drafted
            result.stats.num_accepted += num_accepted_drafts
        # K/V is valid for the old last token and the accepted drafts; the last new token is not computed yet. Blocks
        # past that held rejected drafts, or drafts a constraint cut before verification: freed (a no-op otherwise).
        self.kv.rollback(req, before + num_accepted_drafts)
        self.kv.commit_computed(req)
        advance = getattr(req.constraint, "advance", None)  # optional: stateless constraints have none
        if advance is not None:
            advance(tokens)

    def check_integrity(self) -> None:
        """Assert that the block pool and the requests agree (tests call this when the engine is idle)."""
        from omnivox.engine.request import Status

        self.pool.check_integrity()
        assert all(r.status == Status.RUNNING for r in self.scheduler.running)
        assert all(not r.block_table for r in self.scheduler.waiting)
        held = sum(len(r.block_table) - r.num_skipped_blocks for r in self.scheduler.running)
        null = self.pool.null_block
        assert all(
            all(b == null for b in r.block_table[: r.num_skipped_blocks])
            and null not in r.block_table[r.num_skipped_blocks :]
            for r in self.scheduler.running
        ), "a released block still in use, or a live entry pointing at the null block"
        assert held == sum(b.ref_count for b in self.pool.blocks), "block references do not match block tables"
