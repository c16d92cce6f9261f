import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from omnivox.v1 import content_pb2 as _content_pb2
from omnivox.v1 import generation_pb2 as _generation_pb2
from omnivox.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VoiceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VOICE_KIND_UNSPECIFIED: _ClassVar[VoiceKind]
    VOICE_KIND_BUILT_IN: _ClassVar[VoiceKind]
    VOICE_KIND_CREATED: _ClassVar[VoiceKind]
VOICE_KIND_UNSPECIFIED: VoiceKind
VOICE_KIND_BUILT_IN: VoiceKind
VOICE_KIND_CREATED: VoiceKind

class SynthesizeSpeechRequest(_message.Message):
    __slots__ = ("model", "text", "voice", "audio_config", "sampling", "request_id", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    voice: VoiceSelection
    audio_config: AudioConfig
    sampling: _sampling_pb2.SamplingConfig
    request_id: str
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., voice: _Optional[_Union[VoiceSelection, _Mapping]] = ..., audio_config: _Optional[_Union[AudioConfig, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingConfig, _Mapping]] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class StreamingSynthesizeSpeechRequest(_message.Message):
    __slots__ = ("config", "text", "end")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    config: StreamingSpeechConfig
    text: str
    end: bool
    def __init__(self, config: _Optional[_Union[StreamingSpeechConfig, _Mapping]] = ..., text: _Optional[str] = ..., end: _Optional[bool] = ...) -> None: ...

class StreamingSpeechConfig(_message.Message):
    __slots__ = ("model", "voice", "audio_config", "sampling", "request_id", "max_clause_chars", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CLAUSE_CHARS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    voice: VoiceSelection
    audio_config: AudioConfig
    sampling: _sampling_pb2.SamplingConfig
    request_id: str
    max_clause_chars: int
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., voice: _Optional[_Union[VoiceSelection, _Mapping]] = ..., audio_config: _Optional[_Union[AudioConfig, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingConfig, _Mapping]] = ..., request_id: _Optional[str] = ..., max_clause_chars: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class VoiceSelection(_message.Message):
    __slots__ = ("name", "language_code")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    language_code: str
    def __init__(self, name: _Optional[str] = ..., language_code: _Optional[str] = ...) -> None: ...

class AudioConfig(_message.Message):
    __slots__ = ("encoding", "sample_rate_hertz", "speaking_rate")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    SPEAKING_RATE_FIELD_NUMBER: _ClassVar[int]
    encoding: _content_pb2.AudioEncoding
    sample_rate_hertz: int
    speaking_rate: float
    def __init__(self, encoding: _Optional[_Union[_content_pb2.AudioEncoding, str]] = ..., sample_rate_hertz: _Optional[int] = ..., speaking_rate: _Optional[float] = ...) -> None: ...

class SynthesizeSpeechResponse(_message.Message):
    __slots__ = ("format", "audio", "summary")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    format: AudioFormat
    audio: AudioChunk
    summary: SpeechSummary
    def __init__(self, format: _Optional[_Union[AudioFormat, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., summary: _Optional[_Union[SpeechSummary, _Mapping]] = ...) -> None: ...

class StreamingSynthesizeSpeechResponse(_message.Message):
    __slots__ = ("format", "audio", "summary")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    format: AudioFormat
    audio: AudioChunk
    summary: SpeechSummary
    def __init__(self, format: _Optional[_Union[AudioFormat, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., summary: _Optional[_Union[SpeechSummary, _Mapping]] = ...) -> None: ...

class CreateVoiceResponse(_message.Message):
    __slots__ = ("voice",)
    VOICE_FIELD_NUMBER: _ClassVar[int]
    voice: Voice
    def __init__(self, voice: _Optional[_Union[Voice, _Mapping]] = ...) -> None: ...

class AudioFormat(_message.Message):
    __slots__ = ("encoding", "sample_rate_hertz", "channels")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    encoding: _content_pb2.AudioEncoding
    sample_rate_hertz: int
    channels: int
    def __init__(self, encoding: _Optional[_Union[_content_pb2.AudioEncoding, str]] = ..., sample_rate_hertz: _Optional[int] = ..., channels: _Optional[int] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SpeechSummary(_message.Message):
    __slots__ = ("audio_seconds", "audio_tokens", "time_to_first_audio", "real_time_factor", "total", "finish_reason", "request_id", "model", "cached_prompt_tokens", "prompt_tokens")
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    audio_seconds: float
    audio_tokens: int
    time_to_first_audio: _duration_pb2.Duration
    real_time_factor: float
    total: _duration_pb2.Duration
    finish_reason: _generation_pb2.FinishReason
    request_id: str
    model: str
    cached_prompt_tokens: int
    prompt_tokens: int
    def __init__(self, audio_seconds: _Optional[float] = ..., audio_tokens: _Optional[int] = ..., time_to_first_audio: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., real_time_factor: _Optional[float] = ..., total: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ("model", "language_code")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    model: str
    language_code: str
    def __init__(self, model: _Optional[str] = ..., language_code: _Optional[str] = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "language_codes", "model", "kind", "description", "transcript", "reference_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    language_codes: _containers.RepeatedScalarFieldContainer[str]
    model: str
    kind: VoiceKind
    description: str
    transcript: str
    reference_seconds: float
    def __init__(self, name: _Optional[str] = ..., language_codes: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., kind: _Optional[_Union[VoiceKind, str]] = ..., description: _Optional[str] = ..., transcript: _Optional[str] = ..., reference_seconds: _Optional[float] = ...) -> None: ...

class CreateVoiceRequest(_message.Message):
    __slots__ = ("model", "name", "reference_audio", "transcript", "description")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    reference_audio: _content_pb2.AudioPart
    transcript: str
    description: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., reference_audio: _Optional[_Union[_content_pb2.AudioPart, _Mapping]] = ..., transcript: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("model", "name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
