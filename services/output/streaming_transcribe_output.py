"""StreamingTranscribe's output processing: speech events, interim and final results and the summary as
StreamingTranscribeResponses (offsets exact in 16 kHz samples), plus the RTF metric."""

from __future__ import annotations

from google.protobuf import duration_pb2

from omnivox.services.calls.whisper import WhisperResult
from omnivox.services.metrics import Metrics
from omnivox.services.output.summaries import seconds_to_duration
from omnivox.services.parts.whisper_part import SAMPLE_RATE
from omnivox.v1 import transcription_pb2

Response = transcription_pb2.StreamingTranscribeResponse
SPEECH_START = transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_START
SPEECH_END = transcription_pb2.SPEECH_EVENT_TYPE_SPEECH_END


def offset(samples: int) -> duration_pb2.Duration:
    """A stream position (16 kHz samples) as an exact Duration: 62,500 ns a sample. Through float seconds
    (seconds_to_duration) 66,240 samples were 4.139999999 s, and a client comparing offsets saw 1 ns gaps."""
    return duration_pb2.Duration(seconds=samples // SAMPLE_RATE, nanos=samples % SAMPLE_RATE * 10**9 // SAMPLE_RATE)


def stability(words: list[str], previous: list[str]) -> float:
    """The share of `words` that the previous interim had too, from the start (its common prefix)."""
    if not words:
        return 1.0
    same = 0
    for a, b in zip(words, previous, strict=False):
        if a != b:
            break
        same += 1
    return same / len(words)


def speech_event(kind: int, at: int, index: int) -> Response:
    return Response(speech_event=transcription_pb2.SpeechEvent(type=kind, offset=offset(at), utterance_index=index))


def result(
    index: int, transcript: WhisperResult, start: int, end: int, language: str, *, is_final: bool, stable: float
) -> Response:
    """An utterance's interim or final result over samples [start, end) of the stream."""
    return Response(
        result=transcription_pb2.StreamingTranscriptionResult(
            text=transcript.text,
            is_final=is_final,
            stability=stable,
            start_offset=offset(start),
            end_offset=offset(end),
            language=transcript.language or language,
            utterance_index=index,
        )
    )


def summary(
    texts: list[str], utterances: int, seconds: float, compute_s: float, request_id: str, model: str,
    time_to_first_result: float | None, metrics: Metrics,
) -> Response:  # fmt: skip
    """All finals' text, the utterances, audio seconds and the passes' real-time factor (observed as the metric)."""
    out = transcription_pb2.StreamingTranscriptionSummary(
        text=" ".join(t for t in texts if t),
        utterances=utterances,
        audio_seconds=seconds,
        real_time_factor=compute_s / seconds if seconds > 0 else 0.0,
        request_id=request_id,
        model=model,
    )
    if time_to_first_result is not None:
        out.time_to_first_result.CopyFrom(seconds_to_duration(time_to_first_result))
    if seconds > 0:
        metrics.transcription_rtf.labels(model).observe(out.real_time_factor)
    return Response(summary=out)
