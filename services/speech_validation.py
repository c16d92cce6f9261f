"""SynthesizeSpeech request validation: the request's own fields here, sampling ranges from the engine's table."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from dataclasses import dataclass, field

from omnivox.codecs.audio_format import AudioEncoding, AudioFormatError, check_output_format
from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors, validation
from omnivox.services.errors import FieldViolation
from omnivox.services.registry import ServedModel
from omnivox.v1 import content_pb2, speech_pb2

# Engine fields that describe the prompt or its length: in a speech request, the text is what made them.
_TEXT_FIELDS = ("prompt", "max_tokens", "segments")


def speech_field(engine_field: str) -> str:
    """The SynthesizeSpeechRequest path of an engine field name."""
    return "text" if engine_field in _TEXT_FIELDS else validation.request_field(engine_field)


def invalid(err: InvalidRequest) -> errors.ServiceError:
    """An engine InvalidRequest as INVALID_ARGUMENT on the speech request's field."""
    return errors.invalid_argument([FieldViolation(speech_field(err.field), err.description)])


@dataclass
class SpeechPlan:
    text: str
    voice: str
    encoding: AudioEncoding
    sample_rate: int
    sampling: dict[
        str, object
    ]  # SamplingParams fields: the model's defaults (its layout's included), then the request's
    segments: list[str] = field(default_factory=list)


def encoding_name(value: int) -> str | None:
    if value == content_pb2.AUDIO_ENCODING_UNSPECIFIED:
        return AudioEncoding.WAV.value
    try:
        return content_pb2.AudioEncoding.Name(value).removeprefix("AUDIO_ENCODING_")
    except ValueError:
        return None


def language_matches(requested: str, offered: str) -> bool:
    """BCP-47 prefix match, either way round: "en" matches "en-US" and "en-US" matches "en"."""
    a, b = requested.lower(), offered.lower()
    return a == b or a.startswith(b + "-") or b.startswith(a + "-")


def validate_speech(
    request: speech_pb2.SynthesizeSpeechRequest,
    model: ServedModel,
    layout: SpeechLayout,
    max_text_chars: int,
    created: Collection[str] = (),
) -> SpeechPlan:
    """INVALID_ARGUMENT listing every bad field, then NOT_FOUND for an unknown voice (`created`: the model's voices
    created from reference audio, besides the layout's own)."""
    v = validation.Violations()
    text = request.text.strip()
    if not any(unicodedata.category(c)[0] not in "ZC" for c in text):
        # strip() keeps zero-width and other format characters ("\u200b"), which the model would then "speak"
        v.add("text", "must not be empty (it holds only spaces, control or zero-width characters)")
    elif len(request.text) > max_text_chars:
        v.add("text", f"is {len(request.text)} characters; the limit is {max_text_chars}")
    name = encoding_name(request.audio_config.encoding)
    encoding, rate = AudioEncoding.WAV, layout.sample_rate
    if name is None:
        v.add("audio_config.encoding", f"unknown encoding value {request.audio_config.encoding}")
    else:
        try:
            encoding, rate = check_output_format(name, request.audio_config.sample_rate_hertz or layout.sample_rate)
        except AudioFormatError as err:
            v.add(f"audio_config.{err.field}", err.description)
    if request.audio_config.HasField("speaking_rate"):  # Orpheus speaks at the pace it samples
        v.add("audio_config.speaking_rate", f"model {model.name!r} does not take a speaking rate")
    # The model's defaults already hold its layout's sampling values (services/bundle.py); the request's win.
    sampling = validation.sampling_kwargs(request.sampling, model)
    validation.add_engine_violations(SamplingParams(**sampling), model, v, speech_field)  # type: ignore[arg-type]
    v.raise_if_any()

    voice = request.voice.name or layout.default_voice
    if voice and (layout.voices or created) and voice not in layout.voices and voice not in created:
        raise errors.not_found(
            "voice",
            voice,
            f"model {model.name!r} has no voice {voice!r} (voices: {', '.join([*layout.voices, *created])})",
        )
    if request.voice.language_code and not language_matches(request.voice.language_code, layout.language_code):
        raise errors.not_found(
            "voice",
            f"{voice or '*'}@{request.voice.language_code}",
            f"model {model.name!r} has no voice for language {request.voice.language_code!r} "
            f"(it speaks {layout.language_code!r})",
        )
    return SpeechPlan(text=text, voice=voice, encoding=encoding, sample_rate=rate, sampling=sampling)
