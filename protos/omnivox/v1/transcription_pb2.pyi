import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from omnivox.v1 import content_pb2 as _content_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TranscribeRequest(_message.Message):
    __slots__ = ("model", "audio", "language", "prompt", "timestamps", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    audio: _content_pb2.AudioPart
    language: str
    prompt: str
    timestamps: bool
    request_id: str
    def __init__(self, model: _Optional[str] = ..., audio: _Optional[_Union[_content_pb2.AudioPart, _Mapping]] = ..., language: _Optional[str] = ..., prompt: _Optional[str] = ..., timestamps: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class TranscribeResponse(_message.Message):
    __slots__ = ("delta", "summary")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    delta: TranscriptDelta
    summary: TranscriptionSummary
    def __init__(self, delta: _Optional[_Union[TranscriptDelta, _Mapping]] = ..., summary: _Optional[_Union[TranscriptionSummary, _Mapping]] = ...) -> None: ...

class TranscriptDelta(_message.Message):
    __slots__ = ("text", "segment_index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    segment_index: int
    def __init__(self, text: _Optional[str] = ..., segment_index: _Optional[int] = ...) -> None: ...

class TranscriptSegment(_message.Message):
    __slots__ = ("text", "start_offset", "end_offset")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    text: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    def __init__(self, text: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TranscriptionSummary(_message.Message):
    __slots__ = ("text", "language", "audio_seconds", "real_time_factor", "segments", "output_tokens", "time_to_first_token", "total", "request_id", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: str
    language: str
    audio_seconds: float
    real_time_factor: float
    segments: _containers.RepeatedCompositeFieldContainer[TranscriptSegment]
    output_tokens: int
    time_to_first_token: _duration_pb2.Duration
    total: _duration_pb2.Duration
    request_id: str
    model: str
    def __init__(self, text: _Optional[str] = ..., language: _Optional[str] = ..., audio_seconds: _Optional[float] = ..., real_time_factor: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[TranscriptSegment, _Mapping]]] = ..., output_tokens: _Optional[int] = ..., time_to_first_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., total: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...
