"""SpeechService: text -> audio tokens from the shared engine -> SNAC -> encoded audio, streamed as it is produced.

A speech model is a checkpoint folder with `speech_layout.json` (models/orpheus.py: where the audio tokens live and how
the prompt is framed) and a SNAC codec in `<folder>/<layout.codec_folder>`. One request:

  validate -> split the text at sentence boundaries into segments -> one engine request per segment, all in parallel,
  each constrained to valid audio tokens -> frames go to the model's DecodeWorker, which decodes the ready windows of
  every stream on the server in one codec pass -> chunks of segment 0, then 1, ... are resampled, encoded and written.

Leaving the handler in any way (done, cancelled, deadline, error) closes the segments' engine streams (which aborts
them and frees their KV blocks) and the codec streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omnivox.codecs.audio_format import AudioEncoding, AudioFormatError, AudioStreamEncoder, check_output_format
from omnivox.codecs.decode_worker import END, AudioStream, DecodeWorker
from omnivox.codecs.snac import SnacDecoder
from omnivox.codecs.streaming import BatchedStreamDecoder, StreamingOptions
from omnivox.engine import InvalidRequest, SamplingParams, shared
from omnivox.models.orpheus import LAYOUT_FILE, SpeechLayout, SpeechTokenConstraint
from omnivox.services import errors, validation
from omnivox.services.errors import FieldViolation, rpc_method
from omnivox.services.loading import ModelLoadError
from omnivox.services.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.v1 import content_pb2, generation_pb2, speech_pb2, speech_pb2_grpc

log = logging.getLogger(__name__)

MAX_SEGMENT_CHARS = 300


@dataclass
class SpeechLimits:
    max_text_chars: int = 5000
    max_segment_chars: int = MAX_SEGMENT_CHARS  # sentences are grouped into segments of at most this many characters
    max_parallel_segments: int = 8  # engine requests in flight per synthesis request
    # Audio budget per segment (a trained model ends with end-of-speech well before): base + per character.
    audio_seconds_base: float = 2.0
    audio_seconds_per_char: float = 0.12


FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


# --- text --------------------------------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?;…。！？])[\"')\]]*\s+|\n+")


def split_text(text: str, max_chars: int = MAX_SEGMENT_CHARS) -> list[str]:
    """Split at sentence boundaries, then group sentences into segments of at most max_chars (a longer sentence is
    split at commas or spaces)."""
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]
    pieces: list[str] = []
    for s in sentences:
        while len(s) > max_chars:
            cut = max(s.rfind(", ", 0, max_chars), s.rfind(" ", 0, max_chars))
            cut = cut + 1 if cut > 0 else max_chars
            pieces.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            pieces.append(s)
    segments: list[str] = []
    for p in pieces:
        if segments and len(segments[-1]) + 1 + len(p) <= max_chars:
            segments[-1] = f"{segments[-1]} {p}"
        else:
            segments.append(p)
    return segments


# --- the speech side of a model ----------------------------------------------------------------------------------------
@dataclass
class SpeechBundle:
    layout: SpeechLayout
    codec: SnacDecoder
    worker: DecodeWorker
    constraint: SpeechTokenConstraint


def is_speech_checkpoint(path: Path | None) -> bool:
    return path is not None and path.is_dir() and (path / LAYOUT_FILE).is_file()


def load_speech_bundle(
    folder: Path,
    vocab_size: int,
    device: str | None = None,
    options: StreamingOptions | None = None,
) -> SpeechBundle:
    """Layout, codec, decode worker and token constraint of the speech model in `folder` (blocking)."""
    layout = SpeechLayout.load(folder)
    if layout is None:
        raise ValueError(f"{folder} has no {LAYOUT_FILE}: it is not a speech model")
    codec = SnacDecoder.from_folder(folder / layout.codec_folder, device=device)
    if codec.sample_rate != layout.sample_rate:
        raise ValueError(f"the codec runs at {codec.sample_rate} Hz, the layout says {layout.sample_rate} Hz")
    decoder = BatchedStreamDecoder(codec, layout.frame_levels, options)
    constraint = SpeechTokenConstraint(layout, vocab_size, device=device)
    return SpeechBundle(layout=layout, codec=codec, worker=DecodeWorker(decoder), constraint=constraint)


# --- validation --------------------------------------------------------------------------------------------------------
@dataclass
class SpeechPlan:
    text: str
    voice: str
    encoding: AudioEncoding
    sample_rate: int
    sampling: dict[str, object]
    segments: list[str] = field(default_factory=list)


def _encoding_name(value: int) -> str | None:
    if value == content_pb2.AUDIO_ENCODING_UNSPECIFIED:
        return AudioEncoding.WAV.value
    try:
        return content_pb2.AudioEncoding.Name(value).removeprefix("AUDIO_ENCODING_")
    except ValueError:
        return None


def _language_matches(requested: str, offered: str) -> bool:
    """BCP-47 prefix match, either way round: "en" matches "en-US" and "en-US" matches "en"."""
    a, b = requested.lower(), offered.lower()
    return a == b or a.startswith(b + "-") or b.startswith(a + "-")


def validate_speech(
    request: speech_pb2.SynthesizeSpeechRequest, model: ServedModel, layout: SpeechLayout, max_text_chars: int
) -> SpeechPlan:
    """INVALID_ARGUMENT listing every bad field, then NOT_FOUND for an unknown voice."""
    v = validation.Violations()
    text = request.text.strip()
    if not text:
        v.add("text", "must not be empty")
    elif len(request.text) > max_text_chars:
        v.add("text", f"is {len(request.text)} characters; the limit is {max_text_chars}")
    encoding_name = _encoding_name(request.audio_config.encoding)
    encoding, rate = AudioEncoding.WAV, layout.sample_rate
    if encoding_name is None:
        v.add("audio_config.encoding", f"unknown encoding value {request.audio_config.encoding}")
    else:
        try:
            encoding, rate = check_output_format(
                encoding_name, request.audio_config.sample_rate_hertz or layout.sample_rate
            )
        except AudioFormatError as err:
            v.add(f"audio_config.{err.field}", err.description)
    requested = validation.sampling_params(request.sampling, model, v)
    sampling: dict[str, object] = dict(model.sampling_defaults)
    sampling.update(temperature=layout.temperature, top_p=layout.top_p, repetition_penalty=layout.repetition_penalty)
    for key, value in requested.items():  # what the request set explicitly wins
        if key not in model.sampling_defaults or request.sampling.HasField(key):
            sampling[key] = value
    v.raise_if_any()

    voice = request.voice.name or layout.default_voice
    if voice and layout.voices and voice not in layout.voices:
        raise errors.not_found(
            "voice", voice, f"model {model.name!r} has no voice {voice!r} (voices: {', '.join(layout.voices)})"
        )
    if request.voice.language_code and not _language_matches(request.voice.language_code, layout.language_code):
        raise errors.not_found(
            "voice",
            f"{voice or '*'}@{request.voice.language_code}",
            f"model {model.name!r} has no voice for language {request.voice.language_code!r} "
            f"(it speaks {layout.language_code!r})",
        )
    return SpeechPlan(text=text, voice=voice, encoding=encoding, sample_rate=rate, sampling=sampling)


def _invalid(err: InvalidRequest) -> errors.ServiceError:
    """An engine InvalidRequest as INVALID_ARGUMENT on the speech request's field (prompt/length problems: `text`)."""
    field = "text" if err.field in ("prompt", "max_tokens", "segments") else validation.request_field(err.field)
    return errors.invalid_argument([FieldViolation(field, err.description)])


def seconds_to_duration(seconds: float):
    from google.protobuf import duration_pb2

    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


# --- one synthesis -----------------------------------------------------------------------------------------------------
@dataclass
class _Segment:
    index: int
    prompt: list[int]
    params: SamplingParams
    stream: AudioStream
    audio_tokens: int = 0
    finish_reason: str | None = None


class SpeechServicer(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(
        self, registry: ModelRegistry, streaming: StreamingOptions | None = None, limits: SpeechLimits | None = None
    ) -> None:
        self.registry = registry
        self.streaming = streaming
        self.limits = limits or SpeechLimits()
        self._bundles: dict[str, SpeechBundle] = {}
        self._bundle_lock = threading.Lock()

    async def aclose(self) -> None:
        """Stop the codec workers (server shutdown)."""
        for bundle in list(self._bundles.values()):
            await bundle.worker.shutdown()

    # --- models ---
    def _is_speech(self, model: ServedModel) -> bool:
        return AUDIO in model.output_modalities or is_speech_checkpoint(model.source)

    def _speech_model(self, name: str) -> ServedModel:
        if name:
            model = self.registry.lookup(name)
            if not self._is_speech(model):
                raise errors.invalid_argument(
                    [FieldViolation("model", f"model {model.name!r} does not produce speech")]
                )
        else:
            default = self.registry.default
            candidates = [default] if default is not None and self._is_speech(default) else []
            candidates += [m for m in self.registry if self._is_speech(m)]
            if not candidates:
                raise errors.not_found("model", "", "this server serves no speech model")
            model = candidates[0]
        return self.registry.get_ready(model.name)

    def bundle(self, model: ServedModel) -> SpeechBundle:
        """The model's speech bundle, loaded once (blocking: call through asyncio.to_thread)."""
        with self._bundle_lock:
            bundle = self._bundles.get(model.name)
            if bundle is None:
                assert model.engine is not None and model.source is not None
                bundle = load_speech_bundle(
                    model.source, model.vocab_size, device=str(model.engine.device), options=self.streaming
                )
                self._bundles[model.name] = bundle
            return bundle

    def prepare(self, model: ServedModel) -> None:
        """Load a freshly loaded speech model's codec now rather than on its first request (blocking)."""
        if model.engine is not None and is_speech_checkpoint(model.source):
            try:
                self.bundle(model)
            except Exception as exc:
                model.set_failed(f"{type(exc).__name__}: {exc}")
                raise ModelLoadError(f"cannot load the speech codec of {model.name!r}: {exc}") from exc

    def _layout_of(self, model: ServedModel) -> SpeechLayout | None:
        bundle = self._bundles.get(model.name)
        if bundle is not None:
            return bundle.layout
        return SpeechLayout.load(model.source) if is_speech_checkpoint(model.source) else None

    # --- RPCs ---
    @rpc_method
    async def ListVoices(
        self, request: speech_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> speech_pb2.ListVoicesResponse:
        models = [self.registry.lookup(request.model)] if request.model else list(self.registry)
        voices = []
        for model in models:
            layout = self._layout_of(model)
            if layout is None:
                if request.model:
                    raise errors.invalid_argument(
                        [FieldViolation("model", f"model {model.name!r} does not produce speech")]
                    )
                continue
            if request.language_code and not _language_matches(request.language_code, layout.language_code):
                continue
            voices += [speech_pb2.Voice(name=n, language_codes=[layout.language_code], model=model.name)
                       for n in layout.voices]  # fmt: skip
        return speech_pb2.ListVoicesResponse(voices=voices)

    @rpc_method
    async def SynthesizeSpeech(
        self, request: speech_pb2.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext
    ) -> None:
        received = time.monotonic()
        model = self._speech_model(request.model)
        bundle = await asyncio.to_thread(self.bundle, model)
        layout, engine = bundle.layout, model.engine
        assert engine is not None
        plan = validate_speech(request, model, layout, self.limits.max_text_chars)
        plan.segments = split_text(plan.text, self.limits.max_segment_chars)
        request_id = request.request_id or uuid.uuid4().hex
        prompts = [layout.build_prompt(engine.tokenizer, s, plan.voice) for s in plan.segments]
        params = [self._params(plan, model, layout, bundle, text, prompt, i) for i, (text, prompt) in
                  enumerate(zip(plan.segments, prompts, strict=True))]  # fmt: skip

        with model.admit():
            encoder = AudioStreamEncoder(plan.encoding, plan.sample_rate, source_rate=bundle.worker.sample_rate)
            segments = [
                _Segment(i, p, sp, bundle.worker.open()) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            tasks: list[asyncio.Task] = []
            first_audio: float | None = None
            try:
                await context.write(
                    speech_pb2.SynthesizeSpeechResponse(
                        format=speech_pb2.AudioFormat(
                            encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{plan.encoding.value}"),
                            sample_rate_hertz=plan.sample_rate,
                            channels=encoder.channels,
                        )
                    )
                )
                gate = asyncio.Semaphore(self.limits.max_parallel_segments)
                tasks = [
                    asyncio.create_task(
                        self._generate(model, bundle, seg, gate, f"{request_id}-{uuid.uuid4().hex[:8]}")
                    )
                    for seg in segments
                ]
                for seg in segments:
                    while (item := await seg.stream.chunks.get()) is not END:
                        if isinstance(item, BaseException):
                            raise item
                        data = encoder.encode(item)
                        if data:
                            first_audio = first_audio or time.monotonic()
                            await context.write(
                                speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=data))
                            )
                    await tasks[seg.index]  # raises what generation raised
                tail = encoder.finish()
                if tail:
                    first_audio = first_audio or time.monotonic()
                    await context.write(speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=tail)))
            except InvalidRequest as err:
                raise _invalid(err) from err
            finally:
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                for seg in segments:
                    bundle.worker.close(seg.stream)
                encoder.close()

            done = time.monotonic()
            audio_seconds = encoder.samples_out / plan.sample_rate
            reasons = {s.finish_reason for s in segments}
            if "error" in reasons:  # the engine failed a segment's step and kept serving the others
                raise errors.internal("the engine failed while computing this request; see the server log")
            finish = "length" if "length" in reasons else "stop"
            summary = speech_pb2.SpeechSummary(
                audio_seconds=audio_seconds,
                audio_tokens=sum(s.audio_tokens for s in segments),
                real_time_factor=(done - received) / audio_seconds if audio_seconds > 0 else 0.0,
                total=seconds_to_duration(done - received),
                finish_reason=FINISH_REASONS[finish],
                request_id=request_id,
                model=model.name,
            )
            if first_audio is not None:
                summary.time_to_first_audio.CopyFrom(seconds_to_duration(first_audio - received))
            await context.write(speech_pb2.SynthesizeSpeechResponse(summary=summary))

    # --- helpers ---
    def _params(
        self,
        plan: SpeechPlan,
        model: ServedModel,
        layout: SpeechLayout,
        bundle: SpeechBundle,
        text: str,
        prompt: Sequence[int],
        index: int,
    ) -> SamplingParams:
        context = model.context_length
        room = (context - len(prompt)) // layout.frame_size
        if room < 1:
            raise errors.invalid_argument(
                [FieldViolation("text", f"a segment's prompt is {len(prompt)} tokens; the context is {context}")]
            )
        seconds = self.limits.audio_seconds_base + self.limits.audio_seconds_per_char * len(text)
        frames = min(room, math.ceil(seconds * layout.sample_rate / bundle.codec.frame_samples))
        kwargs = dict(plan.sampling)
        if "seed" in kwargs:
            kwargs["seed"] = int(kwargs["seed"]) + index  # segments differ, the request stays reproducible
        params = SamplingParams(
            **kwargs,  # type: ignore[arg-type]
            max_tokens=frames * layout.frame_size,
            stop_token_ids=[layout.end_of_speech],
            constraint_factory=shared(bundle.constraint),
        )
        try:
            params.validate(model.vocab_size)
        except InvalidRequest as err:
            raise _invalid(err) from err
        return params

    @staticmethod
    async def _generate(
        model: ServedModel, bundle: SpeechBundle, seg: _Segment, gate: asyncio.Semaphore, request_id: str
    ) -> None:
        """Run one segment through the engine, pushing complete frames to its codec stream."""
        layout, worker, engine = bundle.layout, bundle.worker, model.engine
        assert engine is not None
        frame: list[int] = []
        try:
            async with gate:
                stream = engine.stream(seg.prompt, seg.params, request_id=request_id)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        frames: list[list[int]] = []
                        for token in out.new_token_ids:
                            if token == layout.end_of_speech:
                                break
                            try:
                                frame.append(layout.code_of(token, seg.audio_tokens))
                            except ValueError:  # cannot happen under the constraint; end the audio if it does
                                log.warning("segment %d: token %d is not an audio token; ending", seg.index, token)
                                break
                            seg.audio_tokens += 1
                            if len(frame) == layout.frame_size:
                                frames.append(frame)
                                frame = []
                        worker.push(seg.stream, frames)
                        if out.finished:
                            seg.finish_reason = out.finish_reason
            worker.finish(seg.stream)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                seg.stream.chunks.put_nowait(exc)  # the writer raises it in order
            raise
