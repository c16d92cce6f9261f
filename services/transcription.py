"""TranscriptionService: speech in, text deltas out, then one summary (text, language, audio seconds, real-time factor,
segments with their offsets).

For audio-LLMs (Qwen2-Audio, Qwen3-ASR, Voxtral) a transcription is the family's transcription prompt
(models/audio/transcription.py; Voxtral's from mistral_common, services/voxtral_prompt.py) through the shared engine,
greedy. One request:

  validate -> decode the audio (up to TRANSCRIBE_MAX_SECONDS, off the event loop) -> split it into windows the
  encoder accepts, each cut at the quietest 100 ms near the window's edge (codecs/audio_split.py) -> one engine
  request per window, MAX_PARALLEL_WINDOWS at a time (their clips are encoded together, their decode steps batched)
  -> window 0's text streamed as it comes, then window 1's, ... -> the summary.

Leaving the handler in any way (done, cancelled, deadline, error) aborts the windows' engine requests, which frees
their KV blocks and encoder-cache references.

Whisper models go through services/whisper.py `transcribe` instead (their own prompt, language detection, 30 s windows
conditioned on the previous text, timestamp segments, translation with `task`), with the same deltas and summary.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass

import grpc
import numpy as np

from omnivox.codecs.audio_split import split_at_quiet
from omnivox.engine import InvalidRequest, RequestOutput, SamplingParams
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.audio_prompt import AudioInputPart
from omnivox.services.cache_salt import request_salt
from omnivox.services.call_record import current_call
from omnivox.services.errors import FieldViolation
from omnivox.services.generate_request import build_in_thread
from omnivox.services.metrics import Metrics
from omnivox.services.prompt import Prompt
from omnivox.services.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.services.rpc_errors import rpc_method
from omnivox.services.streaming_transcription import streaming_transcribe
from omnivox.services.summaries import seconds_to_duration
from omnivox.services.transcript_text import SegmentTranscript
from omnivox.services.whisper import transcribe
from omnivox.services.wire_checks import request_id_violation
from omnivox.v1 import transcription_pb2, transcription_pb2_grpc

log = logging.getLogger(__name__)

MAX_PARALLEL_WINDOWS = 4  # engine requests in flight per transcription (later windows start as earlier ones end)
# Output budget per window. Speech runs ~3 words (~4-5 tokens) a second; 12 a second leaves room for any language
# and stops a model that loops (a random test model never says end-of-text) after a bounded number of tokens.
TOKENS_BASE, TOKENS_PER_SECOND = 32, 12.0


@dataclass
class _Plan:
    """A decoded, split transcription: the clips to transcribe and the prompt (markers not yet expanded)."""

    samples: np.ndarray
    sample_rate: int
    windows: list[tuple[int, int]]  # [start, end) sample ranges
    prompt_ids: list[int]


class TranscriptionServicer(transcription_pb2_grpc.TranscriptionServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics()

    def _audio_model(self, name: str) -> ServedModel:
        """The model called `name` (it must take audio), or the default model if it does, else the first that does."""
        if name:
            model = self.registry.lookup(name)
            if AUDIO not in model.input_modalities:
                accepted = ", ".join(sorted(model.input_modalities))
                raise errors.invalid_argument(
                    [FieldViolation("model", f"model {model.name!r} does not accept audio (it accepts: {accepted})")]
                )
        else:
            default = self.registry.default
            candidates = [default] if default is not None and AUDIO in default.input_modalities else []
            candidates += [m for m in self.registry if AUDIO in m.input_modalities]
            if not candidates:
                raise errors.not_found("model", "", "this server serves no model that takes audio")
            model = candidates[0]
        return self.registry.get_ready(model.name)

    @staticmethod
    def _validate(request: transcription_pb2.TranscribeRequest, audio: AudioInputPart) -> None:
        bad = []
        if request.language:
            try:
                audio.transcription_language(request.language)
            except TranscriptionRequestError as err:
                bad.append(FieldViolation(err.field, err.description))
        marker = audio.marker_text()
        if marker and marker in request.prompt:
            bad.append(FieldViolation("prompt", f"must not contain the audio marker {marker!r}"))
        if (too_long := request_id_violation(request.request_id)) is not None:
            bad.append(too_long)
        if request.task not in ("", "transcribe"):
            bad.append(
                FieldViolation("task", f"{request.task!r}: this model only transcribes (Whisper models translate)")
            )
        if bad:
            raise errors.invalid_argument(bad)

    @staticmethod
    def _plan(request: transcription_pb2.TranscribeRequest, audio: AudioInputPart) -> _Plan:
        """Decode and split the audio, render the prompt (blocking: run in a worker thread)."""
        decoded = audio.decode(request.audio, "audio", audio.long_limits())
        windows = split_at_quiet(decoded.samples, decoded.sample_rate, audio.limits.max_seconds)
        # A last window too short for one embedding (a few ms) holds no speech: it is left out, not refused.
        if len(windows) > 1 and windows[-1][1] - windows[-1][0] < audio.limits.min_samples:
            windows.pop()
        try:
            ids = audio.transcription_ids(request.language or None, request.prompt or None)
        except TranscriptionRequestError as err:
            raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from err
        return _Plan(decoded.samples, decoded.sample_rate, windows, ids)

    @rpc_method
    async def Transcribe(self, request: transcription_pb2.TranscribeRequest, context: grpc.aio.ServicerContext) -> None:
        received = time.monotonic()
        salt = request_salt(request.cache_salt)  # this caller's (and cache_salt's) share of the caches
        model = self._audio_model(request.model)
        if model.bundle is not None and model.bundle.whisper is not None:
            return await self._transcribe_whisper(model, request, context, received, salt)
        assert model.bundle is not None and model.bundle.audio is not None and model.engine is not None
        audio = model.bundle.audio
        self._validate(request, audio)
        request_id = request.request_id or uuid.uuid4().hex
        with model.admit():
            plan = await asyncio.to_thread(self._plan, request, audio)
            run = _Run(model, audio, plan, request.language or None, salt)
            try:
                for index in range(len(plan.windows)):
                    async for delta in run.window_text(index):
                        await context.write(
                            transcription_pb2.TranscribeResponse(
                                delta=transcription_pb2.TranscriptDelta(text=delta, segment_index=index)
                            )
                        )
            finally:
                run.abort_all()
            seconds = len(plan.samples) / plan.sample_rate
            rate = plan.sample_rate
            segments = [(a / rate, b / rate, t) for (a, b), t in zip(plan.windows, run.texts, strict=True)]
            summary = self._summary(model, request_id, received, seconds, run.full_text(), run.language(),
                                    run.output_tokens, run.first_token_time, segments)  # fmt: skip
            await context.write(transcription_pb2.TranscribeResponse(summary=summary))
        log.debug("Transcribe %s model=%s audio=%.2fs windows=%d rtf=%.3f", request_id, model.name, seconds,
                  len(plan.windows), summary.real_time_factor)  # fmt: skip

    def _summary(
        self, model: ServedModel, request_id: str, received: float, seconds: float, text: str, language: str | None,
        output_tokens: int, first_token_time: float | None, segments: list[tuple[float, float, str]],
    ) -> transcription_pb2.TranscriptionSummary:  # fmt: skip
        """The summary (and the RTF metric, and the call's log fields) of a finished transcription."""
        elapsed = time.monotonic() - received
        summary = transcription_pb2.TranscriptionSummary(
            text=text,
            language=language or "",
            audio_seconds=seconds,
            real_time_factor=elapsed / seconds if seconds > 0 else 0.0,
            output_tokens=output_tokens,
            total=seconds_to_duration(elapsed),
            request_id=request_id,
            model=model.name,
        )
        if first_token_time is not None:
            summary.time_to_first_token.CopyFrom(seconds_to_duration(first_token_time - received))
        if seconds > 0:
            self.metrics.transcription_rtf.labels(model.name).observe(summary.real_time_factor)
        current_call().set(
            request_id=request_id,
            model=model.name,
            audio_seconds=round(seconds, 3),
            output_tokens=output_tokens,
            rtf=round(summary.real_time_factor, 4),
        )
        for start, end, segment_text in segments:
            summary.segments.append(
                transcription_pb2.TranscriptSegment(
                    text=segment_text,
                    start_offset=seconds_to_duration(start),
                    end_offset=seconds_to_duration(end),
                )
            )
        return summary

    async def _transcribe_whisper(
        self,
        model: ServedModel,
        request: transcription_pb2.TranscribeRequest,
        context: grpc.aio.ServicerContext,
        received: float,
        salt: str = "",
    ) -> None:
        part = model.bundle.whisper  # type: ignore[union-attr]
        task = request.task or "transcribe"
        bad = []
        try:
            part.check(request.language or None, task, request.timestamps)
        except TranscriptionRequestError as err:
            bad.append(FieldViolation(err.field, err.description))
        if (too_long := request_id_violation(request.request_id)) is not None:
            bad.append(too_long)
        if bad:
            raise errors.invalid_argument(bad)
        request_id = request.request_id or uuid.uuid4().hex
        with model.admit():
            decoded = await asyncio.to_thread(part.decode, request.audio, "audio")
            first: list[float] = []

            async def on_text(delta: str, index: int) -> None:
                first[:] = first or [time.monotonic()]
                response = transcription_pb2.TranscriptDelta(text=delta, segment_index=index)
                await context.write(transcription_pb2.TranscribeResponse(delta=response))

            try:
                result = await transcribe(part, decoded.samples, language=request.language or None, task=task,
                                          timestamps=request.timestamps, prompt=request.prompt or None,
                                          on_text=on_text, cache_salt=salt)  # fmt: skip
            except TranscriptionRequestError as err:
                raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from err
            except RuntimeError as err:  # the engine failed a step of this request and kept serving the others
                raise errors.internal(str(err)) from err
            seconds = decoded.seconds
            summary = self._summary(model, request_id, received, seconds, result.text, result.language,
                                    result.num_tokens, first[0] if first else None, result.segments)  # fmt: skip
            await context.write(transcription_pb2.TranscribeResponse(summary=summary))

    @rpc_method
    async def StreamingTranscribe(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await streaming_transcribe(self, request_iterator, context)


class _Run:
    """The engine requests of one transcription: started in order, at most MAX_PARALLEL_WINDOWS at once."""

    def __init__(
        self, model: ServedModel, audio: AudioInputPart, plan: _Plan, language: str | None, salt: str = ""
    ) -> None:
        assert model.engine is not None
        self.model, self.engine, self.audio, self.plan = model, model.engine, audio, plan
        self.salt = salt  # the windows' encoder features and KV blocks are shared only under this cache salt
        self.loop = asyncio.get_running_loop()
        n = len(plan.windows)
        self.queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue() for _ in range(n)]
        self.request_ids: list[str | None] = [None] * n
        self.finished = [False] * n
        self.transcripts = [SegmentTranscript(audio.processor.tokenizer, audio.family, language) for _ in range(n)]
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

    async def window_text(self, index: int):
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
