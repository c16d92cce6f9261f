import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from omnivox.v1 import content_pb2 as _content_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeechEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEECH_EVENT_TYPE_UNSPECIFIED: _ClassVar[SpeechEventType]
    SPEECH_EVENT_TYPE_SPEECH_START: _ClassVar[SpeechEventType]
    SPEECH_EVENT_TYPE_SPEECH_END: _ClassVar[SpeechEventType]
SPEECH_EVENT_TYPE_UNSPECIFIED: SpeechEventType
SPEECH_EVENT_TYPE_SPEECH_START: SpeechEventType
SPEECH_EVENT_TYPE_SPEECH_END: SpeechEventType

class TranscribeRequest(_message.Message):
    __slots__ = ("model", "audio", "language", "prompt", "timestamps", "request_id", "task", "cache_salt", "temperature", "word_timestamps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    audio: _content_pb2.AudioPart
    language: str
    prompt: str
    timestamps: bool
    request_id: str
    task: str
    cache_salt: str
    temperature: float
    word_timestamps: bool
    def __init__(self, model: _Optional[str] = ..., audio: _Optional[_Union[_content_pb2.AudioPart, _Mapping]] = ..., language: _Optional[str] = ..., prompt: _Optional[str] = ..., timestamps: _Optional[bool] = ..., request_id: _Optional[str] = ..., task: _Optional[str] = ..., cache_salt: _Optional[str] = ..., temperature: _Optional[float] = ..., word_timestamps: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("text", "start_offset", "end_offset", "words", "avg_logprob", "compression_ratio", "no_speech_prob", "temperature", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    AVG_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    NO_SPEECH_PROB_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    words: _containers.RepeatedCompositeFieldContainer[TranscriptWord]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., words: _Optional[_Iterable[_Union[TranscriptWord, _Mapping]]] = ..., avg_logprob: _Optional[float] = ..., compression_ratio: _Optional[float] = ..., no_speech_prob: _Optional[float] = ..., temperature: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TranscriptWord(_message.Message):
    __slots__ = ("word", "start_offset", "end_offset", "probability")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    word: str
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    probability: float
    def __init__(self, word: _Optional[str] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., probability: _Optional[float] = ...) -> None: ...

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

class StreamingTranscribeRequest(_message.Message):
    __slots__ = ("config", "audio", "finalize")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    config: StreamingTranscriptionConfig
    audio: bytes
    finalize: bool
    def __init__(self, config: _Optional[_Union[StreamingTranscriptionConfig, _Mapping]] = ..., audio: _Optional[bytes] = ..., finalize: _Optional[bool] = ...) -> None: ...

class StreamingTranscriptionConfig(_message.Message):
    __slots__ = ("model", "encoding", "sample_rate_hertz", "language", "interim_results", "task", "prompt", "endpoint_silence_ms", "request_id", "cache_salt", "temperature")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    INTERIM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    model: str
    encoding: _content_pb2.AudioEncoding
    sample_rate_hertz: int
    language: str
    interim_results: bool
    task: str
    prompt: str
    endpoint_silence_ms: int
    request_id: str
    cache_salt: str
    temperature: float
    def __init__(self, model: _Optional[str] = ..., encoding: _Optional[_Union[_content_pb2.AudioEncoding, str]] = ..., sample_rate_hertz: _Optional[int] = ..., language: _Optional[str] = ..., interim_results: _Optional[bool] = ..., task: _Optional[str] = ..., prompt: _Optional[str] = ..., endpoint_silence_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., temperature: _Optional[float] = ...) -> None: ...

class StreamingTranscribeResponse(_message.Message):
    __slots__ = ("speech_event", "result", "summary")
    SPEECH_EVENT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    speech_event: SpeechEvent
    result: StreamingTranscriptionResult
    summary: StreamingTranscriptionSummary
    def __init__(self, speech_event: _Optional[_Union[SpeechEvent, _Mapping]] = ..., result: _Optional[_Union[StreamingTranscriptionResult, _Mapping]] = ..., summary: _Optional[_Union[StreamingTranscriptionSummary, _Mapping]] = ...) -> None: ...

class SpeechEvent(_message.Message):
    __slots__ = ("type", "offset", "utterance_index")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    type: SpeechEventType
    offset: _duration_pb2.Duration
    utterance_index: int
    def __init__(self, type: _Optional[_Union[SpeechEventType, str]] = ..., offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., utterance_index: _Optional[int] = ...) -> None: ...

class StreamingTranscriptionResult(_message.Message):
    __slots__ = ("text", "is_final", "stability", "start_offset", "end_offset", "language", "utterance_index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    is_final: bool
    stability: float
    start_offset: _duration_pb2.Duration
    end_offset: _duration_pb2.Duration
    language: str
    utterance_index: int
    def __init__(self, text: _Optional[str] = ..., is_final: _Optional[bool] = ..., stability: _Optional[float] = ..., start_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., end_offset: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., language: _Optional[str] = ..., utterance_index: _Optional[int] = ...) -> None: ...

class StreamingTranscriptionSummary(_message.Message):
    __slots__ = ("text", "utterances", "audio_seconds", "real_time_factor", "time_to_first_result", "request_id", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    UTTERANCES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_RESULT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: str
    utterances: int
    audio_seconds: float
    real_time_factor: float
    time_to_first_result: _duration_pb2.Duration
    request_id: str
    model: str
    def __init__(self, text: _Optional[str] = ..., utterances: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., real_time_factor: _Optional[float] = ..., time_to_first_result: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...
