"""An audio-LLM's transcription (Qwen2-Audio, Qwen3-ASR, Voxtral): one engine request per window of the audio,
greedy, at most MAX_PARALLEL_WINDOWS in flight (their clips are encoded together, their decode steps batched; later
windows start as earlier ones end), window 0's text streamed as it comes, then window 1's, ...

`abort_all` (the caller's `finally`) aborts every unfinished window's engine request, which frees its KV blocks and
encoder-cache references.
"""

from __future__ import annotations

import asyncio
import functools
import math
import uuid
from collections.abc import AsyncIterator

from omnivox.engine import InvalidRequest, RequestOutput, SamplingParams
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.output.transcript_text import SegmentTranscript
from omnivox.services.processing.generate_request import build_in_thread
from omnivox.services.processing.prompt import Prompt
from omnivox.services.processing.transcribe_request import TranscribeJob

MAX_PARALLEL_WINDOWS = 4  # engine requests in flight per transcription (later windows start as earlier ones end)
# Output budget per window. Speech runs ~3 words (~4-5 tokens) a second; 12 a second leaves room for any language
# and stops a model that loops (a random test model never says end-of-text) after a bounded number of tokens.
TOKENS_BASE, TOKENS_PER_SECOND = 32, 12.0


class WindowRun:
    """The engine requests of one transcription: started in order, at most MAX_PARALLEL_WINDOWS at once."""

    def __init__(self, job: TranscribeJob) -> None:
        model = job.checked.model
        assert model.engine is not None and model.bundle is not None and model.bundle.audio is not None
        self.model, self.engine, self.audio, self.plan = model, model.engine, model.bundle.audio, job
        self.salt = job.checked.salt  # the windows' encoder features and KV blocks are shared only under this salt
        language = job.checked.request.language or None
        self.loop = asyncio.get_running_loop()
        n = len(job.windows)
        self.queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue() for _ in range(n)]
        self.request_ids: list[str | None] = [None] * n
        self.finished = [False] * n
        tokenizer, family = self.audio.processor.tokenizer, self.audio.family
        self.transcripts = [SegmentTranscript(tokenizer, family, language) for _ in range(n)]
        self.texts: list[str] = [""] * n
        self.output_tokens = 0
        self.started = 0
        self.emitted_any = False
        self.first_token_time: float | None = None  # the engine's clock (time.monotonic) at the first token

    async def _start(self, index: int) -> None:
        start, end = self.plan.windows[index]
        clip = self.plan.samples[start:end]
        build = functools.partial(self.audio.prompt, cache_salt=self.salt)
        prompt: Prompt = await build_in_thread(build, self.plan.prompt_ids, [clip], "prompt")
        context = self.model.context_length
        if len(prompt.token_ids) >= context:
            prompt.release()
            raise errors.invalid_argument([FieldViolation("prompt", f"the prompt is {len(prompt.token_ids)} tokens; "
                                                                    f"the context is {context}")])  # fmt: skip
        budget = TOKENS_BASE + math.ceil(TOKENS_PER_SECOND * (end - start) / self.plan.sample_rate)
        params = SamplingParams(temperature=0.0, max_tokens=min(budget, context - len(prompt.token_ids)))
        queue = self.queues[index]

        def deliver(out: RequestOutput) -> None:
            self.loop.call_soon_threadsafe(queue.put_nowait, out)

        self.engine.start()
        try:
            self.request_ids[index] = self.engine.add_request(
                prompt.token_ids, params, uuid.uuid4().hex, prompt.segments, on_output=deliver, cache_salt=self.salt
            )
        except InvalidRequest as err:  # nothing queued: the references are still ours
            prompt.release()
            raise errors.invalid_argument([FieldViolation("audio", err.description)]) from err

    async def window_text(self, index: int) -> AsyncIterator[str]:
        """Start the windows up to index + MAX_PARALLEL_WINDOWS - 1, then yield window `index`'s text deltas."""
        while self.started < min(index + MAX_PARALLEL_WINDOWS, len(self.plan.windows)):
            await self._start(self.started)
            self.started += 1
        transcript, queue = self.transcripts[index], self.queues[index]
        lead = " " if self.emitted_any else ""  # windows' texts are joined by one space
        while True:
            out = await queue.get()
            self.output_tokens += len(out.new_token_ids)
            if self.first_token_time is None and out.first_token_time is not None:
                self.first_token_time = out.first_token_time
            delta = transcript.feed(list(out.new_token_ids))
            if out.finished:
                self.finished[index] = True
                if out.finish_reason == "error":
                    raise errors.internal("the engine failed while computing this request; see the server log")
                delta += transcript.finish()
            if delta:
                yield lead + delta
                lead, self.emitted_any = "", True
            if out.finished:
                self.texts[index] = transcript.text(final=True)
                return

    def abort_all(self) -> None:
        """Abort every started window that has not finished (no-op for finished ones)."""
        for rid, done in zip(self.request_ids, self.finished, strict=True):
            if rid is not None and not done:
                self.engine.abort(rid)

    def full_text(self) -> str:
        return " ".join(t for t in self.texts if t)

    def language(self) -> str | None:
        for t in self.transcripts:
            found = t.detected_language()
            if found:
                return found
        return None

    def segments(self) -> list[tuple[float, float, str]]:
        """(start s, end s, text) of each window."""
        rate = self.plan.sample_rate
        return [(a / rate, b / rate, t) for (a, b), t in zip(self.plan.windows, self.texts, strict=True)]
