"""Bounded fuzzing (seconds, derandomised so CI is reproducible): hypothesis strategies built from the proto
descriptors of every request message. `FromString` on random bytes raises only DecodeError; the validator accepts
or rejects every generated GenerateRequest with INVALID_ARGUMENT (never another exception); generated requests of
every RPC sent to an in-process server never end UNKNOWN or INTERNAL. Longer soaks: benchmarks/load_fault.py."""

from __future__ import annotations

import contextlib
import math

import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.errors import Code, ServiceError
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import validation
from omnivox.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    speech_pb2,
    speech_pb2_grpc,
    transcription_pb2,
    transcription_pb2_grpc,
)

FD = descriptor.FieldDescriptor
REQUESTS = [
    generation_pb2.GenerateRequest,
    speech_pb2.SynthesizeSpeechRequest,
    speech_pb2.ListVoicesRequest,
    transcription_pb2.TranscribeRequest,
    model_pb2.ListModelsRequest,
]


def fuzz(max_examples: int) -> settings:
    """Reproducible (derandomised, no example database written into the tree), no per-example deadline."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# Values that find edges: bounds of each wire type, and the texts the server interprets (roles, model names).
_INT32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
_INT64 = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
_UINT32 = st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
_UINT64 = st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1))
_FLOAT = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1e30]), st.floats(width=32))
_DOUBLE = st.one_of(st.sampled_from([0.0, 1.0, math.inf, -math.inf, math.nan, 1e300]), st.floats())
_TEXT = st.one_of(
    st.sampled_from(["", "user", "system", "assistant", "tiny", "en", "{}", "<|audio|>"]), st.text(max_size=24)
)
_BYTES = st.one_of(st.sampled_from([b"", b"RIFF", b"\x89PNG\r\n\x1a\n"]), st.binary(max_size=64))

_SCALARS = {
    FD.TYPE_INT32: _INT32,
    FD.TYPE_SINT32: _INT32,
    FD.TYPE_SFIXED32: _INT32,
    FD.TYPE_INT64: _INT64,
    FD.TYPE_SINT64: _INT64,
    FD.TYPE_SFIXED64: _INT64,
    FD.TYPE_UINT32: _UINT32,
    FD.TYPE_FIXED32: _UINT32,
    FD.TYPE_UINT64: _UINT64,
    FD.TYPE_FIXED64: _UINT64,
    FD.TYPE_FLOAT: _FLOAT,
    FD.TYPE_DOUBLE: _DOUBLE,
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: _TEXT,
    FD.TYPE_BYTES: _BYTES,
}


def _value(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    if field.type == FD.TYPE_MESSAGE:
        return message_strategy(field.message_type, depth + 1)
    return _SCALARS[field.type]


@st.composite
def _message(draw: st.DrawFn, desc: descriptor.Descriptor, depth: int) -> Message:
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(desc)()
    for field in desc.fields:
        if depth > 4 or not draw(st.booleans()):  # each field set or not; bounded nesting
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_value(key_f, depth), _value(val_f, depth), max_size=3))
            target = getattr(msg, field.name)
            for k, v in entries.items():
                if val_f.type == FD.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            items = draw(st.lists(_value(field, depth), max_size=3))
            if field.type == FD.TYPE_MESSAGE:
                getattr(msg, field.name).extend(items)
            else:
                getattr(msg, field.name).extend(items)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, depth)))
        else:
            setattr(msg, field.name, draw(_value(field, depth)))
    return msg


def message_strategy(desc: descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Any message of type `desc`: every field set or not, scalars from their wire type's edges, nesting <= 4."""
    return _message(desc, depth)


@st.composite
def plausible_generate(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """A GenerateRequest near the valid region (fully random ones are nearly all rejected): one user turn, a few
    sampling fields from around their ranges (edges and just outside them included), then random fields on top."""
    req = generation_pb2.GenerateRequest()
    turn = req.contents.add(role=draw(st.sampled_from(["user", "user", "system", "", "tool"])))
    turn.parts.add(text=draw(st.text(min_size=0, max_size=40)))
    s = req.sampling
    if draw(st.booleans()):
        s.temperature = draw(st.sampled_from([0.0, 0.7, 1.0, 2.0, -0.1, math.nan]))
    if draw(st.booleans()):
        s.top_k = draw(st.sampled_from([0, 1, 5, -1, -2]))
    if draw(st.booleans()):
        s.top_p = draw(st.sampled_from([0.1, 0.9, 1.0, 0.0, 1.5]))
    if draw(st.booleans()):
        s.seed = draw(_INT64)
    if draw(st.booleans()):
        for k, v in draw(st.dictionaries(st.integers(-2, 300), _FLOAT, max_size=2)).items():
            s.logit_bias[k] = v
    req.max_output_tokens = draw(st.integers(-1, 4))
    if draw(st.booleans()):
        req.stop_sequences.extend(draw(st.lists(st.text(max_size=4), max_size=3)))
    if draw(st.booleans()):
        req.stop_token_ids.extend(draw(st.lists(st.integers(-1, 300), max_size=3)))
    if draw(st.booleans()):
        req.logprobs = True
        req.top_logprobs = draw(st.integers(-1, 25))
    return req


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.DESCRIPTOR.name)
def test_from_string_raises_only_decode_error(cls) -> None:
    @fuzz(150)
    @given(st.one_of(st.binary(max_size=256), message_strategy(cls.DESCRIPTOR).map(lambda m: m.SerializeToString())))
    def check(data: bytes) -> None:
        mutated = data[: len(data) // 2] + b"\xff" + data[len(data) // 2 :]  # a valid message, one byte off
        for blob in (data, mutated):
            with contextlib.suppress(DecodeError):  # anything else fails the test
                cls.FromString(blob)

    check()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz")
    ckpt = make_checkpoint(root / "tiny", family="llama")
    speech = save_random_speech_model(
        root / "speech", snac_config=dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    )
    specs = [ModelSpec(path=ckpt, name="tiny"), ModelSpec(path=speech, name="speech")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as srv:
        for b in srv.server.services:
            if isinstance(b.servicer, SpeechServicer):  # the random decoder speaks for its whole budget: keep it short
                b.servicer.limits.audio_seconds_base, b.servicer.limits.audio_seconds_per_char = 0.1, 0.0
        yield srv


def _small(req: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """Fast to serve: at most 4 output tokens (a validated request would otherwise run for its whole budget)."""
    if not req.HasField("max_output_tokens") or req.max_output_tokens > 4:
        req.max_output_tokens = 4
    return req


def _named(req: Message) -> Message:
    if "model" in req.DESCRIPTOR.fields_by_name:
        req.model = "speech" if req.DESCRIPTOR.name in ("SynthesizeSpeechRequest", "ListVoicesRequest") else "tiny"
    return req


def test_validator_accepts_or_rejects_cleanly(server: ServerThread) -> None:
    model = server.registry.lookup("tiny")
    outcomes = {"ok": 0, "invalid": 0}

    @fuzz(400)
    @given(st.one_of(message_strategy(generation_pb2.GenerateRequest.DESCRIPTOR), plausible_generate()))
    def check(req: generation_pb2.GenerateRequest) -> None:
        try:
            validation.validate_generate(req, model)
            outcomes["ok"] += 1
        except ServiceError as err:
            assert err.code == Code.INVALID_ARGUMENT and err.field_violations, err
            outcomes["invalid"] += 1

    check()
    assert outcomes["ok"] and outcomes["invalid"]  # both sides were reached


def test_generated_requests_never_get_unknown_or_internal(server: ServerThread) -> None:
    ch = server.channel()
    stubs = {
        generation_pb2.GenerateRequest: generation_pb2_grpc.GenerationServiceStub(ch).Generate,
        speech_pb2.SynthesizeSpeechRequest: speech_pb2_grpc.SpeechServiceStub(ch).SynthesizeSpeech,
        speech_pb2.ListVoicesRequest: speech_pb2_grpc.SpeechServiceStub(ch).ListVoices,
        transcription_pb2.TranscribeRequest: transcription_pb2_grpc.TranscriptionServiceStub(ch).Transcribe,
        model_pb2.ListModelsRequest: model_pb2_grpc.ModelServiceStub(ch).ListModels,
    }
    codes: dict[str, int] = {}
    any_request = st.one_of(
        message_strategy(generation_pb2.GenerateRequest.DESCRIPTOR).map(_small),
        plausible_generate(),  # Generate does the most: random and near-valid requests
        *(message_strategy(cls.DESCRIPTOR) for cls in REQUESTS[1:]),
    )
    # A random model name is NOT_FOUND before anything else is looked at: most requests name the served one.
    any_request = st.tuples(any_request, st.integers(0, 3)).map(lambda t: _named(t[0]) if t[1] else t[0])

    @fuzz(250)
    @given(any_request)
    def check(req: Message) -> None:
        call = stubs[type(req)]
        try:
            result = call(req, timeout=20)
            if not isinstance(result, Message):
                list(result)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        codes[code.name] = codes.get(code.name, 0) + 1
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (req, code)

    check()
    print("fuzz status codes:", codes)
    assert codes.get("OK") and codes.get("INVALID_ARGUMENT"), codes
    for name in ("tiny", "speech"):
        free, total = server.wait_kv_free(name, timeout=5.0)
        assert free == total, name
