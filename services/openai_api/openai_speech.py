"""OpenAI's /v1/audio/speech JSON -> the wire SynthesizeSpeechRequest the gRPC front takes, so both fronts share one
speech processing (services/calls/speech_call.py); and the speech output as OpenAI's SSE events and voice objects.

A value the JSON itself gets wrong raises INVALID_ARGUMENT naming the OpenAI parameter; what the speech checks refuse
names a SynthesizeSpeechRequest field, which `speech_param` maps back.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from omnivox.services.openai_api.openai_request import bad
from omnivox.v1 import content_pb2, speech_pb2


@dataclass(frozen=True)
class ResponseFormat:
    encoding: int  # content_pb2.AudioEncoding
    sample_rate: int  # 0: the model's own rate
    media_type: str


# OpenAI's response_format values this server encodes. pcm is OpenAI's raw 24 kHz 16-bit little-endian mono; opus is
# Ogg Opus (24 kHz is an Opus rate, a Piper voice's 22.05 kHz is not); mp3 constant-bitrate MP3 at the model's rate
# (codecs/audio_format.py). aac has no encoder here.
RESPONSE_FORMATS = {
    "wav": ResponseFormat(content_pb2.AUDIO_ENCODING_WAV, 0, "audio/wav"),
    "flac": ResponseFormat(content_pb2.AUDIO_ENCODING_FLAC, 0, "audio/flac"),
    "opus": ResponseFormat(content_pb2.AUDIO_ENCODING_OGG_OPUS, 24000, "audio/ogg"),
    "pcm": ResponseFormat(content_pb2.AUDIO_ENCODING_LINEAR16, 24000, "audio/pcm"),
    "mp3": ResponseFormat(content_pb2.AUDIO_ENCODING_MP3, 0, "audio/mpeg"),
}
DEFAULT_RESPONSE_FORMAT = "mp3"  # OpenAI's
STREAM_FORMATS = ("audio", "sse")


@dataclass
class SpeechBody:
    """One /v1/audio/speech request: the wire request, how its bytes go out."""

    request: speech_pb2.SynthesizeSpeechRequest
    response_format: ResponseFormat
    sse: bool


def _string(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(key, f"must be a string, not {type(value).__name__}")
    return value


def speech_body(body: dict[str, Any]) -> SpeechBody:
    """A /v1/audio/speech body as a SynthesizeSpeechRequest (no model: the default speech model)."""
    text = _string(body, "input")
    if text is None:
        raise bad("input", "is required: the text to speak")
    request = speech_pb2.SynthesizeSpeechRequest(model=_string(body, "model") or "", text=text)
    voice = body.get("voice")
    if isinstance(voice, dict):  # the newer SDKs' {"id": "..."} form
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise bad("voice", "must be a voice name (GET /v1/audio/voices lists them)")
    request.voice.name = voice or ""  # none: the model's default voice
    name = _string(body, "response_format") or DEFAULT_RESPONSE_FORMAT
    if name not in RESPONSE_FORMATS:
        raise bad("response_format", f"{name!r} is not served; this server encodes {', '.join(RESPONSE_FORMATS)}")
    fmt = RESPONSE_FORMATS[name]
    request.audio_config.encoding = fmt.encoding
    request.audio_config.sample_rate_hertz = fmt.sample_rate
    speed = body.get("speed")
    if speed is not None:
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            raise bad("speed", "must be a number")
        if speed != 1.0:  # 1.0 is every model's own pace, also for a model that takes no rate (Orpheus)
            request.audio_config.speaking_rate = float(speed)
    if _string(body, "instructions"):
        raise bad("instructions", "this server's speech models take no instructions (voice, speed and format only)")
    stream_format = _string(body, "stream_format") or "audio"
    if stream_format not in STREAM_FORMATS:
        raise bad("stream_format", f"must be one of {', '.join(STREAM_FORMATS)}")
    return SpeechBody(request, fmt, stream_format == "sse")


_PARAMS = (
    (r"^text$", "input"),
    (r"^audio_config\.(encoding|sample_rate_hertz)$", "response_format"),
    (r"^audio_config\.speaking_rate$", "speed"),
    (r"^voice(\..*)?$", "voice"),
    (r"^sampling\.", ""),
)


def speech_param(field: str) -> str:
    """The OpenAI parameter a SynthesizeSpeechRequest field path came from."""
    for pattern, replacement in _PARAMS:
        if re.match(pattern, field):
            return re.sub(pattern, replacement, field)
    return field


def audio_delta(data: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}


def audio_done(summary: speech_pb2.SpeechSummary) -> dict[str, Any]:
    """The last SSE event: the text's tokens (a voice: its phoneme ids) and the audio tokens generated."""
    usage = {"input_tokens": summary.prompt_tokens, "output_tokens": summary.audio_tokens}
    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
    return {"type": "speech.audio.done", "usage": usage}


def voice_object(voice: speech_pb2.Voice) -> dict[str, Any]:
    kind = speech_pb2.VoiceKind.Name(voice.kind).removeprefix("VOICE_KIND_").lower()
    return {"object": "voice", "id": voice.name, "name": voice.name, "model": voice.model,
            "language_codes": list(voice.language_codes), "kind": kind}  # fmt: skip
