"""The engine: requests in, tokens out, in four rooms, each with one job.

- intake (engine/intake.py): tokenise, validate, build the Request — on the caller's thread, before anything queues;
- core (engine/core.py): schedule, run, sample, verify — one `StepResult` per step, with its statistics;
- outputs (engine/output_processor.py): stop rules, detokenizer, logprobs, delivery to each request's consumer;
- this file, the driver: the public API (`generate`, `stream`, `add_request`, `abort`) and the background thread.

`step()` is synchronous and single-threaded. `stream()` runs steps on a background thread (torch releases the GIL
while it computes, so an asyncio server keeps serving) and hands each request's outputs to its own asyncio queue.
Everything that touches the scheduler happens on the thread that steps; other threads talk to it through an inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import torch

from omnivox.engine.arbiter import StepArbiter
from omnivox.engine.block_pool import KVUsage
from omnivox.engine.core import EngineCore, Proposer, StepResult
from omnivox.engine.engine_config import EngineConfig
from omnivox.engine.errors import InvalidRequest
from omnivox.engine.intake import Prompt, RequestIntake
from omnivox.engine.loading import default_device, load_model, resolve_dtype, size_kv_cache
from omnivox.engine.output_processor import OutputCallback, OutputProcessor
from omnivox.engine.outputs import RequestOutput
from omnivox.engine.params import SamplingParams
from omnivox.engine.request import EmbeddingSegment, EncoderInput, Request
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel, scale_embeddings

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        tokenizer=None,
        *,
        kv_cache_gib: float | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        static_decode: bool | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """max_num_batched_tokens: tokens one step may compute (decodes + prefill chunks). It bounds how long a step
        takes, so it trades inter-token latency against time to first token; None = 2048 on CUDA, 128 on CPU, where
        one token of a small model already costs ~3 ms of compute and a 512-token step stalled every decode for ~1 s.
        proposer: draft tokens for decoding requests (speculative decoding); None = one token per decode step."""
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.model = model.eval()
        self.tokenizer = tokenizer
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.device.type == "cuda" else 128
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        num_blocks, cfg = size_kv_cache(model, kv_cache_gib, max_num_batched_tokens, max_num_seqs, block_size)
        self.model_config: ModelConfig = cfg
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.core = EngineCore(
            model,
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            enable_prefix_caching,
            static_decode,
            proposer,
            cfg.max_model_len,
        )
        self.scheduler, self.pool, self.runner = self.core.scheduler, self.core.pool, self.core.runner  # for tools
        self.core.runner.prepare()  # every decode graph captured now, before anything can serve (none while serving)
        self.intake = RequestIntake(cfg, tokenizer, self.device, getattr(model, "is_encoder_decoder", False))
        self.outputs = OutputProcessor(tokenizer, cfg.max_model_len)
        self._requests: dict[str, Request] = {}
        self._cond = threading.Condition()
        self._inbox: list[tuple[Request, OutputCallback | None]] = []
        self._aborts: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_step: StepResult | None = None
        # Run on the stepping thread at the end of each step; must not raise. Metrics read StepResults here.
        self.step_observers: list[Callable[[StepResult], None]] = []
        self.failure: Exception | None = None  # what a failed step raised; the engine then stops (crash-only)
        self.failure_observers: list[Callable[[Exception], None]] = []
        self.arbiter: StepArbiter | None = None  # shared with the process's other engines (engine/arbiter.py)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path, config: EngineConfig | None = None, *, proposer: Proposer | None = None, **fields
    ) -> Engine:
        """Load a Hugging Face checkpoint folder (safetensors) or a .gguf file (engine/loading.py load_model) under
        `config` (engine/engine_config.py), with `fields` replacing some of its values (a TypeError names an unknown
        one). config.speculative builds the proposer (engine/draft.py build_proposer) unless one is given."""
        from omnivox.models.checkpoint import load_tokenizer

        config = dataclasses.replace(config or EngineConfig(), **fields)
        device = torch.device(config.device) if config.device is not None else default_device()
        dtype = resolve_dtype(config.dtype, device)
        tp = config.tensor_parallel  # N > 1: the decoder split over N processes (engine/tensor_parallel.py)
        model = load_model(
            path,
            device,
            dtype,
            config.max_model_len,
            config.progress,
            config.quantization,
            config.quantize_lm_head,
            tp,
            config.activation_bits,
            config.node_group,
        )
        if config.speculative is not None:
            from omnivox.engine.draft import build_proposer

            vocab = model.config.vocab_size
            proposer = build_proposer(config.speculative, config.num_speculative_tokens, vocab, device, dtype)
        return cls(
            model,
            load_tokenizer(path),
            kv_cache_gib=config.kv_cache_gib,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            # replayed CUDA graphs would not tell the tensor-parallel workers
            static_decode=config.static_decode if tp == 1 and config.node_group is None else False,
            proposer=proposer,
        )

    # ---- the core's parts, for tests and tools ------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # ---- requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        segments: Sequence[EmbeddingSegment] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        rope_positions: tuple[torch.Tensor, int] | None = None,
        encoder_input: EncoderInput | None = None,
        cache_salt: str = "",
    ) -> str:
        """Validate and queue a request (thread-safe); raises InvalidRequest before anything is queued.
        rope_positions: ([3, len(prompt)] M-RoPE positions, generated-token delta) for Qwen2.5-VL-style models.
        encoder_input: what an encoder-decoder model (Whisper) cross-attends to (engine/request.py EncoderInput).
        cache_salt: only requests with the same salt share prefix-cache blocks ("" : the unsalted, shared cache)."""
        req = self.intake.build(prompt, params, request_id, segments, rope_positions, encoder_input, cache_salt)
        with self._cond:
            if req.request_id in self._requests:
                raise InvalidRequest("request_id", f"{req.request_id!r} is already in use")
            self._requests[req.request_id] = req
            self._inbox.append((req, on_output))
            self._cond.notify()
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the start of the next step (thread-safe; unknown ids ignored)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def kv_usage(self) -> KVUsage:
        return self.core.pool.usage()

    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        """These tokens' input embeddings as the decoder's token path computes them (Gemma's scaled by
        sqrt(hidden)): an EmbeddingSegment of them gives the logits the tokens give."""
        with torch.inference_mode():
            rows = self.model.embed_tokens(torch.tensor(list(token_ids), device=self.device))
            return scale_embeddings(rows, self.model_config.embed_scale).clone()

    # ---- stepping -----------------------------------------------------------------------------------------------
    def step(self, audio_behind: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs it produced (also delivered to each request's callback). audio_behind:
        another engine's audio stream is behind its deadline, so the step's prompt tokens are cut (scheduler.py)."""
        outputs: list[RequestOutput] = []
        with self._cond:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req, on_output in inbox:
            self.outputs.add(req, on_output)
            self.core.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, "abort", outputs)
        result = self.core.step(audio_behind)
        self.last_step = result
        for req in result.failed:
            self._finish(req, "error", outputs)
        now = time.monotonic()
        for acc in result.accepted:
            reason, out = self.outputs.process(acc.request, acc.token_ids, acc.logprobs, now)
            if reason is not None:
                self._finish(acc.request, reason, outputs)
            elif out is not None:
                outputs.append(out)
        for observe in self.step_observers:  # after the stop rules: requests they finished are gone
            observe(result)
        return outputs

    def _finish(self, req: Request, reason: str, outputs: list[RequestOutput]) -> None:
        self.core.finish(req, reason)
        with self._cond:
            self._requests.pop(req.request_id, None)
        outputs.append(self.outputs.finish(req))

    # ---- batch API ----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        segments: Sequence[Sequence[EmbeddingSegment] | None] | None = None,
        encoder_inputs: Sequence[EncoderInput | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion and return their final outputs, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        segs = list(segments) if segments is not None else [None] * len(prompts)
        encs = list(encoder_inputs) if encoder_inputs is not None else [None] * len(prompts)
        finals: dict[str, RequestOutput] = {}
        done = threading.Event()
        ids: list[str] = []

        def collect(out: RequestOutput) -> None:
            if out.finished:
                finals[out.request_id] = out
                if len(finals) == len(ids):
                    done.set()

        for prompt, p, s, e in zip(prompts, params_list, segs, encs, strict=True):
            ids.append(self.add_request(prompt, p, segments=s, on_output=collect, encoder_input=e))
        if self._thread is not None and self._thread.is_alive():
            done.wait()
        else:
            while len(finals) < len(ids):
                self.step()
        return [finals[i] for i in ids]

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        segments: Sequence[EmbeddingSegment] | None = None,
        rope_positions: tuple[torch.Tensor, int] | None = None,
        encoder_input: EncoderInput | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs of one request. Leaving early (break, cancellation) aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        self.start()
        rid = self.add_request(prompt, params, request_id, segments, deliver, rope_positions, encoder_input, cache_salt)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    # ---- background loop ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the engine stopped after a failed step: {self.failure!r}")
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="omnivox-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        getattr(self.model, "close", lambda: None)()  # a tensor-parallel model stops its worker processes

    def _loop(self) -> None:
        if self.device.type == "cuda":  # `--device cuda:1`: this thread's kernels and graphs must run on that device
            torch.cuda.set_device(self.device)
        # A model spread over processes (engine/tensor_parallel.py) can break while idle (a node of its group lost):
        # checked every 0.5 s without work, so the server stops within seconds, not at the next request.
        group_check = getattr(self.model, "raise_if_broken", None)
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self.core.has_work()):
                    self._cond.wait(None if group_check is None else 0.5)
                    if group_check is not None and not (self._inbox or self._aborts or self.core.has_work()):
                        break
                if self._stopping:
                    return
                idle = not (self._inbox or self._aborts or self.core.has_work())
            if idle and group_check is not None:
                try:
                    group_check()
                except Exception as exc:  # crash-only, as a failed step
                    log.exception("the model's process group broke while idle: the engine stops")
                    self._fail_all(exc)
                    return
                continue
            try:
                audio_behind = False
                if self.arbiter is not None:  # another engine's audio behind its deadline steps first
                    # still behind after a wait: a short step (no wait: it was not behind, no second look)
                    audio_behind = self.arbiter.wait_turn(self) > 0 and self.arbiter.must_yield(self)
                self.step(audio_behind)
                getattr(self.model, "raise_if_broken", lambda: None)()  # a tensor-parallel rank lost: stop too
                if self.last_step is not None and self.last_step.plan.is_empty:  # all wait on encoders: no spinning
                    with self._cond:  # (191,972 empty steps in one short transcription stole the encoder's CPU)
                        self._cond.wait(0.002)
            except Exception as exc:  # crash-only: after a step that raised, no state here can be trusted
                log.exception("engine step failed: every request fails and the engine stops")
                self._fail_all(exc)
                return

    def _fail_all(self, exc: Exception) -> None:
        """Every request ends with "error" (its consumer hears at once); then the failure observers are told."""
        with self._cond:
            self.failure, inbox, self._inbox = exc, self._inbox, []
        for req, on_output in inbox:
            self.outputs.add(req, on_output)
        for req in list(self._requests.values()):
            with contextlib.suppress(Exception):  # the scheduler may be what broke: the consumer still gets its end
                self.core.finish(req, "error")
            req.finish_reason = "error"
            self._requests.pop(req.request_id, None)
            self.outputs.finish(req)
        for observe in self.failure_observers:
            observe(exc)

    def check_integrity(self) -> None:
        """Assert that the block pool and the requests agree (tests call this when the engine is idle)."""
        self.core.check_integrity()
