"""SynthesizeSpeech request validation: the request's own fields here, sampling ranges from the engine's table."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from dataclasses import dataclass, field

from omnivox.codecs.audio_format import AudioEncoding, AudioFormatError, check_output_format
from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.models.orpheus import SpeechLayout
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import ServedModel
from omnivox.services.processing import validation
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
    text = check_text(v, request.text, max_text_chars)
    encoding, rate = check_audio_config(v, request.audio_config, layout.sample_rate)
    if request.audio_config.HasField("speaking_rate"):  # Orpheus speaks at the pace it samples
        v.add("audio_config.speaking_rate", f"model {model.name!r} does not take a speaking rate")
    # The model's defaults already hold its layout's sampling values (services/parts/bundle.py); the request's win.
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
    check_voice_language(model.name, voice, request.voice.language_code, layout.language_code)
    return SpeechPlan(text=text, voice=voice, encoding=encoding, sample_rate=rate, sampling=sampling)


def check_text(v: validation.Violations, text: str, max_text_chars: int) -> str:
    """The text to speak, stripped; a violation on `text` when it holds nothing to say or is over the limit."""
    stripped = text.strip()
    if not any(unicodedata.category(c)[0] not in "ZC" for c in stripped):
        # strip() keeps zero-width and other format characters ("\u200b"), which the model would then "speak"
        v.add("text", "must not be empty (it holds only spaces, control or zero-width characters)")
    elif len(text) > max_text_chars:
        v.add("text", f"is {len(text)} characters; the limit is {max_text_chars}")
    return stripped


def check_audio_config(
    v: validation.Violations, audio_config: speech_pb2.AudioConfig, model_rate: int, prefix: str = ""
) -> tuple[AudioEncoding, int]:
    """The output encoding and rate (unset: WAV at the model's own rate); violations on `prefix`audio_config.*."""
    name = encoding_name(audio_config.encoding)
    encoding, rate = AudioEncoding.WAV, model_rate
    if name is None:
        v.add(f"{prefix}audio_config.encoding", f"unknown encoding value {audio_config.encoding}")
    else:
        try:
            encoding, rate = check_output_format(name, audio_config.sample_rate_hertz or model_rate)
        except AudioFormatError as err:
            v.add(f"{prefix}audio_config.{err.field}", err.description)
    return encoding, rate


def check_voice_language(model_name: str, voice: str, language_code: str, spoken: str) -> None:
    """NOT_FOUND when the requested language is not the one the model speaks."""
    if language_code and not language_matches(language_code, spoken):
        raise errors.not_found(
            "voice",
            f"{voice or '*'}@{language_code}",
            f"model {model_name!r} has no voice for language {language_code!r} (it speaks {spoken!r})",
        )
