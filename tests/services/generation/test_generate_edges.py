"""Structured output and sampling with the cases users of vLLM / SGLang / OpenAI-style APIs bring: schema features
beyond the first few ($ref, recursion, anyOf/oneOf/allOf, enum/const of mixed types, formats, bounds, nullable types,
unicode names), what llguidance cannot enforce (refused, naming the keyword, as vLLM's guidance backend and OpenAI's
strict mode refuse), hostile nesting, and the sampler's edge values. One tiny random model behind a real gRPC server;
every output is checked with the `jsonschema` package. Tool calls: test_tool_schemas.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch
from support.checkpoints import load_reference
from support.service_harness import ServerThread, user_request
from support.tiny_chat_server import invalid_argument, run, tiny_server

from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

SEEDS = 4
MAX_TOKENS = 200

# Each schema bounds its strings and arrays so that a random model at temperature 1 ends within MAX_TOKENS.
S = {"type": "string", "maxLength": 4}
SCHEMAS: dict[str, dict] = {
    "ref_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "recursive": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "definitions_draft7": {
        "definitions": {"n": {"type": "integer"}},
        "type": "array",
        "items": {"$ref": "#/definitions/n"},
        "maxItems": 3,
    },
    "any_one_all_of": {
        "type": "object",
        "properties": {
            "any": {"anyOf": [{"type": "integer"}, S]},
            "one": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
            "all": {
                "allOf": [
                    {"type": "object", "properties": {"p": S}, "additionalProperties": False},
                    {"required": ["p"]},
                ]
            },
        },
        "required": ["any", "one", "all"],
        "additionalProperties": False,
    },
    "enum_const_mixed": {
        "type": "array",
        "prefixItems": [{"enum": [1, "a", None, True, 2.5, {"k": [1]}]}, {"const": {"x": ['é\n"😀', None]}}],
        "items": False,
        "minItems": 2,
    },
    "nested_arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        "minItems": 2,
        "maxItems": 3,
    },
    "additional_properties": {
        "type": "object",
        "properties": {
            "closed": {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False}
        },
        "required": ["closed"],
        "patternProperties": {"^[a-z]{1,3}$": {"type": "boolean"}},  # names bounded: the random model ends
        "additionalProperties": False,
        "maxProperties": 3,  # llguidance takes min/maxProperties only when every listed property is required
    },
    "strings": {
        "type": "object",
        "properties": {
            "len": {"type": "string", "minLength": 2, "maxLength": 3},
            "pattern": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"},
            "date": {"type": "string", "format": "date"},
            "date_time": {"type": "string", "format": "date-time"},
            "uuid": {"type": "string", "format": "uuid"},
            "ipv4": {"type": "string", "format": "ipv4"},
        },
        "required": ["len", "pattern", "date", "date_time", "uuid", "ipv4"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "i": {"type": "integer", "minimum": -3, "maximum": 7},
            "ie": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
            "n": {"type": "number", "minimum": 0.5, "maximum": 2.5},
            "ne": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["i", "ie", "n", "ne"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {
            "s": {"type": ["string", "null"], "maxLength": 3},
            "i": {"type": ["integer", "null"], "minimum": 2},
        },
        "required": ["s", "i"],
        "additionalProperties": False,
    },
    "unicode_names": {
        "type": "object",
        "properties": {"名前": S, 'ü"q\\': {"type": "integer"}, "😀": {"const": "東京"}},
        "required": ["名前", 'ü"q\\', "😀"],
        "additionalProperties": False,
    },
    "annotations_ignored": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/x",
        "title": "T",
        "description": "d",
        "examples": [1],
        "default": 1,
        "$comment": "c",
        "deprecated": True,
        "x-vendor": {"anything": 1},
        "type": "integer",
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with tiny_server(tmp_path_factory.mktemp("ckpt")) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def schema_request(schema: dict | str, seed: int | None = None, **fields) -> generation_pb2.GenerateRequest:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    fields.setdefault("sampling", sampling_pb2.SamplingConfig(temperature=1.0, seed=seed))
    fields.setdefault("max_output_tokens", MAX_TOKENS)
    return user_request("Give me the data.", response_format=generation_pb2.ResponseFormat(json_schema=text), **fields)


def check(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_schema_features_always_validate(stub) -> None:
    """Every schema feature llguidance compiles is enforced: each seed's output parses and validates (formats too)."""
    jobs = [(name, seed) for name in SCHEMAS for seed in range(SEEDS)]
    with ThreadPoolExecutor(16) as pool:  # concurrent: one batch, masks filled together
        results = list(pool.map(lambda job: run(stub, schema_request(SCHEMAS[job[0]], job[1])), jobs))
    for (name, seed), (text, _, summary) in zip(jobs, results, strict=True):
        assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP, (name, seed, text)
        check(SCHEMAS[name], text)
    # the nullable fields took more than one shape over the seeds (the sampling is not stuck on one branch)
    shapes = {
        json.dumps(sorted(json.loads(t).items()))[:40]
        for (n, _), (t, _, _) in zip(jobs, results, strict=True)
        if n == "nullable"
    }
    assert len(shapes) > 1


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "not": {"const": "a"}}, "not"),
        ({"type": "integer", "if": {"minimum": 3}, "then": {"multipleOf": 2}}, "if"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "format": "phone-number"}, "phone-number"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"$ref": "https://example.com/remote.json"}, "example.com"),
        (json.loads('{"type": "array", "items": ' * 200 + "{}" + "}" * 200), "recursion limit"),  # bounded: 128
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_it(stub, schema: dict, keyword: str) -> None:
    """A keyword the grammar cannot enforce is refused, naming it (a silently ignored `not` or `uniqueItems` would
    give output that fails the client's own validation), as vLLM's guidance backend and OpenAI's strict mode do."""
    found = invalid_argument(stub, schema_request(schema, 0))
    assert keyword in found["response_format.json_schema"], found


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": generation_pb2.ResponseFormat(json_schema=_deep(50_000))}, "response_format.json_schema"),
        (
            {"response_format": generation_pb2.ResponseFormat(json_schema='{"a":' * 5_000 + "1" + "}" * 5_000)},
            "response_format.json_schema",
        ),
        (
            {"tools": [generation_pb2.Tool(name="f", parameters_json_schema=_deep(50_000))]},
            "tools[0].parameters_json_schema",
        ),
    ],
)
def test_json_nested_too_deeply_is_invalid_argument(stub, server: ServerThread, fields: dict, field: str) -> None:
    """json.loads raises RecursionError (not JSONDecodeError) past ~1,000 levels: these were INTERNAL errors."""
    found = invalid_argument(stub, user_request("x", max_output_tokens=4, **fields))
    assert "nested too deeply" in found[field], found
    assert run(stub, user_request("still serving", max_output_tokens=2))[2].usage.output_tokens == 2
    assert server.wait_kv_free()[0] == server.wait_kv_free()[1]


def test_tool_call_arguments_nested_too_deeply_is_invalid_argument(stub) -> None:
    call = content_pb2.ToolCall(id="c1", name="f", arguments=_deep(50_000))
    request = generation_pb2.GenerateRequest(
        contents=[
            content_pb2.Content(role="user", parts=[content_pb2.Part(text="x")]),
            content_pb2.Content(role="assistant", tool_calls=[call]),
        ],
        tools=[generation_pb2.Tool(name="f")],
        max_output_tokens=4,
    )
    found = invalid_argument(stub, request)
    assert "nested too deeply" in found["contents[1].tool_calls[0].arguments"], found


def test_a_tiny_temperature_is_greedy(stub) -> None:
    """Temperatures below 1e-5 are greedy (vLLM's _SAMPLING_EPS). Sampled, 1e-40 overflowed logits / T to inf, the
    softmax gave NaNs and argmax drew a token the grammar forbids: INTERNAL for a JSON-schema request."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    greedy = run(
        stub, schema_request(schema, sampling=sampling_pb2.SamplingConfig(temperature=0.0), max_output_tokens=30)
    )
    for t in (1e-40, 1e-6):
        tiny = run(
            stub,
            schema_request(schema, sampling=sampling_pb2.SamplingConfig(temperature=t, seed=3), max_output_tokens=30),
        )
        assert tiny[0] == greedy[0], (t, tiny[0], greedy[0])
    plain = user_request("Hello", max_output_tokens=12)
    plain.sampling.temperature = 0.0
    expected = run(stub, plain)[0]
    plain.sampling.temperature = 1e-40
    assert run(stub, plain)[0] == expected


def test_top_k_minus_one_is_off(stub) -> None:
    """top_k = -1 means "no top-k" in vLLM and SGLang (their clients send it); it was INVALID_ARGUMENT."""

    def sample(top_k: int) -> str:
        sampling = sampling_pb2.SamplingConfig(temperature=1.0, seed=11, top_k=top_k)
        return run(stub, user_request("Hello there", sampling=sampling, max_output_tokens=24))[0]

    assert sample(-1) == sample(0)
    assert "sampling.top_k" in invalid_argument(stub, user_request("x", sampling=sampling_pb2.SamplingConfig(top_k=-2)))


def test_logprobs_are_of_the_processed_logits(stub, server: ServerThread) -> None:
    """The documented choice (README): logprobs after logit bias, the grammar mask and penalties, before temperature
    and top-k (vLLM returns the raw logits' by default). Checked against transformers' own logits for the prompt."""
    tok = server.engine().tokenizer
    prompt = tok.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    with torch.no_grad():
        raw = load_reference(server.checkpoint)(torch.tensor([prompt])).logits[0, -1].float()  # [V]
    bias = {int(raw.argsort()[-7]): 3.0}  # lifts the 7th most likely token into the top few
    processed = raw.clone()
    for t, b in bias.items():
        processed[t] += b
    seen = torch.tensor(sorted(set(prompt)))
    processed[seen] = torch.where(processed[seen] > 0, processed[seen] / 1.3, processed[seen] * 1.3)
    expected = processed.log_softmax(-1).topk(5)
    assert expected.indices.tolist() != raw.log_softmax(-1).topk(5).indices.tolist()  # raw ones would fail the test
    sampling = sampling_pb2.SamplingConfig(temperature=0.5, top_k=2, seed=1, repetition_penalty=1.3, logit_bias=bias)
    request = user_request("Hello", sampling=sampling, max_output_tokens=1, logprobs=True, top_logprobs=5)
    (lp,) = [lp for d in run(stub, request)[1] for lp in d.logprobs]
    assert [t.token_id for t in lp.top_logprobs] == expected.indices.tolist()
    assert torch.allclose(torch.tensor([t.logprob for t in lp.top_logprobs]), expected.values, atol=1e-4)
    assert lp.token_id in expected.indices[:2].tolist()  # drawn within top_k = 2 of the temperature-scaled logits
    # a grammar's forbidden tokens are -inf alternatives
    choices = generation_pb2.ResponseFormat(choices=generation_pb2.Choices(values=["yes", "no"]))
    request = user_request("Hello", response_format=choices, max_output_tokens=1, logprobs=True, top_logprobs=5)
    (lp,) = [lp for d in run(stub, request)[1] for lp in d.logprobs]
    assert [t.logprob for t in lp.top_logprobs][2:] == [float("-inf")] * 3


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": generation_pb2.ResponseFormat(regex="(((" + "a" * 5000)}, "response_format.regex"),
        (
            {"response_format": generation_pb2.ResponseFormat(lark_grammar="start: " + "東" * 5000)},
            "response_format.lark_grammar",
        ),
        (
            {
                "tools": [generation_pb2.Tool(name="f")],
                "tool_choice": generation_pb2.ToolChoice(function_name="ü" * 50_000),
            },
            "tool_choice.function_name",
        ),
        ({"tools": [generation_pb2.Tool(name=f"bad name {i}" + "é" * 100) for i in range(300)]}, "tools[0].name"),
    ],
    ids=["regex", "lark non-ASCII", "function name", "300 violations"],
)
def test_a_long_refusal_still_arrives(stub, fields: dict, field: str) -> None:
    """Errors that echo a long input are cut to fit the trailers: a client drops trailers past 8 KiB and saw
    RESOURCE_EXHAUSTED "Stream removed" instead of INVALID_ARGUMENT (a 5,000-character regex's error was 30 KB)."""
    found = invalid_argument(stub, user_request("x", max_output_tokens=2, **fields))
    assert field in found and len(found) <= 16, found.keys()


def test_a_long_unknown_model_name_is_not_found(stub) -> None:
    """NOT_FOUND echoes the model name twice (message and ResourceInfo): 100,000 characters became RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.RpcError) as info:
        run(stub, user_request("x", model="m" * 100_000, max_output_tokens=2))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        (generation_pb2.ResponseFormat(regex=r"[^\s\S]"), "response_format.regex"),
        (generation_pb2.ResponseFormat(lark_grammar="start: A\nA: /a+/ & /b+/"), "response_format.lark_grammar"),
    ],
)
def test_a_grammar_that_admits_nothing_is_invalid_argument(stub, server: ServerThread, fmt, field: str) -> None:
    """An empty language compiled, and failed at its first mask inside the engine: INTERNAL."""
    found = invalid_argument(stub, user_request("x", response_format=fmt, max_output_tokens=4))
    assert "admits no output" in found[field], found
    assert server.wait_kv_free()[0] == server.wait_kv_free()[1]


def test_openais_json_schema_wrapper_is_refused(stub) -> None:
    """OpenAI's response_format.json_schema object sent as the schema: a valid schema of unknown keywords, so any JSON
    value was served and the caller's schema went unused. Refused, saying which member to send."""
    inner = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    wrapper = {"name": "thing", "strict": True, "schema": inner}
    found = invalid_argument(stub, schema_request(wrapper, 0))
    assert '"schema" member' in found["response_format.json_schema"], found
    text = run(stub, schema_request(inner, 0, max_output_tokens=40))[0]
    jsonschema.validate(json.loads(text), inner)
    named = {"type": "object", "properties": {"schema": inner}, "required": ["schema"], "additionalProperties": False}
    check(named, run(stub, schema_request(named, 0))[0])  # a property named "schema" is no wrapper


@pytest.mark.parametrize("stop", ["🎉", "京は", "é d", "😀🎉 東", " done"])
def test_stop_strings_across_split_characters(stub, stop: str) -> None:
    """The output forced by a regex; its emoji and CJK characters are split across byte-level tokens, so these stop
    strings start and end inside tokens. Excluded by default, included with include_stop_sequence."""
    target = "ab 😀🎉 東京は日本 café done"
    for include in (False, True):
        request = user_request(
            "x",
            response_format=generation_pb2.ResponseFormat(regex=target),
            stop_sequences=[stop],
            include_stop_sequence=include,
            max_output_tokens=80,
        )
        text, _, summary = run(stub, request)
        assert text == target[: target.index(stop) + (len(stop) if include else 0)]
        assert summary.finish_reason == generation_pb2.FINISH_REASON_STOP
