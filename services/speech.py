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
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from omnivox.codecs.audio_format import AudioStreamEncoder
from omnivox.codecs.decode_worker import END, AudioStream
from omnivox.engine import InvalidRequest, SamplingParams, shared
from omnivox.engine.params import MAX_SEED
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors, voice_speech
from omnivox.services.cache_salt import request_salt
from omnivox.services.errors import FieldViolation, rpc_method
from omnivox.services.logs import current_call
from omnivox.services.metrics import Metrics, SpeechStreamMetrics
from omnivox.services.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.services.speech_part import SpeechPart
from omnivox.services.speech_stream import streaming_synthesize
from omnivox.services.speech_text import MAX_SEGMENT_CHARS, split_text
from omnivox.services.speech_validation import SpeechPlan, invalid, language_matches, validate_speech
from omnivox.services.summaries import seconds_to_duration
from omnivox.services.voices import VoiceStore
from omnivox.v1 import content_pb2, generation_pb2, speech_pb2, speech_pb2_grpc

log = logging.getLogger(__name__)


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


# --- one synthesis -----------------------------------------------------------------------------------------------------
@dataclass
class _Segment:
    index: int
    prompt: list[int]
    params: SamplingParams
    stream: AudioStream
    audio_tokens: int = 0
    finish_reason: str | None = None
    error: InvalidRequest | None = None  # with "error": the request's own values caused it
    cached_tokens: int = 0  # prompt tokens the prefix cache served


class SpeechServicer(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        limits: SpeechLimits | None = None,
        metrics: Metrics | None = None,
        voices: VoiceStore | None = None,
    ) -> None:
        self.registry = registry
        self.voices = voices or VoiceStore()  # created voices, under the server's data folder
        self.limits = limits or SpeechLimits()
        self.metrics = metrics or Metrics()

    # --- models ---
    @staticmethod
    def _is_speech(model: ServedModel) -> bool:
        return AUDIO in model.output_modalities

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

    @staticmethod
    def _layout_of(model: ServedModel) -> SpeechLayout | None:
        """The model's speech layout: its bundle's once loaded, read from its folder while it loads."""
        if model.bundle is not None:
            return model.bundle.speech.layout if model.bundle.speech is not None else None
        if "speech" in model.manifest.parts and model.source is not None:
            return SpeechLayout.load(model.source)
        return None

    # --- RPCs ---
    @rpc_method
    async def ListVoices(
        self, request: speech_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> speech_pb2.ListVoicesResponse:
        models = [self.registry.lookup(request.model)] if request.model else list(self.registry)
        voices = []
        for model in models:
            if "voice" in model.manifest.parts:  # a non-autoregressive voice (services/voice_speech.py)
                voices += voice_speech.list_voices(model, request.language_code)
                continue
            layout = self._layout_of(model)
            if layout is None:
                if request.model:
                    raise errors.invalid_argument(
                        [FieldViolation("model", f"model {model.name!r} does not produce speech")]
                    )
                continue
            if request.language_code and not language_matches(request.language_code, layout.language_code):
                continue
            voices += [speech_pb2.Voice(name=n, language_codes=[layout.language_code], model=model.name,
                                        kind=speech_pb2.VOICE_KIND_BUILT_IN) for n in layout.voices]  # fmt: skip
            voices += [v.to_proto(model.name, layout.language_code) for v in self.voices.list(model.name)]
        return speech_pb2.ListVoicesResponse(voices=voices)

    @rpc_method
    async def StreamingSynthesizeSpeech(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await streaming_synthesize(self, request_iterator, context)

    @rpc_method
    async def CreateVoice(self, request: speech_pb2.CreateVoiceRequest, context: grpc.aio.ServicerContext):
        model = self._speech_model(request.model)
        assert model.bundle is not None
        if model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        assert model.bundle.speech is not None
        layout = model.bundle.speech.layout
        voice = await self.voices.create(model.name, layout, model.bundle.source / layout.codec_folder, request)
        return speech_pb2.CreateVoiceResponse(voice=voice.to_proto(model.name, layout.language_code))

    @rpc_method
    async def DeleteVoice(self, request: speech_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        model = self._speech_model(request.model)
        if model.bundle is not None and model.bundle.voice is not None:
            raise voice_speech.cannot_clone(model, model.bundle.voice)
        if request.name in self._layout_of(model).voices:
            raise errors.failed_precondition(
                f"voice {request.name!r} is built into model {model.name!r}: only created voices can be deleted"
            )
        self.voices.delete(model.name, request.name)
        return speech_pb2.DeleteVoiceResponse()

    @rpc_method
    async def SynthesizeSpeech(
        self, request: speech_pb2.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext
    ) -> None:
        received = time.monotonic()
        salt = request_salt(request.cache_salt)  # this caller's (and cache_salt's) share of the prefix cache
        model = self._speech_model(request.model)
        if model.bundle is not None and model.bundle.voice is not None:  # no engine: services/voice_speech.py
            return await voice_speech.synthesize_voice(self, request, context, model, received)
        assert model.bundle is not None and model.bundle.speech is not None  # a ready speech model
        bundle = model.bundle.speech
        layout, engine = bundle.layout, model.engine
        assert engine is not None
        created = {v.name: v for v in self.voices.list(model.name)}
        plan = validate_speech(request, model, layout, self.limits.max_text_chars, created)
        plan.segments = split_text(plan.text, self.limits.max_segment_chars)
        request_id = request.request_id or uuid.uuid4().hex
        if (ref := created.get(plan.voice)) is not None and plan.voice not in layout.voices:
            prompts = [layout.build_reference_prompt(bundle.text_tokenizer, ref.transcript, ref.frames, s)
                       for s in plan.segments]  # fmt: skip
        else:
            prompts = [layout.build_prompt(bundle.text_tokenizer, s, plan.voice) for s in plan.segments]
        params = [self._params(plan, model, layout, bundle, text, prompt, i) for i, (text, prompt) in
                  enumerate(zip(plan.segments, prompts, strict=True))]  # fmt: skip

        # Opened once admitted (a `with` enters each manager before building the next): the step arbiter puts the
        # stream first when it falls behind its playback, and the metrics close it however the stream ends.
        deadline = self.registry.arbiter.open
        with model.admit(), SpeechStreamMetrics(self.metrics, model.name, received, deadline=deadline(engine)) as slo:
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
                        self._generate(model, bundle, seg, gate, f"{request_id}-{uuid.uuid4().hex[:8]}", salt)
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
                            slo.chunk(encoder.samples_out / plan.sample_rate - slo.meter.sent_s)
                            await context.write(
                                speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=data))
                            )
                    await tasks[seg.index]  # raises what generation raised
                tail = encoder.finish()
                if tail:
                    first_audio = first_audio or time.monotonic()
                    slo.chunk(encoder.samples_out / plan.sample_rate - slo.meter.sent_s)
                    await context.write(speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=tail)))
            except InvalidRequest as err:
                raise invalid(err) from err
            except asyncio.CancelledError:  # client cancel, deadline, forced stop: counted as vLLM does
                self.metrics.request_ended(model.name, "abort")
                raise
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
            caused = next((s.error for s in segments if s.error is not None), None)
            if caused is not None:  # its own values left a segment nothing to sample (-inf biases on every code)
                raise invalid(caused)
            if "error" in reasons:  # the engine failed a segment's step and kept serving the others
                self.metrics.request_ended(model.name, "error")
                raise errors.internal("the engine failed while computing this request; see the server log")
            finish = "length" if "length" in reasons else "stop"
            slo.finish(audio_seconds, done)
            self.metrics.success.labels(model.name, finish).inc()
            self.metrics.e2e.labels(model.name).observe(done - received)
            spans = [seg.stream.codec_span for seg in segments if seg.stream.codec_span is not None]
            if spans:  # tracing: the codec's passes for this request, first start to last end
                current_call().phase("codec", min(a for a, _ in spans), max(b for _, b in spans))
            current_call().set(
                request_id=request_id,
                model=model.name,
                audio_seconds=round(audio_seconds, 3),
                ttfa_s=round(first_audio - received, 6) if first_audio is not None else None,
                underruns=slo.meter.count,
            )
            summary = speech_pb2.SpeechSummary(
                audio_seconds=audio_seconds,
                audio_tokens=sum(s.audio_tokens for s in segments),
                real_time_factor=(done - received) / audio_seconds if audio_seconds > 0 else 0.0,
                total=seconds_to_duration(done - received),
                finish_reason=FINISH_REASONS[finish],
                request_id=request_id,
                model=model.name,
                cached_prompt_tokens=sum(s.cached_tokens for s in segments),
                prompt_tokens=sum(len(s.prompt) for s in segments),
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
        bundle: SpeechPart,
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
            # segments differ, the request stays reproducible (wrapped: the seed range ends at MAX_SEED)
            kwargs["seed"] = (int(kwargs["seed"]) + index) % (MAX_SEED + 1)
        params = SamplingParams(
            **kwargs,  # type: ignore[arg-type]
            max_tokens=frames * layout.frame_size,
            stop_token_ids=[layout.end_of_speech],
            detokenize=False,  # the audio codes are read as token ids; their text is never used
            constraint_factory=shared(bundle.constraint),
        )
        try:
            params.validate(model.vocab_size)
        except InvalidRequest as err:
            raise invalid(err) from err
        return params

    @staticmethod
    async def _generate(
        model: ServedModel,
        bundle: SpeechPart,
        seg: _Segment,
        gate: asyncio.Semaphore,
        request_id: str,
        salt: str = "",
    ) -> None:
        """Run one segment through the engine, pushing complete frames to its codec stream."""
        layout, worker, engine = bundle.layout, bundle.worker, model.engine
        assert engine is not None
        frame: list[int] = []
        try:
            async with gate:
                stream = engine.stream(seg.prompt, seg.params, request_id=request_id, cache_salt=salt)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        seg.cached_tokens = max(seg.cached_tokens, out.num_cached_tokens)
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
                            seg.finish_reason, seg.error = out.finish_reason, out.error
            worker.finish(seg.stream)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                seg.stream.chunks.put_nowait(exc)  # the writer raises it in order
            raise
