"""StreamingTranscribe: live audio in, speech events and interim / final results per utterance out (Whisper models).

    config -> audio chunks [-> finalize] ... -> close          (client)
    speech_event / result (interim, final) ... -> summary       (server)

The chunks are decoded as they come (codecs/audio_stream_input.py: LINEAR16 / MULAW at any rate -> 16 kHz) and fed
to the voice activity detector (codecs/vad.py), which opens and closes utterances. Every transcription pass is
services/whisper.py's `transcribe` on a span of the stream, so a final result's text is exactly what Transcribe
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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np
from google.protobuf import duration_pb2

from omnivox.codecs.audio_format import AudioEncoding
from omnivox.codecs.audio_input import AudioInputError
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder, header_pending, leading_file_header
from omnivox.codecs.vad import SpeechEvent, SpeechEventKind, VadConfig, VoiceActivityDetector
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.cache_salt import request_salt
from omnivox.services.errors import FieldViolation
from omnivox.services.registry import ServedModel
from omnivox.services.stream_idle import idle_bounded
from omnivox.services.streams import first_config, next_item
from omnivox.services.summaries import seconds_to_duration
from omnivox.services.whisper import transcribe
from omnivox.services.whisper_part import SAMPLE_RATE, WhisperPart
from omnivox.services.wire_checks import request_id_violation
from omnivox.v1 import content_pb2, transcription_pb2

if TYPE_CHECKING:
    from omnivox.services.transcription import TranscriptionServicer

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
ENDPOINT_SILENCE_MS = (100, 10_000)  # accepted range of config.endpoint_silence_ms
Response = transcription_pb2.StreamingTranscribeResponse


def _whisper_model(servicer: TranscriptionServicer, name: str) -> ServedModel:
    """The Whisper model called `name` (INVALID_ARGUMENT for another kind), or the first Whisper model served."""
    registry = servicer.registry
    if name:
        model = registry.get_ready(registry.lookup(name).name)
    else:
        found = [m for m in registry if "whisper" in m.manifest.parts]
        if not found:
            raise errors.not_found("model", "", "this server serves no Whisper model (StreamingTranscribe needs one)")
        model = registry.get_ready(found[0].name)
    if model.bundle is None or model.bundle.whisper is None:
        raise errors.invalid_argument(
            [FieldViolation("config.model", f"model {model.name!r} is not a Whisper model; StreamingTranscribe "
                                            "needs one (Transcribe takes audio-LLMs)")]
        )  # fmt: skip
    return model


def _validate(part: WhisperPart, cfg: transcription_pb2.StreamingTranscriptionConfig) -> StreamingAudioDecoder:
    """The config's problems as one INVALID_ARGUMENT naming each field; else the chunk decoder."""
    bad: list[FieldViolation] = []
    try:
        part.check(cfg.language or None, cfg.task or "transcribe", False)
        part.prompt_tokens(cfg.prompt)
    except TranscriptionRequestError as err:
        bad.append(FieldViolation(f"config.{err.field}", err.description))
    lo, hi = ENDPOINT_SILENCE_MS
    if cfg.endpoint_silence_ms and not lo <= cfg.endpoint_silence_ms <= hi:
        bad.append(FieldViolation("config.endpoint_silence_ms", f"must be 0 (the default) or in [{lo}, {hi}]"))
    if (too_long := request_id_violation(cfg.request_id, "config.request_id")) is not None:
        bad.append(too_long)
    decoder = None
    if not cfg.sample_rate_hertz:
        bad.append(FieldViolation("config.sample_rate_hertz", "required: the stream's audio has no header"))
    else:
        try:
            name = content_pb2.AudioEncoding.Name(cfg.encoding).removeprefix("AUDIO_ENCODING_")
            encoding = None if not cfg.encoding else AudioEncoding(name)
            decoder = StreamingAudioDecoder(encoding, cfg.sample_rate_hertz, SAMPLE_RATE)
        except AudioInputError as err:
            bad.append(FieldViolation(f"config.{err.field}", err.description))
        except ValueError:
            bad.append(FieldViolation("config.encoding", f"unknown encoding {cfg.encoding}"))
    if bad:
        raise errors.invalid_argument(bad)
    assert decoder is not None
    return decoder


def _offset(samples: int) -> duration_pb2.Duration:
    """A stream position (16 kHz samples) as an exact Duration: 62,500 ns a sample. Through float seconds
    (seconds_to_duration) 66,240 samples were 4.139999999 s, and a client comparing offsets saw 1 ns gaps."""
    return duration_pb2.Duration(seconds=samples // SAMPLE_RATE, nanos=samples % SAMPLE_RATE * 10**9 // SAMPLE_RATE)


def _stability(words: list[str], previous: list[str]) -> float:
    """The share of `words` that the previous interim had too, from the start (its common prefix)."""
    if not words:
        return 1.0
    same = 0
    for a, b in zip(words, previous, strict=False):
        if a != b:
            break
        same += 1
    return same / len(words)


@dataclass
class _Utterance:
    index: int
    start: int  # the detector's START offset (16 kHz samples from the stream's start)
    interim: asyncio.Task | None = None
    interim_end: int | None = None  # audio received when the latest interim started (None: none yet)
    words: list[str] = field(default_factory=list)  # the last interim's words sent


class _Stream:
    """One call's state: the audio buffer, the detector, the open utterance, the passes and the response queue."""

    def __init__(
        self, part: WhisperPart, cfg: transcription_pb2.StreamingTranscriptionConfig, decoder, salt: str = ""
    ) -> None:
        self.part, self.cfg, self.decoder = part, cfg, decoder
        self.salt = salt  # the passes' cache salt (services/cache_salt.py)
        silence = cfg.endpoint_silence_ms or VadConfig().end_silence_ms
        self.vad = VoiceActivityDetector(VadConfig(sample_rate=SAMPLE_RATE, end_silence_ms=silence))
        self.out: asyncio.Queue[Response | Exception | None] = asyncio.Queue()  # None: the end
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
                self._event(transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_START, ev.offset, self.open.index)
                continue
            u = self.open
            assert u is not None, "END without START"
            self.open = None
            self._event(transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_END, ev.offset, u.index)
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

    def _event(self, kind: int, offset: int, index: int) -> None:
        event = transcription_pb2.SpeechEvent(type=kind, offset=_offset(offset), utterance_index=index)
        self.out.put_nowait(Response(speech_event=event))

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

    async def _pass(self, clip: np.ndarray):
        t0 = time.monotonic()
        try:
            return await transcribe(
                self.part, clip, language=self.cfg.language or None, task=self.cfg.task or "transcribe",
                prompt=self.cfg.prompt or None, cache_salt=self.salt,
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
        self._result(u.index, result, a, b, is_final=False, stability=_stability(words, u.words))
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

    def _result(self, index: int, result, a: int, b: int, *, is_final: bool, stability: float) -> None:
        self.first_result = self.first_result or time.monotonic()
        self.out.put_nowait(
            Response(
                result=transcription_pb2.StreamingTranscriptionResult(
                    text=result.text,
                    is_final=is_final,
                    stability=stability,
                    start_offset=_offset(a),
                    end_offset=_offset(b),
                    language=result.language or self.cfg.language,
                    utterance_index=index,
                )
            )
        )


async def streaming_transcribe(
    servicer: TranscriptionServicer,
    requests: AsyncIterator[transcription_pb2.StreamingTranscribeRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    cfg = await first_config(requests)
    salt = request_salt(cfg.cache_salt, "config.cache_salt")
    model = _whisper_model(servicer, cfg.model)
    assert model.bundle is not None and model.bundle.whisper is not None
    stream = _Stream(model.bundle.whisper, cfg, _validate(model.bundle.whisper, cfg), salt)
    request_id = cfg.request_id or uuid.uuid4().hex
    with model.admit():
        messages = idle_bounded(
            requests, servicer.registry.stream_idle_s, "audio", lambda: bool(stream.passes), lambda req: bool(req.audio)
        )
        tasks = [asyncio.create_task(stream.read(messages)), asyncio.create_task(stream.run_finals())]
        try:
            while (item := await next_item(stream.out, tasks)) is not None:
                if isinstance(item, Exception):
                    raise item
                await context.write(item)
        finally:
            for task in [*tasks, *stream.passes]:
                task.cancel()
            await asyncio.gather(*tasks, *stream.passes, return_exceptions=True)
    seconds = stream.decoder.seconds_in
    summary = transcription_pb2.StreamingTranscriptionSummary(
        text=" ".join(t for t in stream.texts if t),
        utterances=stream.count,
        audio_seconds=seconds,
        real_time_factor=stream.compute_s / seconds if seconds > 0 else 0.0,
        request_id=request_id,
        model=model.name,
    )
    if stream.first_result is not None and stream.first_audio is not None:
        summary.time_to_first_result.CopyFrom(seconds_to_duration(stream.first_result - stream.first_audio))
    if seconds > 0:
        servicer.metrics.transcription_rtf.labels(model.name).observe(summary.real_time_factor)
    await context.write(Response(summary=summary))
