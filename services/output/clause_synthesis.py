"""StreamingSynthesizeSpeech's processing and output: text messages -> clauses -> engine -> frames -> audio chunks.

Three tasks share one ClauseSynthesis: `read` takes the client's text messages and cuts complete clauses
(services/processing/clause_reader.py, the SETTLE_S rule), `produce` speaks them one after another (each with the
previous clause's text and last CONTEXT_FRAMES of codes as a prior turn, after a created CSM voice's reference turn; frames through services/output/audio_frames.py into
ONE codec stream, flushed when the next clause's text has not come), and the writer (`audio`) encodes the codec's
chunks, noting each clause's first-audio latency. `close()` (always) cancels the tasks, which closes the clause's
engine stream, and closes the codec stream and the encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from omnivox.codecs.audio_format import AudioStreamEncoder
from omnivox.codecs.decode_worker import END
from omnivox.services import errors
from omnivox.services.output.audio_frames import AudioFrameAssembler
from omnivox.services.output.summaries import SpeechTotals, audio_format
from omnivox.services.parts.csm_part import CsmLayout
from omnivox.services.parts.registry import ServedModel
from omnivox.services.processing.clause_reader import read_clauses
from omnivox.services.processing.csm_voice import csm_clause_prompt, prompt_segments
from omnivox.services.processing.speech_request import SpeechLimits, segment_params
from omnivox.services.processing.speech_validation import SpeechPlan, invalid
from omnivox.services.processing.streams import next_item
from omnivox.v1 import speech_pb2

CONTEXT_SECONDS = 2.0  # of the previous clause's audio codes in the next clause's prompt


class ClauseSynthesis:
    """One StreamingSynthesizeSpeech after its config was checked: the clause queue, the codec stream, the counts."""

    def __init__(
        self, model: ServedModel, plan: SpeechPlan, cfg: speech_pb2.StreamingSpeechConfig, cutter: Any,
        limits: SpeechLimits, ref: Any, salt: str, settle_s: float,
    ) -> None:  # fmt: skip
        """`cutter`: the ClauseCutter; `ref`: the created voice speaking (services/parts/voices.py), or None."""
        assert model.bundle is not None and model.bundle.speech is not None and model.engine is not None
        self.model, self.plan, self.cutter, self.limits, self.ref, self.salt = model, plan, cutter, limits, ref, salt
        self.settle_s = settle_s
        self.part = part = model.bundle.speech
        self.builtin_voice = "" if ref is not None else plan.voice
        self.context_frames = math.ceil(CONTEXT_SECONDS * part.layout.sample_rate / part.codec.frame_samples)
        self.request_id = cfg.request_id or uuid.uuid4().hex
        self.clauses: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()  # (clause, when its text was complete)
        self.totals = SpeechTotals(0.0, 0, 0, 0, "stop")
        # Where each clause's audio starts on the codec stream's timeline (samples at the codec rate) and when its
        # text was complete, in order: the writer turns them into per-clause first-audio latencies and underruns.
        self.marks: list[tuple[int, float]] = []
        self.text_end: float | None = None  # when the end of the text was read
        self.generating = False  # a clause is being spoken (the idle bound waits while it is)
        self.last_out = time.monotonic()  # when audio last went out (the idle bound counts from it too)
        self.first_audio: float | None = None
        self.encoder = AudioStreamEncoder(plan.encoding, plan.sample_rate, source_rate=part.worker.sample_rate)
        self.stream = part.worker.open(measured=False)  # its frames wait on the text: not the engine's pace
        self.tasks: list[asyncio.Task] = []
        self.codec_samples = 0  # handed to the encoder so far (codec rate)
        self.started = 0  # clauses whose first audio was sent
        self._idle_s: float | None = None  # the registry's stream idle bound (read sets it)

    def audio_format(self) -> speech_pb2.AudioFormat:
        return audio_format(self.plan.encoding, self.plan.sample_rate, self.encoder.channels)

    @property
    def audio_seconds(self) -> float:
        return self.encoder.samples_out / self.plan.sample_rate

    def start(self, requests: AsyncIterator[Any], stream_idle_s: float | None) -> None:
        self.tasks = [asyncio.create_task(self.read(requests, stream_idle_s)), asyncio.create_task(self.produce())]

    async def audio(self, clause_started: Callable[[float], None]) -> AsyncIterator[bytes]:
        """Encoded chunks as the codec decodes them; `clause_started(latency_s)` for each clause's first audio."""
        while (item := await next_item(self.stream.chunks, self.tasks)) is not END:
            if isinstance(item, BaseException):
                raise item
            self.codec_samples += len(item)
            if data := self.encoder.encode(item):
                self._sent(clause_started)
                yield data
        if tail := self.encoder.finish():
            self._sent(clause_started)
            yield tail

    def last_clause_ready(self) -> float | None:
        """When the text of the last clause whose audio went out was complete."""
        return self.marks[self.started - 1][1] if self.started else None

    def _sent(self, clause_started: Callable[[float], None]) -> None:
        now = self.last_out = time.monotonic()
        self.first_audio = self.first_audio or now
        while self.started < len(self.marks) and self.marks[self.started][0] < self.codec_samples:
            clause_started(max(now - self.marks[self.started][1], 0.0))
            self.started += 1

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.part.worker.close(self.stream)
        self.encoder.close()

    # --- the client's text -> clauses ---
    def _busy(self) -> bool:  # its text is being spoken, or audio went out within the idle bound
        recent = time.monotonic() - self.last_out < (self._idle_s or 0)
        stream = self.stream
        return (
            self.generating or recent or not self.clauses.empty() or bool(stream.pending) or not stream.chunks.empty()
        )

    async def read(self, requests: AsyncIterator[Any], stream_idle_s: float | None) -> None:
        self._idle_s = stream_idle_s
        self.text_end = await read_clauses(
            requests, self.cutter, self.clauses, self.limits.max_text_chars, self.settle_s, stream_idle_s, self._busy
        )

    # --- clauses -> the engine -> frames ---
    async def produce(self) -> None:
        ref, part, layout = self.ref, self.part, self.part.layout
        prev_text, prev_frames = (ref.transcript, list(ref.frames)) if ref is not None else (None, [])
        index = pushed = 0  # clauses spoken; frames pushed to the codec stream, all clauses
        while True:
            if self.clauses.empty():  # the next clause's text has not come: send all of this one's audio now
                part.worker.flush(self.stream)
            if (item := await self.clauses.get()) is None:
                break
            self.generating = True
            clause, complete_at = item
            self.marks.append((pushed * part.codec.frame_samples, complete_at))
            if isinstance(layout, CsmLayout):  # CSM's multi-turn context: see csm_clause_prompt
                tail = prev_frames[-self.context_frames :] if index else []
                prompt = csm_clause_prompt(layout, part.text_tokenizer, ref, prev_text if index else None, tail,
                                           clause, self.builtin_voice)  # fmt: skip
            elif prev_text is None:
                prompt = layout.build_prompt(part.text_tokenizer, clause, self.builtin_voice)
            else:
                tail = prev_frames if index == 0 else prev_frames[-self.context_frames :]  # a created voice: all of it
                prompt = layout.build_reference_prompt(part.text_tokenizer, prev_text, tail, clause, self.builtin_voice)
            frames = await self._speak(clause, prompt, index)
            pushed += len(frames)
            prev_text, prev_frames = clause, frames
            index += 1
            self.generating = False
        part.worker.finish(self.stream)

    async def _speak(self, clause: str, prompt: list[int], index: int) -> list[list[int]]:
        """One clause through the engine, its frames pushed to the codec stream as they complete; all of them."""
        engine, part = self.model.engine, self.part
        assert engine is not None
        params = segment_params(self.plan, self.model, part, self.limits, clause, prompt, index)
        assembler = AudioFrameAssembler(part.layout, f"clause {index}")
        frames: list[list[int]] = []
        gen = engine.stream(
            prompt,
            params,
            request_id=f"{self.request_id}-{index}",
            segments=prompt_segments(prompt),
            cache_salt=self.salt,
        )
        async with contextlib.aclosing(gen):
            async for out in gen:
                new = assembler.feed(out.new_token_ids, out.new_frames)
                part.worker.push(self.stream, new)
                frames += new
                if out.finished:
                    self.totals.cached_prompt_tokens += out.num_cached_tokens
                    if out.finish_reason == "length":
                        self.totals.finish = "length"
                    if out.error is not None:  # its own values left it nothing to sample
                        raise invalid(out.error)
                    if out.finish_reason == "error":
                        raise errors.internal("the engine failed while computing this request")
        self.totals.audio_tokens += assembler.audio_tokens
        self.totals.prompt_tokens += len(prompt)
        return frames
