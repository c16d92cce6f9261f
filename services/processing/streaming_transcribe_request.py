"""StreamingTranscribe's request processing: the config message -> the Whisper model and the chunk decoder (or one
INVALID_ARGUMENT naming each bad `config.` field). Nothing here knows which front carries the stream."""

from __future__ import annotations

from omnivox.codecs.audio_format import AudioEncoding
from omnivox.codecs.audio_input import AudioInputError
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services import errors
from omnivox.services.calls.whisper_fallback import temperature_violation
from omnivox.services.errors import FieldViolation
from omnivox.services.parts.registry import ModelRegistry, ServedModel
from omnivox.services.parts.whisper_part import SAMPLE_RATE, WhisperPart
from omnivox.services.processing.wire_checks import request_id_violation
from omnivox.v1 import content_pb2, transcription_pb2

ENDPOINT_SILENCE_MS = (100, 10_000)  # accepted range of config.endpoint_silence_ms


def whisper_model(registry: ModelRegistry, name: str) -> ServedModel:
    """The Whisper model called `name` (INVALID_ARGUMENT for another kind), or the first Whisper model served."""
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


def validate(part: WhisperPart, cfg: transcription_pb2.StreamingTranscriptionConfig) -> StreamingAudioDecoder:
    """The config's problems as one INVALID_ARGUMENT naming each field; else the chunk decoder."""
    bad: list[FieldViolation] = []
    try:
        part.check(cfg.language or None, cfg.task or "transcribe", False)
        part.prompt_tokens(cfg.prompt)
    except TranscriptionRequestError as err:
        bad.append(FieldViolation(f"config.{err.field}", err.description))
    if (hot := temperature_violation(cfg, "config.temperature")) is not None:
        bad.append(hot)
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
