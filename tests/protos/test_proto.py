"""The committed generated code matches the .proto files, and the API follows its conventions."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

from support.paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "protos"))
spec = importlib.util.spec_from_file_location("omnivox_protos_generate", ROOT / "protos" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

# Lines that record the versions of protoc / grpcio-tools, not the API.
_VERSION_STAMP = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$",
    re.MULTILINE,
)


def _serialized_descriptor(path: Path) -> bytes:
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", path.read_text(), re.DOTALL)
    assert match, f"{path.name}: no serialized descriptor"
    return ast.literal_eval(match.group(1))


def _stamps(text: str) -> list[str]:
    return _VERSION_STAMP.findall(text)


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    committed = generate.generated_files(generate.PROTOS_DIR)
    assert [p.name for p in committed] == [p.name for p in fresh], "run `make proto`: generated files differ"
    for new, old in zip(fresh, committed, strict=True):
        if new.name.endswith("_pb2.py"):
            # The API itself, independent of the tool version: the serialized FileDescriptorProto.
            assert _serialized_descriptor(new) == _serialized_descriptor(old), f"{old.name} is stale: run `make proto`"
        new_text, old_text = new.read_text(), old.read_text()
        if _stamps(new_text) == _stamps(old_text):
            # Same tool versions: the files must be byte-identical.
            assert new_text == old_text, f"{old.name} is stale: run `make proto`"


def test_every_proto_has_generated_code() -> None:
    names = {p.name for p in generate.generated_files(generate.PROTOS_DIR)}
    for proto in generate.proto_files():
        stem = proto.stem
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names


def test_conventions() -> None:
    """Enums start with *_UNSPECIFIED = 0; services end in Service; RPCs take XRequest and return XResponse."""
    from omnivox.v1 import content_pb2, generation_pb2, model_pb2, sampling_pb2, speech_pb2, transcription_pb2

    modules = [content_pb2, generation_pb2, model_pb2, sampling_pb2, speech_pb2, transcription_pb2]
    services = []
    for module in modules:
        file = module.DESCRIPTOR
        assert file.package == "omnivox.v1"
        for enum in file.enum_types_by_name.values():
            prefix = re.sub(r"(?<!^)([A-Z])", r"_\1", enum.name).upper()
            assert enum.values[0].number == 0 and enum.values[0].name == f"{prefix}_UNSPECIFIED", enum.name
            assert all(v.name.startswith(prefix + "_") for v in enum.values), enum.name
        for service in file.services_by_name.values():
            services.append(service.full_name)
            assert service.name.endswith("Service")
            for method in service.methods:
                assert method.input_type.name == f"{method.name}Request"
                assert method.output_type.name == f"{method.name}Response"
    assert sorted(services) == [
        "omnivox.v1.GenerationService",
        "omnivox.v1.ModelService",
        "omnivox.v1.SpeechService",
        "omnivox.v1.TranscriptionService",
    ]


def test_sampling_fields_are_optional() -> None:
    """Unset sampling fields are distinguishable from zero (proto3 `optional`), so the model default applies."""
    from omnivox.v1 import generation_pb2, sampling_pb2

    cfg = sampling_pb2.SamplingConfig()
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"):
        assert not cfg.HasField(name)
    cfg.temperature = 0.0
    assert cfg.HasField("temperature")
    req = generation_pb2.GenerateRequest()
    assert not req.HasField("max_output_tokens")
    req.max_output_tokens = 8
    assert req.HasField("max_output_tokens")
