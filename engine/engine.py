"""The engine: requests in, tokens out. One scheduler, one model runner, one sampler, one step at a time.

`step()` is synchronous and single-threaded. `stream()` runs steps on a background thread (torch releases the GIL
while it computes, so an asyncio server keeps serving) and hands each request's outputs to its own asyncio queue.
Everything that touches the scheduler happens on the thread that steps; other threads talk to it through an inbox.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import torch

from omnivox.engine.block_pool import BlockPool, KVUsage
from omnivox.engine.detokenizer import IncrementalDetokenizer
from omnivox.engine.errors import InvalidRequest
from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.outputs import RequestOutput
from omnivox.engine.params import SamplingParams
from omnivox.engine.request import EmbeddingSegment, Request, Status
from omnivox.engine.runner import ModelRunner
from omnivox.engine.sampler import Sampler
from omnivox.engine.scheduler import Scheduler
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        table = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
            "auto": None,
        }
        if dtype not in table:
            raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
        return _resolve_dtype(table[dtype], device)
    return dtype


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
    ) -> None:
        """max_num_batched_tokens: tokens one step may compute (decodes + prefill chunks). It bounds how long a step
        takes, so it trades inter-token latency against time to first token; None = 2048 on CUDA, 128 on CPU, where
        one token of a small model already costs ~3 ms of compute and a 512-token step stalled every decode for ~1 s."""
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        if kv_cache_gib is None:
            kv_cache_gib = self._default_kv_gib()
        bytes_per_block = cfg.kv_bytes_per_token(param.element_size()) * block_size
        num_blocks = int(kv_cache_gib * 2**30 // bytes_per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_gib={kv_cache_gib} holds {num_blocks} blocks of {block_size} tokens; need >= 2")
        capacity = num_blocks * block_size
        if capacity < cfg.max_model_len:
            log.warning("KV cache holds %d tokens: context capped from %d", capacity, cfg.max_model_len)
            cfg = _replace_max_len(cfg, capacity)
        self.model_config = cfg
        self.block_size = block_size
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.device.type == "cuda" else 128
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.scheduler = Scheduler(self.kv, max_num_seqs, self.max_num_batched_tokens)
        self.runner = ModelRunner(
            model, num_blocks, block_size, self.device, self.dtype, max_num_seqs, static_decode=static_decode
        )
        self.sampler = Sampler(cfg.vocab_size, self.device)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        kv_cache_gib: float | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        static_decode: bool | None = None,
        progress: bool = False,
    ) -> Engine:
        """Load a Hugging Face checkpoint folder (safetensors) or a .gguf file."""
        from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config, load_tokenizer

        device = torch.device(device) if device is not None else default_device()
        dtype = _resolve_dtype(dtype, device)
        cfg = ModelConfig.from_hf(load_hf_config(path), max_model_len)
        model = build_model(cfg, device, dtype)
        tensors = iter_checkpoint_tensors(path)
        if progress:
            from tqdm import tqdm

            tensors = tqdm(tensors, desc=f"loading {Path(path).name}", unit=" tensors", leave=False)
        model.load_weights(tensors)
        return cls(
            model,
            load_tokenizer(path),
            kv_cache_gib=kv_cache_gib,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            static_decode=static_decode,
        )

    def _default_kv_gib(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(0.5, 0.85 * free / 2**30)
        return 1.0

    # ---- requests -----------------------------------------------------------------------------------------------
    def _make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        segments: Sequence[EmbeddingSegment] | None,
        on_output: Callable[[RequestOutput], None] | None,
    ) -> Request:
        cfg = self.model_config
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "this model has no tokenizer: send token ids")
            ids = list(self.tokenizer(prompt).input_ids) if prompt else []
        elif isinstance(prompt, Sequence | torch.Tensor):
            ids = [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
            if bad is not None:
                raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        else:
            raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if len(ids) >= cfg.max_model_len:
            raise InvalidRequest(
                "prompt", f"{len(ids)} tokens do not fit the context of {cfg.max_model_len} tokens with room to answer"
            )
        params.validate(cfg.vocab_size)
        room = cfg.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                "max_tokens", f"{params.max_tokens} exceeds the {room} tokens left in the context after the prompt"
            )
        segs = list(segments or [])
        for seg in sorted(segs, key=lambda s: s.start):
            if seg.start < 0 or seg.end > len(ids):
                raise InvalidRequest("segments", f"segment [{seg.start}, {seg.end}) lies outside the prompt")
            if seg.embeds.shape[1] != cfg.hidden_size:
                raise InvalidRequest("segments", f"segment width {seg.embeds.shape[1]} != hidden {cfg.hidden_size}")
        ends = sorted((s.start, s.end) for s in segs)
        if any(a[1] > b[0] for a, b in itertools.pairwise(ends)):
            raise InvalidRequest("segments", "segments overlap")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest("request_id", f"{rid!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            max_tokens=params.max_tokens or room,
            eos_token_ids=cfg.eos_token_ids,
            segments=segs,
            on_output=on_output,
            generator=generator,
        )
        req.detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        return req

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        segments: Sequence[EmbeddingSegment] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> str:
        """Validate and queue a request (thread-safe); raises InvalidRequest before anything is queued."""
        with self._cond:
            req = self._make_request(prompt, params, request_id, segments, on_output)
            self._requests[req.request_id] = req
            self._inbox.append(req)
            self._cond.notify()
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the start of the next step (thread-safe; unknown ids ignored)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def kv_usage(self) -> KVUsage:
        return self.pool.usage()

    def num_unfinished(self) -> int:
        return len(self._requests)

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.embed_tokens(torch.tensor(list(token_ids), device=self.device)).clone()

    # ---- stepping -----------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs it produced (also delivered to each request's callback)."""
        outputs: list[RequestOutput] = []
        with self._cond:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in inbox:
            self.scheduler.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, "abort", outputs)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        self.num_steps += 1
        try:
            logits, sampling = self.runner.execute(plan)
        except Exception:
            log.exception("engine step failed; aborting the %d requests in it", len(plan.decodes + plan.prefills))
            for c in plan.decodes + plan.prefills:
                self._finish(c.request, "error", outputs)
            return outputs
        for c in plan.decodes + plan.prefills:
            c.request.num_computed_tokens = c.end
            self.kv.commit_computed(c.request)
        if sampling:
            reqs = [c.request for c in sampling]
            try:
                result = self.sampler(logits, reqs)
            except Exception:  # a sampler bug must not take the engine down: fail these requests, serve the rest
                log.exception("sampling failed; aborting the %d requests it served", len(reqs))
                for req in reqs:
                    self._finish(req, "error", outputs)
                return outputs
            now = time.monotonic()
            for i, (req, token, lp) in enumerate(zip(reqs, result.token_ids, result.logprobs, strict=True)):
                if i in result.failed:
                    self._finish(req, "error", outputs)
                else:
                    self._append_token(req, token, lp, now, outputs)
        return outputs

    def _append_token(self, req: Request, token: int, lp, now: float, outputs: list[RequestOutput]) -> None:
        p = req.params
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if lp is not None:
            req.logprobs.append(lp)
        reason = None
        if (
            (not p.ignore_eos and token in req.eos_token_ids)
            or (p.stop_token_ids and token in p.stop_token_ids)
            or req.detok.add(token)
        ):
            reason = "stop"
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.model_config.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason, outputs)
        else:
            self._emit(req, outputs, [token])

    def _finish(self, req: Request, reason: str, outputs: list[RequestOutput]) -> None:
        self.scheduler.finish(req, reason)
        self._requests.pop(req.request_id, None)
        new = req.output_token_ids[-1:] if reason in ("stop", "length") else []
        self._emit(req, outputs, new)

    def _emit(self, req: Request, outputs: list[RequestOutput], new_tokens: list[int]) -> None:
        new_text = req.detok.take(final=req.is_finished)
        if not new_tokens and not new_text and not req.is_finished:
            return
        want_lp = req.params.logprobs is not None
        new_lp = req.logprobs[req.num_emitted_logprobs :] if want_lp else None
        req.num_emitted_logprobs = len(req.logprobs)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=req.detok.released_text,
            new_token_ids=new_tokens,
            new_text=new_text,
            new_logprobs=new_lp,
            logprobs=list(req.logprobs) if want_lp else None,
            finish_reason=req.finish_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_token_time=req.first_token_time,
            arrival_time=req.arrival_time,
        )
        outputs.append(out)
        if req.on_output is not None:
            try:
                req.on_output(out)
            except Exception:  # a consumer that went away must not stop the engine
                log.exception("output callback of %s failed", req.request_id)

    # ---- batch API ----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        segments: Sequence[Sequence[EmbeddingSegment] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion and return their final outputs, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        segs = list(segments) if segments is not None else [None] * len(prompts)
        finals: dict[str, RequestOutput] = {}
        done = threading.Event()

        def collect(out: RequestOutput) -> None:
            if out.finished:
                finals[out.request_id] = out
                if len(finals) == len(ids):
                    done.set()

        ids: list[str] = []
        for prompt, p, s in zip(prompts, params_list, segs, strict=True):
            ids.append(self.add_request(prompt, p, segments=s, on_output=collect))
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
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs of one request. Leaving early (break, cancellation) aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        self.start()
        rid = self.add_request(prompt, params, request_id, segments, on_output=deliver)
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

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work()):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:
                log.exception("engine loop step failed")
                time.sleep(0.01)

    def check_integrity(self) -> None:
        """Assert that the block pool and the requests agree (tests call this when the engine is idle)."""
        self.pool.check_integrity()
        assert all(r.status == Status.RUNNING for r in self.scheduler.running)
        assert all(not r.block_table for r in self.scheduler.waiting)
        held = sum(len(r.block_table) for r in self.scheduler.running)
        assert held == sum(b.ref_count for b in self.pool.blocks), "block references do not match block tables"


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The decoder with uninitialised weights, allocated directly on device in dtype (no float32 detour)."""
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = DecoderModel(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.rotary.to(torch.float32)
    return model


def _replace_max_len(cfg: ModelConfig, n: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, max_model_len=min(cfg.max_model_len, n))
