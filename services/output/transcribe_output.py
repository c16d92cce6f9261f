"""Transcribe's output processing: text deltas and the summary as TranscribeResponses, whichever front carries them
(gRPC's TranscriptionServicer, the HTTP front's /v1/audio/transcriptions), plus the RTF metric and the call's log
fields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from omnivox.services.call_record import current_call
from omnivox.services.calls.whisper_fallback import DecodeStats
from omnivox.services.metrics import Metrics
from omnivox.services.output.summaries import seconds_to_duration
from omnivox.services.output.whisper_words import TimedWord
from omnivox.services.processing.transcribe_request import TranscribeJob
from omnivox.v1 import transcription_pb2

Response = transcription_pb2.TranscribeResponse


@dataclass
class Transcript:
    """A finished transcription, from either kind of model."""

    text: str
    language: str | None
    segments: list[tuple[float, float, str]]  # (start s, end s, text) from the start of the audio
    output_tokens: int
    first_token_time: float | None  # time.monotonic() at the first token or text (None: none came)
    words: list[list[TimedWord]] = field(default_factory=list)  # per segment, when asked for (Whisper)
    stats: list[DecodeStats] = field(default_factory=list)  # per segment (Whisper)


def delta(text: str, segment_index: int) -> Response:
    return Response(delta=transcription_pb2.TranscriptDelta(text=text, segment_index=segment_index))


def summary(job: TranscribeJob, transcript: Transcript, metrics: Metrics) -> Response:
    """The summary of a finished transcription (observing the RTF metric, setting the call's log fields)."""
    checked = job.checked
    name, seconds = checked.model.name, job.seconds
    elapsed = time.monotonic() - checked.received
    out = transcription_pb2.TranscriptionSummary(
        text=transcript.text,
        language=transcript.language or "",
        audio_seconds=seconds,
        real_time_factor=elapsed / seconds if seconds > 0 else 0.0,
        output_tokens=transcript.output_tokens,
        total=seconds_to_duration(elapsed),
        request_id=checked.request_id,
        model=name,
    )
    if transcript.first_token_time is not None:
        out.time_to_first_token.CopyFrom(seconds_to_duration(transcript.first_token_time - checked.received))
    if seconds > 0:
        metrics.transcription_rtf.labels(name).observe(out.real_time_factor)
    current_call().set(request_id=checked.request_id, model=name, audio_seconds=round(seconds, 3),
                       output_tokens=transcript.output_tokens, rtf=round(out.real_time_factor, 4))  # fmt: skip
    for i, (start, end, text) in enumerate(transcript.segments):
        words = transcript.words[i] if i < len(transcript.words) else []
        out.segments.append(
            transcription_pb2.TranscriptSegment(
                text=text,
                start_offset=seconds_to_duration(start),
                end_offset=seconds_to_duration(end),
                words=[
                    transcription_pb2.TranscriptWord(
                        word=w.word,
                        start_offset=seconds_to_duration(w.start),
                        end_offset=seconds_to_duration(w.end),
                        probability=w.probability,
                    )
                    for w in words
                ],
            )  # fmt: skip
        )
        if i < len(transcript.stats):  # Whisper: how the window's kept decode scored
            stats, segment = transcript.stats[i], out.segments[-1]
            segment.avg_logprob, segment.compression_ratio = stats.avg_logprob, stats.compression_ratio
            segment.no_speech_prob, segment.temperature = stats.no_speech_prob, stats.temperature
            segment.token_ids.extend(stats.token_ids)
    return Response(summary=out)
