"""ModelService, health, reflection, model states, several models at once, TLS: over real gRPC on localhost."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request
from support.whisper_checkpoints import make_whisper

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc, model_pb2, model_pb2_grpc

KV = EngineOptions(kv_cache_gib=0.01)
OMNIVOX_SERVICES = ["omnivox.v1.GenerationService", "omnivox.v1.ModelService", "omnivox.v1.TranscriptionService"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return (
        make_checkpoint(root / "Tiny-Llama", family="llama"),
        make_checkpoint(root / "tiny-qwen3", family="qwen3", max_position_embeddings=256),
    )


@pytest.fixture(scope="module")
def server(checkpoints):
    llama, qwen3 = checkpoints
    with ServerThread([ModelSpec(path=llama), ModelSpec(path=qwen3, name="qwen")], KV) as srv:
        yield srv


def health_status(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def test_list_models(server: ServerThread) -> None:
    response = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest())
    by_name = {m.name: m for m in response.models}
    assert set(by_name) == {"tiny-llama", "qwen"}  # folder name (lower-cased), and the given name
    llama, qwen = by_name["tiny-llama"], by_name["qwen"]
    assert llama.is_default and not qwen.is_default
    assert list(llama.input_modalities) == [model_pb2.MODALITY_TEXT]
    assert list(llama.output_modalities) == [model_pb2.MODALITY_TEXT]
    assert llama.context_length == 512 and qwen.context_length == 256
    assert llama.context_length == server.engine("tiny-llama").model_config.max_model_len
    assert not llama.has_untrained_components and not llama.untrained_components
    assert llama.ready and qwen.ready
    assert llama.source.endswith("Tiny-Llama")


def test_requests_reach_the_named_model(server: ServerThread) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    for name, expected in (("", "tiny-llama"), ("tiny-llama", "tiny-llama"), ("qwen", "qwen")):
        *_, last = stub.Generate(user_request("Hi", model=name, max_output_tokens=3))
        assert last.summary.model == expected
    # The context bound is the named model's own (256 for qwen).
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(user_request("Hi", model="qwen", max_output_tokens=300)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_serving_after_load(server: ServerThread) -> None:
    channel = server.channel()
    for service in ["", *OMNIVOX_SERVICES]:
        assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(server: ServerThread) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    [response] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in response.list_services_response.service}
    assert set(OMNIVOX_SERVICES) <= names
    assert "grpc.health.v1.Health" in names
    # A client with no .proto files can fetch the descriptors (this is what grpcurl does).
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="omnivox.v1.GenerationService")
    [response] = stub.ServerReflectionInfo(iter([request]))
    assert response.file_descriptor_response.file_descriptor_proto


def test_reflection_v1_as_well_as_v1alpha(server: ServerThread) -> None:
    """grpcurl >= 1.9, buf curl and grpcui ask grpc.reflection.v1 first: answered, not UNIMPLEMENTED."""
    info = server.channel().stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )  # v1 and v1alpha are the same messages under two package names
    [response] = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in response.list_services_response.service}
    assert set(OMNIVOX_SERVICES) <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    for symbol in ("omnivox.v1.GenerationService", "grpc.reflection.v1.ServerReflection"):
        [response] = info(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]))
        protos = [
            descriptor_pb2.FileDescriptorProto.FromString(r)
            for r in response.file_descriptor_response.file_descriptor_proto
        ]
        assert symbol in {f"{p.package}.{s.name}" for p in protos for s in p.service}


def test_not_serving_while_loading(checkpoints) -> None:
    """Before the models load: health NOT_SERVING, Generate UNAVAILABLE, ListModels shows the model not ready."""
    with ServerThread([ModelSpec(path=checkpoints[0], name="later")], KV, load=False) as srv:
        channel = srv.channel()
        assert health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(user_request("Hi")))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        [model] = model_pb2_grpc.ModelServiceStub(channel).ListModels(model_pb2.ListModelsRequest()).models
        assert model.name == "later" and not model.ready
        srv.run(srv.server.load_models(KV))
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        *_, last = generation_pb2_grpc.GenerationServiceStub(channel).Generate(user_request("Hi", max_output_tokens=2))
        assert last.summary.usage.output_tokens >= 1


def test_health_not_serving_while_draining(checkpoints) -> None:
    with ServerThread([ModelSpec(path=checkpoints[0])], KV) as srv:
        srv.run(srv.server.health.enter_graceful_shutdown())
        assert health_status(srv.channel()) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_large_messages_accepted(server: ServerThread) -> None:
    """Up to the 64 MiB receive limit (images and audio arrive inline): a 5 MiB request is read, not refused."""
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    request = user_request("Hi")
    request.contents[0].parts.add().image.data = b"\0" * (5 << 20)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request))
    # Read and validated: refused for the modality, not for the size.
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image" in info.value.details()


def test_duplicate_names_rejected(checkpoints) -> None:
    from omnivox.services.grpc_api.server import build_registry
    from omnivox.services.parts.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="two models are named"):
        build_registry([ModelSpec(path=checkpoints[0], name="x"), ModelSpec(path=checkpoints[1], name="x")], 8)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(checkpoints, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    with ServerThread([ModelSpec(path=checkpoints[0])], KV, host="localhost", tls_cert=cert, tls_key=key) as srv:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"localhost:{srv.server.port}", creds) as channel:
            *_, last = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                user_request("Hi", max_output_tokens=2)
            )
            assert last.summary.usage.output_tokens >= 1
        with grpc.insecure_channel(f"localhost:{srv.server.port}") as plain, pytest.raises(grpc.RpcError):
            model_pb2_grpc.ModelServiceStub(plain).ListModels(model_pb2.ListModelsRequest(), timeout=2)


def test_health_watch_does_not_hold_shutdown(checkpoints) -> None:
    """A Watch stream never ends on its own; the drain must not wait the whole grace period for it."""
    import time

    with ServerThread([ModelSpec(path=checkpoints[0])], KV) as srv:
        watch = health_pb2_grpc.HealthStub(srv.channel()).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        start = time.monotonic()
        srv.run(srv.server.stop(30.0))
        assert time.monotonic() - start < 5.0
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # watchers saw the drain


def test_generate_refuses_a_speech_only_model(checkpoints, tmp_path: Path) -> None:
    """A model whose only output is audio is named on `model` by Generate; ListModels shows it untrained."""
    from omnivox.services.parts.defaults import save_random_speech_model

    speech = save_random_speech_model(tmp_path / "speech")
    with ServerThread([ModelSpec(path=checkpoints[0], name="text"), ModelSpec(path=speech, name="voice")], KV) as srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(user_request("Hi", model="voice", max_output_tokens=2)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model:" in info.value.details() and "does not generate text" in info.value.details()
        models = model_pb2_grpc.ModelServiceStub(srv.channel()).ListModels(model_pb2.ListModelsRequest()).models
        voice = next(m for m in models if m.name == "voice")
        assert list(voice.output_modalities) == [model_pb2.MODALITY_AUDIO]
        assert voice.has_untrained_components and voice.untrained_components


def test_a_client_without_protos_can_call_generate(server: ServerThread) -> None:
    """What grpcurl does: learn the API from reflection alone, build messages from JSON, call Generate."""
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = server.channel()
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("omnivox.v1.GenerationService").FindMethodByName("Generate")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    request = json_format.Parse(
        '{"contents": [{"role": "user", "parts": [{"text": "Hi"}]}], "max_output_tokens": 3}', request_cls()
    )
    call = channel.unary_stream(
        "/omnivox.v1.GenerationService/Generate",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    responses = [json_format.MessageToDict(r) for r in call(request)]
    assert "delta" in responses[0] and "summary" in responses[-1]
    assert responses[-1]["summary"]["usage"]["outputTokens"] <= 3


def test_message_size_limit(checkpoints) -> None:
    """Above --max-message-mib a request is refused with RESOURCE_EXHAUSTED, and the server goes on serving."""
    with ServerThread([ModelSpec(path=checkpoints[0])], KV, max_receive_message_bytes=1 << 20) as srv:
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        request = user_request("Hi", max_output_tokens=2)
        request.contents[0].parts.add().image.data = b"\0" * (2 << 20)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        *_, last = stub.Generate(user_request("Hi", max_output_tokens=2))
        assert last.HasField("summary")


def test_start_up_does_not_list_a_model_that_failed_to_load(tmp_path):
    """`omnivox serve` with a model that failed to load (here Whisper asked for int8) logged the error, then
    "serving text, whisper on ..." as if both served. Now the failed one is named as not serving."""
    specs = [
        ModelSpec(path=make_checkpoint(tmp_path / "text"), name="text"),
        ModelSpec(path=make_whisper(tmp_path / "whisper"), name="whisper", engine_overrides={"quantization": "int8"}),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as server:
        line = server.server.serving_line()
    assert line == f"serving text on {server.address}; not serving whisper (failed to load)"
