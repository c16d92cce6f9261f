"""SynthesizeSpeech's output processing: the segments' engine outputs -> codec frames -> encoded audio chunks.

One engine request per segment, all in parallel (at most `max_parallel`), each constrained to valid audio tokens;
each segment's frames (services/output/audio_frames.py) go to the model's DecodeWorker, which decodes the ready windows of
every stream on the server in one codec pass; chunks of segment 0, then 1, ... are resampled and encoded in order.
`close()` (always, however the call ends) cancels the segments, which closes their engine streams (aborting them and
freeing their KV blocks) and the codec streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from omnivox.codecs.audio_format import AudioStreamEncoder
from omnivox.codecs.decode_worker import END, AudioStream
from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.services import errors
from omnivox.services.metrics import Metrics
from omnivox.services.output.audio_frames import AudioFrameAssembler
from omnivox.services.output.summaries import SpeechTotals, audio_format
from omnivox.services.processing.csm_voice import prompt_segments
from omnivox.services.processing.speech_request import SynthesisJob
from omnivox.services.processing.speech_validation import invalid
from omnivox.v1 import speech_pb2


@dataclass
class Segment:
    index: int
    prompt: list[int]
    params: SamplingParams
    stream: AudioStream
    audio_tokens: int = 0
    finish_reason: str | None = None
    error: InvalidRequest | None = None  # with "error": the request's own values caused it
    cached_tokens: int = 0  # prompt tokens the prefix cache served


class SegmentedSynthesis:
    """The audio of one SynthesisJob, segment after segment, while every segment generates."""

    def __init__(self, job: SynthesisJob, max_parallel: int) -> None:
        self.job, self.max_parallel = job, max_parallel
        worker = job.part.worker
        self.encoder = AudioStreamEncoder(job.plan.encoding, job.plan.sample_rate, source_rate=worker.sample_rate)
        self.segments = [Segment(i, p, sp, worker.open()) for i, (p, sp) in enumerate(zip(job.prompts, job.params,
                                                                                          strict=True))]  # fmt: skip
        self.tasks: list[asyncio.Task] = []
        self.first_audio: float | None = None  # when the first chunk was ready (time.monotonic())

    def audio_format(self) -> speech_pb2.AudioFormat:
        return audio_format(self.job.plan.encoding, self.job.plan.sample_rate, self.encoder.channels)

    @property
    def audio_seconds(self) -> float:
        return self.encoder.samples_out / self.job.plan.sample_rate

    def generating(self) -> bool:
        """A segment is still in the engine."""
        return any(not task.done() for task in self.tasks)

    def working(self) -> bool:
        """The step arbiter's `working` (engine/arbiter.py): a segment still in the engine, or frames its codec has
        not decoded yet (the codec's backlog is the stream's work too: under load it is most of it)."""
        return self.generating() or any(seg.stream.decoding for seg in self.segments)

    async def audio(self) -> AsyncIterator[bytes]:
        """Encoded chunks in order; raises what a segment's generation raised."""
        gate = asyncio.Semaphore(self.max_parallel)
        request_id = self.job.request_id
        self.tasks = [asyncio.create_task(self._generate(seg, gate, f"{request_id}-{uuid.uuid4().hex[:8]}"))
                      for seg in self.segments]  # fmt: skip
        for seg in self.segments:
            while (item := await seg.stream.chunks.get()) is not END:
                if isinstance(item, BaseException):
                    raise item
                if data := self.encoder.encode(item):
                    self.first_audio = self.first_audio or time.monotonic()
                    yield data
            await self.tasks[seg.index]  # raises what generation raised
        if tail := self.encoder.finish():
            self.first_audio = self.first_audio or time.monotonic()
            yield tail

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for seg in self.segments:
            self.job.part.worker.close(seg.stream)
        self.encoder.close()

    def totals(self, metrics: Metrics) -> SpeechTotals:
        """What the segments counted; ServiceError when one ended in an error (after `audio()` is done)."""
        reasons = {s.finish_reason for s in self.segments}
        caused = next((s.error for s in self.segments if s.error is not None), None)
        if caused is not None:  # its own values left a segment nothing to sample (-inf biases on every code)
            raise invalid(caused)
        if "error" in reasons:  # the engine failed a segment's step and kept serving the others
            metrics.request_ended(self.job.model.name, "error")
            raise errors.internal("the engine failed while computing this request; see the server log")
        return SpeechTotals(
            audio_seconds=self.audio_seconds,
            audio_tokens=sum(s.audio_tokens for s in self.segments),
            cached_prompt_tokens=sum(s.cached_tokens for s in self.segments),
            prompt_tokens=sum(len(s.prompt) for s in self.segments),
            finish="length" if "length" in reasons else "stop",
        )

    def codec_span(self) -> tuple[float, float] | None:
        """The codec's passes for this request, first start to last end (tracing)."""
        spans = [seg.stream.codec_span for seg in self.segments if seg.stream.codec_span is not None]
        return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None

    async def _generate(self, seg: Segment, gate: asyncio.Semaphore, request_id: str) -> None:
        """Run one segment through the engine, pushing complete frames to its codec stream."""
        part, engine = self.job.part, self.job.model.engine
        assert engine is not None
        frames = AudioFrameAssembler(part.layout, f"segment {seg.index}")
        try:
            async with gate:
                stream = engine.stream(
                    seg.prompt,
                    seg.params,
                    request_id=request_id,
                    segments=prompt_segments(seg.prompt),
                    cache_salt=self.job.salt,
                )
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        seg.cached_tokens = max(seg.cached_tokens, out.num_cached_tokens)
                        part.worker.push(seg.stream, frames.feed(out.new_token_ids, out.new_frames))
                        seg.audio_tokens = frames.audio_tokens
                        if out.finished:
                            seg.finish_reason, seg.error = out.finish_reason, out.error
            part.worker.finish(seg.stream)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                seg.stream.chunks.put_nowait(exc)  # the writer raises it in order
            raise
