"""What every RPC's summary is written with (output processing): durations and finish reasons on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import duration_pb2

from omnivox.v1 import content_pb2, generation_pb2, speech_pb2

# The engine's finish reasons as the API spells them (generation.proto FinishReason).
FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def finish_reason(reason: str | None) -> int:
    """The wire value of an engine finish reason; UNSPECIFIED for one the API has no name for."""
    return FINISH_REASONS.get(reason or "", generation_pb2.FINISH_REASON_UNSPECIFIED)


def seconds_to_duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


def audio_format(encoding: Any, sample_rate: int, channels: int) -> speech_pb2.AudioFormat:
    """The first message of both speech RPCs: what the audio chunks hold (`encoding`: codecs/audio_format.py)."""
    return speech_pb2.AudioFormat(
        encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{encoding.value}"),
        sample_rate_hertz=sample_rate,
        channels=channels,
    )


@dataclass
class SpeechTotals:
    """What a synthesis counted, for its summary."""

    audio_seconds: float
    audio_tokens: int
    cached_prompt_tokens: int
    prompt_tokens: int
    finish: str  # "stop" or "length"


def speech_summary(
    totals: SpeechTotals, received: float, done: float, first_audio: float | None, request_id: str, model: str
) -> speech_pb2.SpeechSummary:
    """The last message of both speech RPCs (times: time.monotonic())."""
    seconds = totals.audio_seconds
    summary = speech_pb2.SpeechSummary(
        audio_seconds=seconds,
        audio_tokens=totals.audio_tokens,
        real_time_factor=(done - received) / seconds if seconds > 0 else 0.0,
        total=seconds_to_duration(done - received),
        finish_reason=FINISH_REASONS[totals.finish],
        request_id=request_id,
        model=model,
        cached_prompt_tokens=totals.cached_prompt_tokens,
        prompt_tokens=totals.prompt_tokens,
    )
    if first_audio is not None:
        summary.time_to_first_audio.CopyFrom(seconds_to_duration(first_audio - received))
    return summary
