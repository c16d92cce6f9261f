from omnivox.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "input_modalities", "output_modalities", "context_length", "has_untrained_components", "untrained_components", "is_default", "source", "ready", "default_sampling", "trained_on")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HAS_UNTRAINED_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    UNTRAINED_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRAINED_ON_FIELD_NUMBER: _ClassVar[int]
    name: str
    input_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    context_length: int
    has_untrained_components: bool
    untrained_components: _containers.RepeatedScalarFieldContainer[str]
    is_default: bool
    source: str
    ready: bool
    default_sampling: _sampling_pb2.SamplingConfig
    trained_on: str
    def __init__(self, name: _Optional[str] = ..., input_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., context_length: _Optional[int] = ..., has_untrained_components: _Optional[bool] = ..., untrained_components: _Optional[_Iterable[str]] = ..., is_default: _Optional[bool] = ..., source: _Optional[str] = ..., ready: _Optional[bool] = ..., default_sampling: _Optional[_Union[_sampling_pb2.SamplingConfig, _Mapping]] = ..., trained_on: _Optional[str] = ...) -> None: ...
