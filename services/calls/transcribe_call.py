"""One Transcribe from a wire request to its responses, whichever front carries it (gRPC's TranscriptionServicer,
the HTTP front's /v1/audio/transcriptions and /translations): check -> admit -> process -> engine -> output.

The responses go to `write` as they come (text deltas, then the summary). Leaving in any way (done, cancelled,
deadline, error) aborts the engine requests still running, which frees their KV blocks and encoder-cache references;
a refusal is a ServiceError (services/errors.py) each front reports its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.calls.audio_llm_windows import WindowRun
from omnivox.services.calls.whisper import transcribe
from omnivox.services.calls.whisper_fallback import temperatures_of
from omnivox.services.errors import FieldViolation
from omnivox.services.metrics import Metrics
from omnivox.services.output import transcribe_output
from omnivox.services.output.transcribe_output import Transcript
from omnivox.services.parts.registry import ModelRegistry
from omnivox.services.processing import transcribe_request
from omnivox.services.processing.transcribe_request import TranscribeJob
from omnivox.v1 import transcription_pb2

log = logging.getLogger(__name__)

Write = Callable[[transcription_pb2.TranscribeResponse], Awaitable[None]]


async def transcribe_call(
    request: transcription_pb2.TranscribeRequest, registry: ModelRegistry, metrics: Metrics, write: Write
) -> transcription_pb2.TranscriptionSummary:
    """Run one transcription, writing its deltas then its summary; returns the summary."""
    checked = transcribe_request.check(request, registry)
    with checked.model.admit():  # counted against the queue bound, and waited for by a drain
        job = await transcribe_request.process(checked)
        run = _whisper if checked.whisper is not None else _audio_llm
        transcript = await run(job, write)
        response = transcribe_output.summary(job, transcript, metrics)
        await write(response)
    log.debug("Transcribe %s model=%s audio=%.2fs segments=%d rtf=%.3f", checked.request_id, checked.model.name,
              job.seconds, len(transcript.segments), response.summary.real_time_factor)  # fmt: skip
    return response.summary


async def _audio_llm(job: TranscribeJob, write: Write) -> Transcript:
    run = WindowRun(job)
    try:
        for index in range(len(job.windows)):
            async for text in run.window_text(index):
                await write(transcribe_output.delta(text, index))
    finally:
        run.abort_all()
    return Transcript(run.full_text(), run.language(), run.segments(), run.output_tokens, run.first_token_time)


async def _whisper(job: TranscribeJob, write: Write) -> Transcript:
    request, part = job.checked.request, job.checked.whisper
    first: list[float] = []

    async def on_text(text: str, index: int) -> None:
        first[:] = first or [time.monotonic()]
        await write(transcribe_output.delta(text, index))

    try:
        result = await transcribe(part, job.samples, language=request.language or None, task=job.checked.task,
                                  timestamps=request.timestamps, prompt=request.prompt or None, on_text=on_text,
                                  cache_salt=job.checked.salt, temperatures=temperatures_of(request),
                                  word_timestamps=request.word_timestamps,
                                  encoder_window_s=part.short_window_s)  # fmt: skip
    except TranscriptionRequestError as err:
        raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from err
    except RuntimeError as err:  # the engine failed a step of this request and kept serving the others
        raise errors.internal(str(err)) from err
    return Transcript(result.text, result.language, result.segments, result.num_tokens, first[0] if first else None,
                      result.words, result.stats)  # fmt: skip


async def transcribe_responses(
    request: transcription_pb2.TranscribeRequest, registry: ModelRegistry, metrics: Metrics
) -> AsyncIterator[transcription_pb2.TranscribeResponse]:
    """`transcribe_call` as an async iterator (the HTTP front's): its deltas, then its summary; its refusal raised.
    Closing the iterator early cancels the call (its engine requests abort)."""
    queue: asyncio.Queue[transcription_pb2.TranscribeResponse | None] = asyncio.Queue()
    task = asyncio.ensure_future(transcribe_call(request, registry, metrics, queue.put))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (response := await queue.get()) is not None:
            yield response
        await task  # its error, if it failed
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
