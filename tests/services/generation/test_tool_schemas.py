"""Tool calls with the schemas and clients users bring: pydantic-style parameters ($defs, self references), strict
schemas the grammar cannot enforce, calls cut by max_output_tokens, calls nested past Python's recursion limit, and the
prompt a template without tools gets (as Qwen2.5's template writes it). One tiny random model behind a real gRPC
server; every call's arguments are checked with the `jsonschema` package."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from support.service_harness import ServerThread, user_request
from support.tiny_chat_server import invalid_argument, run, tiny_server

from omnivox.services.output import tool_parser
from omnivox.services.processing.tools import plan, prompt_ids
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

MAX_TOKENS = 200
S = {"type": "string", "maxLength": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with tiny_server(tmp_path_factory.mktemp("ckpt")) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


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


# The same under an $id: its "#..." refs resolve against that resource, so they must not be rebased.
WEATHER_WITH_ID = {"$id": "https://example.com/weather.json", **WEATHER}


@pytest.mark.parametrize(
    "schemas",
    [{"weather": WEATHER}, {"weather": WEATHER, "tree": TREE}, {"weather": WEATHER_WITH_ID}],
    ids=["one tool", "two tools", "$id"],
)
def test_tool_parameters_with_refs_validate(stub, schemas: dict[str, dict]) -> None:
    """Local $refs in a tool's parameters ($defs, "#") resolve within the parameters: they were resolved against the
    call object the grammar wraps them in, and every such tool was refused ("Pointer '/$defs/Place' does not
    exist"). With two tools the call schema is an anyOf: the refs rebase to each branch."""
    tools = [generation_pb2.Tool(name=n, strict=True, parameters_json_schema=json.dumps(p)) for n, p in schemas.items()]
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
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert names == schemas.keys()


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
    found = invalid_argument(stub, tool_calls_request(tools, 0))
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
    found = invalid_argument(stub, tool_calls_request(tools, 0))
    assert "uniqueItems" in found["tools[1].parameters_json_schema"], found
    tools[1].strict = False
    assert run(stub, tool_calls_request(tools, 0, max_output_tokens=4))[2].usage.output_tokens == 4


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


def test_ignore_eos_with_tool_calls_is_invalid_argument(stub) -> None:
    """As with response_format: a finished call admits only end-of-sequence, so with ignore_eos the output was the
    call and then end-of-sequence tokens until max_output_tokens (LENGTH). With tool_choice NONE it is plain text."""
    tools = [generation_pb2.Tool(name="weather", strict=True, parameters_json_schema=json.dumps(WEATHER))]
    found = invalid_argument(stub, tool_calls_request(tools, 0, ignore_eos=True))
    assert "ignore_eos" in found, found
    none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
    summary = run(stub, tool_calls_request(tools, 0, ignore_eos=True, tool_choice=none, max_output_tokens=8))[2]
    assert summary.usage.output_tokens == 8


def test_arguments_holding_the_call_tags(stub) -> None:
    """A call ends where its JSON object ends, not at the first "</tool_call>" in the text: arguments that hold the
    tags (a tool that writes about tool calls) lost the call (no summary call, finish_reason STOP)."""
    text = "use <tool_call> and </tool_call> tags"
    schema = {
        "type": "object",
        "properties": {"text": {"const": text}},
        "required": ["text"],
        "additionalProperties": False,
    }
    tools = [generation_pb2.Tool(name="write", strict=True, parameters_json_schema=json.dumps(schema))]
    _, deltas, summary = run(stub, tool_calls_request(tools, 0, parallel_tool_calls=False))
    assert summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS, summary
    (call,) = summary.tool_calls
    assert call.name == "write" and json.loads(call.arguments) == {"text": text}
    assert "".join(d.arguments for delta in deltas for d in delta.tool_calls) == call.arguments
    # two such calls, the text arriving one character at a time: the same calls, streamed as they complete
    one = '<tool_call>\n{"name": "write", "arguments": ' + call.arguments + "}\n</tool_call>"
    output = one + "\n" + one
    stream = tool_parser.ToolCallStream(tool_parser.HERMES)
    streamed = [d for k in range(len(output)) for d in stream.update(output[: k + 1])[1]]
    assert [c.arguments for c in stream.complete_calls(output)] == [call.arguments] * 2
    for i in (0, 1):
        assert "".join(d.arguments for d in streamed if d.index == i) == call.arguments


def test_a_follow_up_without_the_tools_keeps_the_call_and_its_result(stub, server: ServerThread) -> None:
    """The turn after a tool's result, sent without `tools` (the call is over): for a template that ignores tools,
    the call and its result are still written in as Qwen2.5 writes them. The call was dropped (an empty assistant
    turn) and the result showed as a "tool" role turn the model never saw in training."""
    call = content_pb2.ToolCall(id="c1", name="weather", arguments='{"city": "Paris"}')
    request = user_request("Weather?", max_output_tokens=1)
    request.contents.add(role="assistant", tool_calls=[call])
    request.contents.add(role="tool", tool_call_id="c1", parts=[content_pb2.Part(text="21 C")])
    expected = (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    tok = server.engine().tokenizer
    assert tok.decode(prompt_ids(tok, request.contents, plan(request, tok))) == expected
    assert run(stub, request)[2].usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))


def test_openais_function_object_as_the_schema_is_refused(stub) -> None:
    """OpenAI's function object sent as parameters_json_schema: a valid schema of unknown keywords, so a strict call's
    arguments could be any JSON value (a number, a list) and the real schema went unused."""
    function = {"name": "weather", "description": "d", "parameters": WEATHER}
    tools = [generation_pb2.Tool(name="weather", strict=True, parameters_json_schema=json.dumps(function))]
    found = invalid_argument(stub, tool_calls_request(tools, 0))
    assert '"parameters" member' in found["tools[0].parameters_json_schema"], found
