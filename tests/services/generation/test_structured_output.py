"""Structured output (issue 12): response_format over a real gRPC server on a tiny random model, sampled at
temperature 1 — every output must parse and validate, whatever the random weights prefer."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.checkpoints import make_checkpoint
from support.grpc_errors import violation_descriptions
from support.service_harness import ServerThread, user_request

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import structured
from omnivox.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

SEEDS = 50
MAX_TOKENS = 160

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}


def validate(value: object, schema: dict) -> None:
    """The JSON Schema subset SCHEMA uses (no jsonschema package in the venv); raises AssertionError."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= value.keys(), value
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), value
        for k, v in value.items():
            validate(v, props[k])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 10**9), value
        for v in value:
            validate(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", -(10**30)) <= value <= schema.get("maximum", 10**30), value
    elif kind == "boolean":
        assert isinstance(value, bool), value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=1024)
    options = EngineOptions(kv_cache_gib=0.02, max_num_seqs=64)
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], options) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def run(stub, request: generation_pb2.GenerateRequest) -> tuple[str, generation_pb2.GenerateSummary]:
    text, summary = "", None
    for response in stub.Generate(request):
        if response.WhichOneof("response") == "delta":
            text += response.delta.text
        else:
            summary = response.summary
    assert summary is not None
    return text, summary


def sampled(fmt: generation_pb2.ResponseFormat, seed: int, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("max_output_tokens", MAX_TOKENS)
    sampling = fields.pop("sampling", sampling_pb2.SamplingConfig(temperature=1.0, seed=seed))
    return user_request("Give me the data.", response_format=fmt, sampling=sampling, **fields)


def run_seeds(stub, fmt: generation_pb2.ResponseFormat, **fields) -> list[tuple[str, generation_pb2.GenerateSummary]]:
    with ThreadPoolExecutor(16) as pool:  # concurrent: the engine batches them, masks filled for the whole batch
        return list(pool.map(lambda s: run(stub, sampled(fmt, s, **fields)), range(SEEDS)))


def test_json_schema_every_seed_validates(stub) -> None:
    fmt = generation_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA))
    for text, summary in run_seeds(stub, fmt):
        assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP, text
        validate(json.loads(text), SCHEMA)
        assert "\n" not in text and ": " not in text  # compact JSON: whitespace bounded


def test_regex_lark_and_choices_match(stub) -> None:
    regex = r"(yes|no) [0-9]{1,3}(\.[0-9]{2})?"
    for text, summary in run_seeds(stub, generation_pb2.ResponseFormat(regex=regex)):
        assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP
        assert re.fullmatch(regex, text), text
    lark = 'start: greet " " name\ngreet: "hi" | "hello"\nname: /[a-z]{2,5}/'
    for text, _ in run_seeds(stub, generation_pb2.ResponseFormat(lark_grammar=lark)):
        assert re.fullmatch(r"(hi|hello) [a-z]{2,5}", text), text
    values = ["red", "green", 'say "hi"\n', "東京"]
    fmt = generation_pb2.ResponseFormat(choices=generation_pb2.Choices(values=values))
    seen = set()
    for text, _ in run_seeds(stub, fmt):
        assert text in values, text
        seen.add(text)
    assert len(seen) >= 2  # sampled, not stuck on one


def test_space_bias_still_terminates(stub, server: ServerThread) -> None:
    """+100 on the space token: JSON whitespace is compact, so spaces fit only inside bounded strings."""
    space = server.engine("tiny").tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    fmt = generation_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA))
    for seed in range(10):
        sampling = sampling_pb2.SamplingConfig(temperature=1.0, seed=seed, logit_bias={space[0]: 100.0})
        text, summary = run(stub, sampled(fmt, seed, sampling=sampling))
        assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP, text
        validate(json.loads(text), SCHEMA)


def test_min_and_max_tokens(stub) -> None:
    """A finished grammar ends the output even below min_output_tokens; max_output_tokens mid-structure is LENGTH."""
    fmt = generation_pb2.ResponseFormat(choices=generation_pb2.Choices(values=["yes", "no"]))
    text, summary = run(stub, sampled(fmt, 0, min_output_tokens=50))
    assert text in ("yes", "no") and summary.finish_reason == generation_pb2.FINISH_REASON_STOP
    fmt = generation_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA))
    text, summary = run(stub, sampled(fmt, 0, max_output_tokens=5))
    assert summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH and summary.usage.output_tokens == 5
    assert text.startswith("{")


@pytest.mark.parametrize(
    ("fmt", "field", "reason"),
    [
        (generation_pb2.ResponseFormat(json_schema="{not json"), "response_format.json_schema", "not valid JSON"),
        (
            generation_pb2.ResponseFormat(json_schema='{"type": "object", "properties": {"a": {"type": "wat"}}}'),
            "response_format.json_schema",
            "wat",
        ),
        (generation_pb2.ResponseFormat(regex="(unclosed"), "response_format.regex", "does not compile"),
        (generation_pb2.ResponseFormat(lark_grammar="start: missing_rule"), "response_format.lark_grammar", "missing"),
        (generation_pb2.ResponseFormat(choices=generation_pb2.Choices()), "response_format.choices.values", "at least"),
    ],
)
def test_bad_grammar_is_invalid_argument(stub, fmt, field: str, reason: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        run(stub, sampled(fmt, 0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = violation_descriptions(info.value)
    assert field in found and reason in found[field], found


def test_slow_compile_does_not_stall_other_streams(stub, monkeypatch) -> None:
    """A grammar whose compile takes 2 s (and one over the timeout) waits alone: another stream's tokens keep coming."""
    real = structured.GrammarCompiler._compile
    release = threading.Event()

    def slow(self, grammar: str):
        if "slowpoke" in grammar:
            release.wait(10)
        return real(self, grammar)

    monkeypatch.setattr(structured.GrammarCompiler, "_compile", slow)
    slow_fmt = generation_pb2.ResponseFormat(regex="slowpoke [0-9]+")
    with ThreadPoolExecutor(2) as pool:
        slow_future = pool.submit(run, stub, sampled(slow_fmt, 1, max_output_tokens=8))
        time.sleep(0.2)
        arrivals = []
        request = user_request("Tell me a story", max_output_tokens=40, ignore_eos=True)
        request.sampling.temperature = 0.0
        for _response in stub.Generate(request):
            arrivals.append(time.monotonic())
        assert not slow_future.done()  # the other stream finished while the grammar was still compiling
        release.set()
        text, _ = slow_future.result(timeout=30)
    assert re.fullmatch("slowpoke [0-9]+", text) or text.startswith("slowpoke"), text
    assert len(arrivals) >= 10


def test_compile_timeout_is_invalid_argument(stub, server: ServerThread, monkeypatch) -> None:
    compiler = server.registry.lookup("tiny").bundle.grammars
    monkeypatch.setattr(compiler, "timeout_s", 0.3)
    real = structured.GrammarCompiler._compile
    monkeypatch.setattr(structured.GrammarCompiler, "_compile", lambda self, g: (time.sleep(1.0), real(self, g))[1])
    with pytest.raises(grpc.RpcError) as info:
        run(stub, sampled(generation_pb2.ResponseFormat(regex="too slow [a-z]+"), 0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "did not compile within 0.3 s" in violation_descriptions(info.value)["response_format.regex"]


def test_a_burst_of_distinct_grammars_all_compile(stub, server: ServerThread, monkeypatch) -> None:
    """The timeout counts compile time, not the wait behind other compiles: 16 distinct grammars at once over the 2
    workers, each compiling in 0.1 s under a 0.5 s timeout, all succeed (the last ones queue ~0.7 s)."""
    compiler = server.registry.lookup("tiny").bundle.grammars
    monkeypatch.setattr(compiler, "timeout_s", 0.5)
    real = structured.GrammarCompiler._compile
    monkeypatch.setattr(structured.GrammarCompiler, "_compile", lambda self, g: (time.sleep(0.1), real(self, g))[1])
    words = [f"burst{i}" for i in range(16)]
    fmts = [generation_pb2.ResponseFormat(regex=w) for w in words]
    with ThreadPoolExecutor(len(words)) as pool:
        texts = list(pool.map(lambda f: run(stub, sampled(f, 0, max_output_tokens=16))[0], fmts))
    assert texts == words


def test_ignore_eos_with_response_format_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        run(stub, sampled(generation_pb2.ResponseFormat(regex="a+"), 0, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in violation_descriptions(info.value)["ignore_eos"]
