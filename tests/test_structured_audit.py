"""Structured output, tool calls and sampling with the cases users of vLLM / SGLang / OpenAI-style APIs bring: schema
features beyond the first few ($ref, recursion, anyOf/oneOf/allOf, enum/const of mixed types, formats, bounds,
nullable types, unicode names), what llguidance cannot enforce (refused, naming the keyword, as vLLM's guidance
backend and OpenAI's strict mode refuse), hostile nesting, and the sampler's edge values. One tiny random model behind
a real gRPC server; every output is checked with the `jsonschema` package."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch
from checkpoints import load_reference, make_checkpoint
from google.rpc import error_details_pb2
from service_harness import ServerThread, user_request

from omnivox.services import tool_parser
from omnivox.services.errors import status_details
from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.services.tools import plan, prompt_ids
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
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=2048)
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.02, max_num_seqs=64)) as srv:
        srv.checkpoint = ckpt
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def run(stub, request: generation_pb2.GenerateRequest) -> tuple[str, list, generation_pb2.GenerateSummary]:
    """(text, deltas, summary) of one Generate call."""
    text, deltas, summary = "", [], None
    for response in stub.Generate(request, timeout=60):
        if response.WhichOneof("response") == "delta":
            text += response.delta.text
            deltas.append(response.delta)
        else:
            summary = response.summary
    assert summary is not None
    return text, deltas, summary


def violations(stub, request: generation_pb2.GenerateRequest) -> dict[str, str]:
    with pytest.raises(grpc.RpcError) as info:
        run(stub, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    out = {}
    for detail in status_details(info.value):
        if isinstance(detail, error_details_pb2.BadRequest):
            out.update({v.field: v.description for v in detail.field_violations})
    return out


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
    # the nullable fields and the open object took more than one shape over the seeds (the sampling is not stuck)
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
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_it(stub, schema: dict, keyword: str) -> None:
    """A keyword the grammar cannot enforce is refused, naming it (a silently ignored `not` or `uniqueItems` would
    give output that fails the client's own validation), as vLLM's guidance backend and OpenAI's strict mode do."""
    found = violations(stub, schema_request(schema, 0))
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
    found = violations(stub, user_request("x", max_output_tokens=4, **fields))
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
    found = violations(stub, request)
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
    assert "sampling.top_k" in violations(stub, user_request("x", sampling=sampling_pb2.SamplingConfig(top_k=-2)))


# A pydantic-style tool schema: nested models under $defs, a self-reference, nullable and enum fields.
WEATHER = {
    "$defs": {
        "Unit": {"enum": ["c", "f"], "type": "string"},
        "Place": {
            "type": "object",
            "properties": {"city": S, "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}},
            "required": ["city", "near"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "place": {"$ref": "#/$defs/Place"},
        "unit": {"$ref": "#/$defs/Unit"},
        "days": {"type": ["integer", "null"], "minimum": 1, "maximum": 7},
    },
    "required": ["place", "unit", "days"],
    "additionalProperties": False,
}
# A root self-reference ("#" is the parameters object itself).
TREE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}


def tool_calls_request(tools: list[generation_pb2.Tool], seed: int, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("tool_choice", generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED))
    fields.setdefault("max_output_tokens", MAX_TOKENS)
    sampling = sampling_pb2.SamplingConfig(temperature=1.0, seed=seed)
    return user_request("What is the weather in Paris?", tools=tools, sampling=sampling, **fields)


@pytest.mark.parametrize("both", [False, True], ids=["one tool", "two tools"])
def test_tool_parameters_with_refs_validate(stub, both: bool) -> None:
    """Local $refs in a tool's parameters ($defs, "#") resolve within the parameters: they were resolved against the
    call object the grammar wraps them in, and every such tool was refused ("Pointer '/$defs/Place' does not
    exist"). With two tools the call schema is an anyOf: the refs rebase to each branch."""
    tools = [generation_pb2.Tool(name="weather", strict=True, parameters_json_schema=json.dumps(WEATHER))]
    if both:
        tools.append(generation_pb2.Tool(name="tree", strict=True, parameters_json_schema=json.dumps(TREE)))
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda s: run(stub, tool_calls_request(tools, s, parallel_tool_calls=False, max_output_tokens=400)),
                range(6),
            )
        )
    names = set()
    for text, _, summary in results:
        assert summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS, (text, summary)
        (call,) = summary.tool_calls
        names.add(call.name)
        jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "weather" else TREE)
    assert names == ({"weather", "tree"} if both else {"weather"})


def test_a_tool_call_cut_by_max_tokens(stub) -> None:
    """max_output_tokens inside a call's JSON: LENGTH (not TOOL_CALLS), the summary holds only the calls that were
    completed, and what was streamed of the cut call is a prefix of JSON (as OpenAI streams it)."""
    tools = [generation_pb2.Tool(name="weather", strict=True, parameters_json_schema=json.dumps(WEATHER))]
    text, deltas, summary = run(stub, tool_calls_request(tools, 0, max_output_tokens=45))
    assert summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH and not summary.tool_calls
    streamed = [d for delta in deltas for d in delta.tool_calls]
    assert text == "" and streamed and streamed[0].name == "weather"
    assert "".join(d.arguments for d in streamed).startswith("{")


def test_a_tool_schema_nested_too_deeply_names_the_tool(stub) -> None:
    deep: dict = {"type": "object"}
    for _ in range(300):  # parses (json.loads goes to ~1,000), but deeper than the grammar compiler takes
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [generation_pb2.Tool(name="ok"), generation_pb2.Tool(name="deep", parameters_json_schema=json.dumps(deep))]
    found = violations(stub, tool_calls_request(tools, 0))
    assert "nested deeper" in found["tools[1].parameters_json_schema"], found


def test_a_llama3_call_nested_past_the_recursion_limit_parses() -> None:
    """Llama 3 calls end where their JSON does: json.loads raised RecursionError out of the stream for arguments
    nested ~1,000 deep (a non-strict tool's arguments are any object, and a model may write that)."""
    args = '{"a": ' + "[" * 3000 + '"]}"' + "]" * 3000 + "}"
    text = '{"name": "f", "parameters": ' + args + "}"
    stream = tool_parser.ToolCallStream(tool_parser.LLAMA3)
    streamed = "".join(d.arguments for k in range(0, len(text), 997) for d in stream.update(text[: k + 997])[1])
    (call,) = stream.complete_calls(text)
    assert call.name == "f" and call.arguments == args == streamed
    assert not tool_parser.parse(text[:-2], tool_parser.LLAMA3)[1][0].complete


def test_an_unenforceable_tool_schema_names_the_tool(stub) -> None:
    """A strict tool whose schema llguidance cannot enforce is refused naming that tool's schema and the keyword (the
    error named only "tools" and printed the whole call grammar); a non-strict one is not compiled, so it passes."""
    bad = json.dumps({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})
    tools = [
        generation_pb2.Tool(name="ok", strict=True),
        generation_pb2.Tool(name="bad", strict=True, parameters_json_schema=bad),
    ]
    found = violations(stub, tool_calls_request(tools, 0))
    assert "uniqueItems" in found["tools[1].parameters_json_schema"], found
    tools[1].strict = False
    assert run(stub, tool_calls_request(tools, 0, max_output_tokens=4))[2].usage.output_tokens == 4


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


def test_tools_in_the_text_as_qwen_writes_them(stub, server: ServerThread) -> None:
    """For a template that ignores tools (the embedded SmolLM2's), the tools, calls and results are written as
    Qwen2.5's template writes them: non-ASCII kept (its tojson; json.dumps escaped "東京" to "\\u6771\\u4eac") and
    consecutive tool results in one user turn (they were one turn each)."""
    tool = generation_pb2.Tool(name="weather", description="東京の天気", parameters_json_schema='{"type": "object"}')
    calls = [
        content_pb2.ToolCall(id="c1", name="weather", arguments='{"city": "東京"}'),
        content_pb2.ToolCall(id="c2", name="weather", arguments='{"city": "Zürich"}'),
    ]
    request = user_request("Weather?", tools=[tool], max_output_tokens=1)
    request.contents.add(role="assistant", tool_calls=calls)
    for call_id, result in (("c1", "晴れ"), ("c2", "Schnee")):
        request.contents.add(role="tool", tool_call_id=call_id, parts=[content_pb2.Part(text=result)])
    fn = '{"type": "function", "function": {"name": "weather", "description": "東京の天気", "parameters": {"type": "object"}}}'
    expected = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + fn + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n晴れ\n</tool_response>\n<tool_response>\nSchnee\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = server.engine().tokenizer
    ids = tok.encode(expected, add_special_tokens=False)
    assert tok.decode(prompt_ids(tok, request.contents, plan(request, tok))) == expected
    assert run(stub, request)[2].usage.prompt_tokens == len(ids)  # the served prompt
