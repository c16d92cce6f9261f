"""StreamingTranscribe's stream state: live audio in, speech events and interim / final results per utterance out.

    config -> audio chunks [-> finalize] ... -> close          (client)
    speech_event / result (interim, final) ... -> summary       (server)

The chunks are decoded as they come (codecs/audio_stream_input.py: LINEAR16 / MULAW at any rate -> 16 kHz) and fed
to the voice activity detector (codecs/vad.py), which opens and closes utterances. Every transcription pass is
services/calls/whisper.py's `transcribe` on a span of the stream, so a final result's text is exactly what Transcribe
returns for the same span (its offsets):
- final pass: when an utterance ends (the detector's silence, `finalize`, or the end of the stream), on
  [start - PAD_S, end + PAD_S] (clipped to the audio received and to the previous utterance's span). Final passes
  run one at a time, in utterance order, while later audio keeps streaming in.
- interim passes (config.interim_results): on [start - PAD_S, audio received so far] of the OPEN utterance only, one
  at a time: the first once INTERIM_FIRST_S of the utterance has come, the next once the previous one is done and
  INTERIM_EVERY_S more has come (so their rate is bounded by the audio and by the machine). The utterance's end
  aborts its running interim (stale: the final supersedes it). None starts while an earlier utterance's final is
  pending: results go out in utterance order, so it could not be sent, and finals come first.
  Not done, measured: aborting a running interim that fell 3 s behind the audio for a newer one. With whisper-base
  on one busy CPU thread a pass takes 2-4 s whatever the clip's length (the encoder always reads a 30 s window), so
  every interim was aborted before it finished: 0 interims in a 20 s stream.
Aborting a pass cancels its `transcribe`, which aborts its engine request: KV blocks and cross K/V freed at once.
Leaving the handler in any way (done, cancelled, deadline, error) cancels every pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from omnivox.codecs.audio_input import AudioInputError
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder, header_pending, leading_file_header
from omnivox.codecs.vad import SpeechEvent, SpeechEventKind, VadConfig, VoiceActivityDetector
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.calls.whisper import WhisperResult, transcribe
from omnivox.services.calls.whisper_fallback import temperatures_of
from omnivox.services.errors import FieldViolation
from omnivox.services.output import streaming_transcribe_output as output
from omnivox.services.parts.whisper_part import SAMPLE_RATE, WhisperPart
from omnivox.v1 import transcription_pb2

PAD_S = 0.2  # audio kept around an utterance's voiced span: the detector's edges cut into soft onsets and endings
INTERIM_FIRST_S = 0.5  # of an utterance before its first interim pass
INTERIM_EVERY_S = 1.0  # new audio between the starts of interim passes
IDLE_KEEP_S = 1.0  # audio kept while no one speaks: an utterance starts up to START_MS + PAD_S back
# Finals queued (each holding its clip, up to 29.4 s) before the reader stops taking the client's messages, so that
# gRPC's flow control holds back a client sending faster than the passes run. Unbounded, every message was read at
# once and its clips held: a 300 s file of 30 utterances sent flat out was all taken in 1.6 s while the passes ran
# 16 s (tiny Whisper; whisper-base takes 2-4 s a pass: an hour's recording is 230 MB of float32 clips). Held back, the
# client was still sending at 4.9 s (gRPC's windows still take a few MB of its bytes ahead).
MAX_PENDING_FINALS = 4


@dataclass
class _Utterance:
    index: int
    start: int  # the detector's START offset (16 kHz samples from the stream's start)
    interim: asyncio.Task | None = None
    interim_end: int | None = None  # audio received when the latest interim started (None: none yet)
    words: list[str] = field(default_factory=list)  # the last interim's words sent


class TranscriptStream:
    """One call's state: the audio buffer, the detector, the open utterance, the passes and the response queue."""

    def __init__(
        self,
        part: WhisperPart,
        cfg: transcription_pb2.StreamingTranscriptionConfig,
        decoder: StreamingAudioDecoder,
        salt: str = "",
    ) -> None:
        self.part, self.cfg, self.decoder = part, cfg, decoder
        self.salt = salt  # the passes' cache salt (services/processing/cache_salt.py)
        silence = cfg.endpoint_silence_ms or VadConfig().end_silence_ms
        self.vad = VoiceActivityDetector(VadConfig(sample_rate=SAMPLE_RATE, end_silence_ms=silence))
        self.out: asyncio.Queue[output.Response | Exception | None] = asyncio.Queue()  # None: the end
        self.finals: asyncio.Queue[tuple[_Utterance, int, int, np.ndarray] | None] = asyncio.Queue()
        self.buffer = np.zeros(0, np.float32)  # samples [buffer_start, received)
        self.buffer_start = self.received = 0
        self.open: _Utterance | None = None
        self.count = 0  # utterances opened
        self.prev_end = 0  # end of the last final span
        self.pending_finals = 0
        self.final_done = asyncio.Event()  # set when a final pass ends (the reader waits on it while finals pile up)
        self.texts: list[str] = []
        self.compute_s = 0.0
        self.first_audio: float | None = None
        self.head: bytes | None = b""  # the stream's first bytes, held until a file header can be told (None: done)
        self.first_result: float | None = None
        self.passes: set[asyncio.Task] = set()

    # --- audio in -----------------------------------------------------------------------------------------------
    async def read(self, requests: AsyncIterator) -> None:
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "config":
                raise errors.invalid_argument([FieldViolation("config", "only the first message may be a config")])
            if kind == "audio" and req.audio:
                self.first_audio = self.first_audio or time.monotonic()
                self._audio(req.audio)
            elif kind == "finalize":
                self._events(self.vad.end_now())
            while self.pending_finals > MAX_PENDING_FINALS:
                self.final_done.clear()
                await self.final_done.wait()
        if self.head is not None:
            self._audio(b"", end=True)
        self._push(self.decoder.flush())
        self._events(self.vad.flush())
        self.finals.put_nowait(None)

    def _audio(self, chunk: bytes, end: bool = False) -> None:
        """Decode a chunk; the stream's first bytes are held until they tell whether a file header opens it."""
        if self.head is not None:
            self.head += chunk
            if header_pending(self.head) and not end:
                return
            chunk, self.head = self.head, None
            try:
                chunk = chunk[leading_file_header(chunk, self.decoder.encoding, self.decoder.sample_rate) :]
            except AudioInputError as err:
                raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from None
        self._push(self.decoder.feed(chunk))

    def _push(self, samples: np.ndarray) -> None:
        if len(samples):
            self.buffer = np.concatenate([self.buffer, samples])
            self.received += len(samples)
        self._events(self.vad.feed(samples))
        self._maybe_interim()
        keep = self.open.start if self.open is not None else self.received - round(IDLE_KEEP_S * SAMPLE_RATE)
        keep = max(self.buffer_start, keep - round(PAD_S * SAMPLE_RATE))
        self.buffer, self.buffer_start = self.buffer[keep - self.buffer_start :], keep

    def _span(self, start: int, end: int) -> tuple[int, int, np.ndarray]:
        pad = round(PAD_S * SAMPLE_RATE)
        a = max(start - pad, self.prev_end, self.buffer_start)
        b = min(end, self.received)
        return a, b, self.buffer[a - self.buffer_start : b - self.buffer_start].copy()

    def _events(self, events: list[SpeechEvent]) -> None:
        for ev in events:
            if ev.kind is SpeechEventKind.START:
                self.open = _Utterance(self.count, ev.offset)
                self.count += 1
                self.out.put_nowait(output.speech_event(output.SPEECH_START, ev.offset, self.open.index))
                continue
            u = self.open
            assert u is not None, "END without START"
            self.open = None
            self.out.put_nowait(output.speech_event(output.SPEECH_END, ev.offset, u.index))
            if u.interim is not None:
                u.interim.cancel()  # the final supersedes it
            # A cut utterance's span ends at the cut, where the next one's begins: padded into the audio after it,
            # its end was min(cut + PAD_S, audio received), which depends on how the client chunked the stream
            # (20 ms chunks: 29.46 s; 1 s chunks: 29.66 s, and the next utterance then lost those 0.2 s).
            end = ev.offset if ev.cut else ev.offset + round(PAD_S * SAMPLE_RATE)
            a, b, clip = self._span(u.start, end)
            self.prev_end = b
            self.pending_finals += 1
            self.finals.put_nowait((u, a, b, clip))

    # --- passes ---------------------------------------------------------------------------------------------------
    def _maybe_interim(self) -> None:
        u = self.open
        if not self.cfg.interim_results or u is None or self.pending_finals:
            return
        if u.interim is not None and not u.interim.done():
            return
        if u.interim_end is None:
            due = u.start + INTERIM_FIRST_S * SAMPLE_RATE
        else:
            due = u.interim_end + INTERIM_EVERY_S * SAMPLE_RATE
        if self.received < due:
            return
        # The span the final would take if the utterance ended now: up to its last voiced frame + PAD_S. To the audio
        # received, an interim in the trailing silence (600 ms, up to 10 s with endpoint_silence_ms) reported an end
        # past its final's, and result end offsets went backwards (Google's result_end_offset only grows).
        a, b, clip = self._span(u.start, self.vad.last_voiced_end + round(PAD_S * SAMPLE_RATE))
        u.interim_end = self.received
        u.interim = self._spawn(self._interim(u, a, b, clip))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.passes.add(task)
        task.add_done_callback(self.passes.discard)
        return task

    async def _pass(self, clip: np.ndarray) -> WhisperResult:
        t0 = time.monotonic()
        try:
            # Due now (the step arbiter, engine/arbiter.py): a live pass has its speaker waiting, so Whisper never
            # yields during it; at RTF 1 of its clip alone it would, to speech behind, for all but the last second.
            with self.part.deadline(0):
                return await transcribe(
                    self.part, clip, language=self.cfg.language or None, task=self.cfg.task or "transcribe",
                    prompt=self.cfg.prompt or None, cache_salt=self.salt, temperatures=temperatures_of(self.cfg),
                    encoder_window_s=self.part.short_window_s,  # Transcribe's rule: a result is Transcribe's of its span
                )  # fmt: skip
        except TranscriptionRequestError as err:
            raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from err
        finally:
            self.compute_s += time.monotonic() - t0

    async def _interim(self, u: _Utterance, a: int, b: int, clip: np.ndarray) -> None:
        try:
            result = await self._pass(clip)
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which ends the call with it
            self.out.put_nowait(exc)
            return
        if self.open is not u or self.pending_finals:
            return  # the utterance ended (its final is coming), or an earlier final is still to be sent
        words = result.text.split()
        self._result(u.index, result, a, b, is_final=False, stability=output.stability(words, u.words))
        u.words = words

    async def run_finals(self) -> None:
        """Final passes, one at a time in utterance order; then the end marker for the writer."""
        while (item := await self.finals.get()) is not None:
            u, a, b, clip = item
            result = await self._spawn(self._pass(clip))
            self.pending_finals -= 1
            self.final_done.set()
            self.texts.append(result.text)
            self._result(u.index, result, a, b, is_final=True, stability=1.0)
        self.out.put_nowait(None)

    def _result(self, index: int, result: WhisperResult, a: int, b: int, *, is_final: bool, stability: float) -> None:
        self.first_result = self.first_result or time.monotonic()
        language = self.cfg.language
        self.out.put_nowait(output.result(index, result, a, b, language, is_final=is_final, stable=stability))
