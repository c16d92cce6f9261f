"""`serve --quantization` and `--speculative`, per model: parsed from the command line, built into the engine, and
serving over gRPC with the tokens the engine itself gives for that configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request
from support.whisper_checkpoints import make_whisper

from omnivox.engine import Engine, SamplingParams
from omnivox.engine.speculative import NgramProposer
from omnivox.models.quant import Int8Linear
from omnivox.services.cli._common import CliError
from omnivox.services.cli._serve_flags import model_specs
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc, sampling_pb2

GREEDY = sampling_pb2.SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("flags") / "tiny", family="llama")


def test_flags_bind_to_models(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    specs = model_specs([a, b], [], [], ["b=int8", "auto"], ["a=ngram"])
    assert [dict(s.engine_overrides) for s in specs] == [
        {"quantization": "auto", "speculative": "ngram"},
        {"quantization": "auto"},  # the unnamed flag comes later and applies to every model
    ]
    specs = model_specs([a, b], [], [], ["auto", "b=int8"], ["draft:/x"])
    assert [dict(s.engine_overrides) for s in specs] == [
        {"quantization": "auto", "speculative": "draft:/x"},
        {"quantization": "int8", "speculative": "draft:/x"},
    ]
    for quant, spec, message in (
        (["int3"], [], "must be one of"),
        (["c=int8"], [], "no model is served as 'c'"),
        ([], ["draft:"], "expected ngram or draft:PATH"),
        ([], ["medusa"], "expected ngram or draft:PATH"),
    ):
        with pytest.raises(CliError, match=message):
            model_specs([a, b], [], [], quant, spec)


def test_int8_and_ngram_over_grpc_equal_the_engine(checkpoint):
    reference = Engine.from_pretrained(checkpoint, device="cpu", kv_cache_gib=0.01, quantization="int8")
    spec = ModelSpec(path=checkpoint, name="tiny", engine_overrides={"quantization": "int8", "speculative": "ngram"})
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01)) as srv:
        engine = srv.engine("tiny")
        assert any(isinstance(m, Int8Linear) for m in engine.model.modules())
        assert isinstance(engine.core.proposer, NgramProposer)
        stub = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        request = user_request("Hello there! Hello there! Hello there!", sampling=GREEDY, max_output_tokens=24)
        tokens = [t for r in stub.Generate(request) if r.HasField("delta") for t in r.delta.token_ids]
        rendered = "<|im_start|>user\nHello there! Hello there! Hello there!<|im_end|>\n<|im_start|>assistant\n"
        prompt = engine.tokenizer.encode(rendered, add_special_tokens=False)  # the tiny checkpoint's ChatML, by hand
        expected = reference.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=24))[0]
        assert tokens == expected.token_ids
        assert srv.wait_kv_free("tiny")[0] == engine.kv_usage().total_blocks


def test_unnamed_flags_apply_where_they_can_and_named_ones_are_strict(tmp_path, caplog):
    """`serve --quantization int8` (no NAME=) with a float-only Whisper served beside a text model: the text model
    takes int8, Whisper loads float with a warning naming why (it failed to load before); `whisper=int8` named stays
    an error. --activation-bits 8 likewise skips a model whose weights stay float."""
    text, whisper = make_checkpoint(tmp_path / "text"), make_whisper(tmp_path / "whisper")
    specs = model_specs([text, whisper], ["text", "whisper"], [], ["int8"], [], ["8"])
    assert [sorted(s.lenient_fields) for s in specs] == [["activation_bits", "quantization"]] * 2
    with caplog.at_level("WARNING"), ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as srv:
        assert srv.server.serving_line() == f"serving text, whisper on {srv.address}"
        assert any(isinstance(m, Int8Linear) for m in srv.engine("text").model.modules())
        assert not any(isinstance(m, Int8Linear) for m in srv.engine("whisper").model.modules())
    warned = [r.getMessage() for r in caplog.records if "loads without that flag" in r.getMessage()]
    assert len(warned) == 2 and "not supported for Whisper" in warned[0] and "activation_bits 8" in warned[1], warned
    named = model_specs([text, whisper], ["text", "whisper"], [], ["int8", "whisper=int8"], [])
    assert named[1].lenient_fields == frozenset() and named[0].lenient_fields == {"quantization"}
    with ServerThread(named, EngineOptions(kv_cache_gib=0.01)) as srv:
        assert srv.server.serving_line() == f"serving text on {srv.address}; not serving whisper (failed to load)"
