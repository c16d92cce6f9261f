"""OpenAI's audio transcription API (/v1/audio/transcriptions and /translations) <-> our TranscribeRequest /
TranscriptionSummary: the multipart form's fields read and checked, and the five response formats (json, text, srt,
vtt, verbose_json) and the stream's `transcript.text.delta` / `transcript.text.done` events written. No web framework
here: services/openai_api/http_transcription.py carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.v1 import content_pb2, transcription_pb2

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMED_FORMATS = ("srt", "vtt", "verbose_json")  # need segment times: Whisper writes timestamp tokens for them
GRANULARITIES = ("segment", "word")
MEDIA_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain; charset=utf-8",
               "srt": "application/x-subrip; charset=utf-8", "vtt": "text/vtt; charset=utf-8"}  # fmt: skip
# Our request's fields -> the form's names (a violation's `param`).
_PARAMS = {"audio": "file", "audio.data": "file", "timestamps": "response_format", "temperature": "temperature"}


def transcription_param(field: str) -> str:
    """The form field a violation of our TranscribeRequest's `field` is about."""
    head = field.split(".", 1)[0]
    return _PARAMS.get(field, _PARAMS.get(head, head))


@dataclass
class TranscriptionForm:
    """A checked form: the request to run and how to answer."""

    request: transcription_pb2.TranscribeRequest
    response_format: str
    words: bool  # timestamp_granularities[] names word
    segments: bool  # verbose_json's segments (on unless the granularities name only word)
    stream: bool


def _text(form: Any, name: str, bad: list[FieldViolation]) -> str:
    value = form.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        bad.append(FieldViolation(name, "must be a text field, not a file"))
        return ""
    return value


def transcription_form(form: Any, audio: bytes | None, translate: bool) -> TranscriptionForm:
    """The multipart form's fields (a starlette FormData: `get`, `getlist`) and the file's bytes -> a request;
    INVALID_ARGUMENT naming each bad field by its form name."""
    bad: list[FieldViolation] = []
    model, language, prompt = _text(form, "model", bad), _text(form, "language", bad), _text(form, "prompt", bad)
    response_format = _text(form, "response_format", bad) or "json"
    if response_format not in FORMATS:
        bad.append(FieldViolation("response_format", f"{response_format!r}: one of {', '.join(FORMATS)}"))
    granularities = [g for g in form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")]
    for g in granularities:
        if g not in GRANULARITIES:
            bad.append(FieldViolation("timestamp_granularities[]", f"{g!r}: segment or word"))
    if granularities and response_format != "verbose_json":
        bad.append(FieldViolation("timestamp_granularities[]", "needs response_format verbose_json"))
    stream = _text(form, "stream", bad).lower() in ("true", "1")
    if stream and response_format not in ("json", "text"):
        bad.append(FieldViolation("stream", "streams json or text only (srt, vtt and verbose_json come whole)"))
    temperature = None
    if raw := _text(form, "temperature", bad):
        try:
            temperature = float(raw)
        except ValueError:
            bad.append(FieldViolation("temperature", f"{raw!r} is not a number"))
    if translate and language:
        bad.append(FieldViolation("language", "translations are into English; the source language is detected"))
    if not audio:
        bad.append(FieldViolation("file", "required: the audio file (multipart/form-data)"))
    if bad:
        raise errors.invalid_argument(bad)
    request = transcription_pb2.TranscribeRequest(
        model=model, audio=content_pb2.AudioPart(data=audio), language=language, prompt=prompt,
        timestamps=response_format in TIMED_FORMATS, task="translate" if translate else "",
    )  # fmt: skip
    if temperature:  # OpenAI's 0 (the default) is "raise the temperature when the thresholds are hit": our unset
        request.temperature = temperature
    words = "word" in granularities
    request.word_timestamps = words
    return TranscriptionForm(request, response_format, words, not granularities or "segment" in granularities, stream)


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def _timed(summary: transcription_pb2.TranscriptionSummary) -> list[tuple[float, float, str]]:
    return [(s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9, s.text.strip())
            for s in summary.segments if s.text.strip()]  # fmt: skip


def _segment(i: int, s: transcription_pb2.TranscriptSegment) -> dict[str, Any]:
    start, end = s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9
    return {"id": i, "seek": round(start * 100), "start": start, "end": end, "text": s.text.strip(),
            "temperature": s.temperature, "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
            "no_speech_prob": s.no_speech_prob, "tokens": list(s.token_ids)}  # fmt: skip


def srt(summary: transcription_pb2.TranscriptionSummary) -> str:
    cues = [
        f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n" for i, (a, b, text) in enumerate(_timed(summary), 1)
    ]
    return "\n".join(cues)


def vtt(summary: transcription_pb2.TranscriptionSummary) -> str:
    cues = [f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n" for a, b, text in _timed(summary)]
    return "WEBVTT\n\n" + "\n".join(cues)


def _language_name(code: str) -> str:
    """OpenAI's verbose_json names the language ("english"); the code when Whisper's table lacks it."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code.split("-")[0].lower(), code)


def usage(summary: transcription_pb2.TranscriptionSummary) -> dict[str, Any]:
    return {"type": "duration", "seconds": round(summary.audio_seconds, 3)}


def json_body(summary: transcription_pb2.TranscriptionSummary, form: TranscriptionForm) -> dict[str, Any]:
    """The json or verbose_json response."""
    if form.response_format == "json":
        return {"text": summary.text, "usage": usage(summary)}
    body: dict[str, Any] = {
        "task": "translate" if form.request.task == "translate" else "transcribe",
        "language": _language_name(summary.language),
        "duration": summary.audio_seconds,
        "text": summary.text,
    }
    if form.segments:
        body["segments"] = [_segment(i, s) for i, s in enumerate(s for s in summary.segments if s.text.strip())]
    if form.words:
        body["words"] = [
            {"word": w.word, "start": w.start_offset.ToNanoseconds() / 1e9, "end": w.end_offset.ToNanoseconds() / 1e9}
            for s in summary.segments
            for w in s.words
        ]
    body["usage"] = usage(summary)
    return body


def text_body(summary: transcription_pb2.TranscriptionSummary, response_format: str) -> str:
    if response_format == "srt":
        return srt(summary)
    if response_format == "vtt":
        return vtt(summary)
    return summary.text + "\n"


def delta_event(delta: transcription_pb2.TranscriptDelta) -> dict[str, Any]:
    return {"type": "transcript.text.delta", "delta": delta.text}


def done_event(summary: transcription_pb2.TranscriptionSummary) -> dict[str, Any]:
    return {"type": "transcript.text.done", "text": summary.text, "usage": usage(summary)}
