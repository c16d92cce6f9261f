"""Transcribe's request processing: a wire TranscribeRequest -> what the engine takes, for either kind of model.

Two steps, with the admission between them (services/calls/transcribe_call.py):
- `check(request, registry)`: the cache salt, the model (the named one if it takes audio, else the default if it
  does, else the first that does), the field checks of its kind -> a CheckedTranscribe; nothing is held yet;
- `process(checked)`, once admitted, in a worker thread: the audio decoded (up to TRANSCRIBE_MAX_SECONDS); for an
  audio-LLM also split into the windows its encoder takes, each cut at the quietest 100 ms near its edge
  (codecs/audio_split.py), and the family's transcription prompt -> a TranscribeJob.

Every refusal is a ServiceError carrying FieldViolations (services/errors.py), so any front can report it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import numpy as np

from omnivox.codecs.audio_split import split_at_quiet
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.calls.whisper_fallback import temperature_violation
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import AUDIO, ModelRegistry, ServedModel
from omnivox.services.parts.whisper_part import WhisperPart
from omnivox.services.processing.audio_prompt import AudioInputPart
from omnivox.services.processing.cache_salt import request_salt
from omnivox.services.processing.wire_checks import request_id_violation
from omnivox.v1 import transcription_pb2


@dataclass
class CheckedTranscribe:
    """A request whose fields passed, for a ready model that takes audio; not yet admitted."""

    request: transcription_pb2.TranscribeRequest
    model: ServedModel
    salt: str  # this caller's (and cache_salt's) share of the caches (services/processing/cache_salt.py)
    request_id: str  # the client's, or a new one
    received: float  # time.monotonic() when the request came

    @property
    def whisper(self) -> WhisperPart | None:
        return self.model.bundle.whisper if self.model.bundle is not None else None

    @property
    def task(self) -> str:
        return self.request.task or "transcribe"


@dataclass
class TranscribeJob:
    """A checked request's decoded audio, and for an audio-LLM its windows and prompt (markers not yet expanded)."""

    checked: CheckedTranscribe
    samples: np.ndarray  # float32 mono
    sample_rate: int
    windows: list[tuple[int, int]]  # [start, end) sample ranges (audio-LLMs; Whisper cuts its own)
    prompt_ids: list[int]  # the family's transcription prompt (audio-LLMs)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def audio_model(registry: ModelRegistry, name: str) -> ServedModel:
    """The model called `name` (it must take audio), or the default model if it does, else the first that does."""
    if name:
        model = registry.lookup(name)
        if AUDIO not in model.input_modalities:
            accepted = ", ".join(sorted(model.input_modalities))
            raise errors.invalid_argument(
                [FieldViolation("model", f"model {model.name!r} does not accept audio (it accepts: {accepted})")]
            )
    else:
        default = registry.default
        candidates = [default] if default is not None and AUDIO in default.input_modalities else []
        candidates += [m for m in registry if AUDIO in m.input_modalities]
        if not candidates:
            raise errors.not_found("model", "", "this server serves no model that takes audio")
        model = candidates[0]
    return registry.get_ready(model.name)


def _whisper_violations(request: transcription_pb2.TranscribeRequest, part: WhisperPart) -> list[FieldViolation]:
    bad = []
    try:
        part.check(request.language or None, request.task or "transcribe", request.timestamps)
    except TranscriptionRequestError as err:
        bad.append(FieldViolation(err.field, err.description))
    if (hot := temperature_violation(request)) is not None:
        bad.append(hot)
    return bad


def _audio_llm_violations(request: transcription_pb2.TranscribeRequest, audio: AudioInputPart) -> list[FieldViolation]:
    bad = []
    if request.language:
        try:
            audio.transcription_language(request.language)
        except TranscriptionRequestError as err:
            bad.append(FieldViolation(err.field, err.description))
    marker = audio.marker_text()
    if marker and marker in request.prompt:
        bad.append(FieldViolation("prompt", f"must not contain the audio marker {marker!r}"))
    if request.task not in ("", "transcribe"):
        bad.append(FieldViolation("task", f"{request.task!r}: this model only transcribes (Whisper models translate)"))
    if request.word_timestamps:
        bad.append(
            FieldViolation("word_timestamps", "this model's answer has no alignment to the audio (Whisper's has)")
        )
    if request.HasField("temperature") and request.temperature != 0:
        bad.append(FieldViolation("temperature", "this model transcribes greedily: unset or 0 (Whisper models sample)"))
    return bad


def check(request: transcription_pb2.TranscribeRequest, registry: ModelRegistry) -> CheckedTranscribe:
    received = time.monotonic()
    salt = request_salt(request.cache_salt)
    model = audio_model(registry, request.model)
    assert model.bundle is not None
    if model.bundle.whisper is not None:
        bad = _whisper_violations(request, model.bundle.whisper)
    else:
        assert model.bundle.audio is not None and model.engine is not None
        bad = _audio_llm_violations(request, model.bundle.audio)
    if (too_long := request_id_violation(request.request_id)) is not None:
        bad.append(too_long)
    if bad:
        raise errors.invalid_argument(bad)
    return CheckedTranscribe(request, model, salt, request.request_id or uuid.uuid4().hex, received)


def _process(checked: CheckedTranscribe) -> TranscribeJob:
    """Decode (and for an audio-LLM split and prompt) the audio: blocking, run in a worker thread."""
    request = checked.request
    if (part := checked.whisper) is not None:
        decoded = part.decode(request.audio, "audio")
        return TranscribeJob(checked, decoded.samples, decoded.sample_rate, [], [])
    audio = checked.model.bundle.audio  # type: ignore[union-attr]
    decoded = audio.decode(request.audio, "audio", audio.long_limits())
    windows = split_at_quiet(decoded.samples, decoded.sample_rate, audio.limits.max_seconds)
    # A last window too short for one embedding (a few ms) holds no speech: it is left out, not refused.
    if len(windows) > 1 and windows[-1][1] - windows[-1][0] < audio.limits.min_samples:
        windows.pop()
    try:
        ids = audio.transcription_ids(request.language or None, request.prompt or None)
    except TranscriptionRequestError as err:
        raise errors.invalid_argument([FieldViolation(err.field, err.description)]) from err
    return TranscribeJob(checked, decoded.samples, decoded.sample_rate, windows, ids)


async def process(checked: CheckedTranscribe) -> TranscribeJob:
    return await asyncio.to_thread(_process, checked)
