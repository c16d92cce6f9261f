"""Tool calls (issue 12): chunking-independent parsing, and over a real gRPC server on a tiny random model with a
Hermes-style chat template: `required` always yields a valid call, `none` never does, a tool round trip renders."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import transformers
from support.checkpoints import make_checkpoint
from support.grpc_errors import violation_descriptions
from support.service_harness import ServerThread, user_request
from support.tool_calls import SCHEMAS, TIME, TOOLS, feed, run

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import tool_grammar, tools
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>{% endfor %}'
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CANNED_HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {x}", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
)
CANNED_LLAMA = (
    '{"name": "get_weather", "parameters": {"city": "a; b}", "unit": "f"}}; {"name": "get_time", "parameters": {}}'
)


@pytest.mark.parametrize(("fmt", "text"), [(tools.HERMES, CANNED_HERMES), (tools.LLAMA3, CANNED_LLAMA)])
def test_parsing_is_chunking_independent(fmt, text) -> None:
    per_char, per_seven = feed(fmt, text, 1), feed(fmt, text, 7)
    assert per_char == per_seven
    content, streamed, done = per_char
    assert [streamed[i] for i in sorted(streamed)] == done  # deltas add up to the complete calls
    assert [json.loads(a) for _, a in done] and all(isinstance(json.loads(a), dict) for _, a in done)
    if fmt is tools.HERMES:
        assert content == "Let me check. "
        assert done[0] == ("get_weather", '{"city": "Paris {x}", "unit": "c"}')
    else:
        assert done == [("get_weather", '{"city": "a; b}", "unit": "f"}'), ("get_time", "{}")]


def test_llama3_grammar_with_python_tag(tmp_path) -> None:
    """Llama 3 JSON calls, with or without the <|python_tag|> special token first; auto lets plain text through,
    none refuses a leading call, required refuses text."""
    import llguidance
    import llguidance.hf

    ckpt = make_checkpoint(tmp_path / "t", family="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    tag = tok.convert_tokens_to_ids("<|python_tag|>")
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    calls = [tool_grammar.call_schema(tools.LLAMA3, "get_time", TIME, True)]
    call_text = '{"name": "get_time", "parameters": {"zone": 3}}'

    def accepts(mode: str, ids: list[int]) -> bool:
        grammar = tool_grammar.grammar(tools.LLAMA3, calls, mode, parallel=True, python_tag=True)
        m = llguidance.LLMatcher(llg, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(ids) and m.is_accepting()

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    for mode in (tools.REQUIRED, tools.AUTO):
        assert accepts(mode, [tag, *ids(call_text)]) and accepts(mode, ids(call_text + "; " + call_text))
    assert accepts(tools.AUTO, ids("It is noon {roughly}.")) and not accepts(tools.REQUIRED, ids("It is noon."))
    assert accepts(tools.NONE, ids("It is noon {roughly}.")) and not accepts(tools.NONE, ids(call_text))
    assert not accepts(tools.NONE, [tag, *ids(call_text)])


def test_hermes_grammar_with_added_tag_tokens(tmp_path) -> None:
    """Qwen2.5 / Qwen3 tokenizers carry `<tool_call>` and `</tool_call>` as added tokens, which llguidance takes for
    special ones: the grammar names them by id. Before, a required call's first mask allowed only `<tool_call>` and
    the grammar then refused it (INTERNAL on every required or named call of a real Qwen checkpoint)."""
    import llguidance
    import llguidance.hf

    ckpt = make_checkpoint(tmp_path / "t", family="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    assert tok.convert_tokens_to_ids("<tool_call>") in tok.encode(call, add_special_tokens=False)

    def accepts(mode: str, text: str) -> bool:
        grammar = tool_grammar.grammar(
            tools.HERMES,
            [tool_grammar.call_schema(tools.HERMES, "get_time", TIME, True)],
            mode,
            True,
            added=tok.get_added_vocab(),
        )
        m = llguidance.LLMatcher(llg, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts(tools.REQUIRED, call) and accepts(tools.REQUIRED, call + "\n" + call)
    assert (
        accepts(tools.AUTO, "Let me see. " + call) and accepts(tools.AUTO, "It is noon.") and accepts(tools.AUTO, call)
    )
    assert not accepts(tools.REQUIRED, "It is noon.") and not accepts(tools.NONE, call)


@pytest.mark.parametrize("mode", [tools.REQUIRED, tools.AUTO])
def test_parallel_calls_are_bounded(tmp_path, mode) -> None:
    """At most MAX_PARALLEL_CALLS calls, then only the end: unbounded, the embedded SmolLM2 at temperature 0 repeated
    one call for 8,000 tokens on the README's tool_choice required example."""
    import llguidance
    import llguidance.hf

    ckpt = make_checkpoint(tmp_path / "t", family="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar = tool_grammar.grammar(
        tools.HERMES, [tool_grammar.call_schema(tools.HERMES, "get_time", TIME, True)], mode, True
    )
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'

    def accepts(n: int) -> bool:
        m = llguidance.LLMatcher(llg, grammar, log_level=0)
        text = tools.HERMES.separator.join([call] * n)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts(1) and accepts(tool_grammar.MAX_PARALLEL_CALLS) and not accepts(tool_grammar.MAX_PARALLEL_CALLS + 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tools", family="qwen2", max_position_embeddings=2048)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(ckpt)
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.02)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def tool_request(seed: int, choice: generation_pb2.ToolChoice, **fields) -> generation_pb2.GenerateRequest:
    return user_request(
        "What is the weather in Paris?",
        tools=TOOLS,
        tool_choice=choice,
        sampling=sampling_pb2.SamplingConfig(temperature=1.0, seed=seed),
        max_output_tokens=fields.pop("max_output_tokens", 120),
        **fields,
    )


@pytest.mark.parametrize("parallel", [False, True])
def test_required_always_calls_validly(stub, parallel: bool) -> None:
    """One call (parallel off) ends with TOOL_CALLS; with parallel calls the random model may keep calling until
    max_output_tokens (LENGTH), and every call it completed is valid."""
    choice = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: run(stub, tool_request(s, choice, parallel_tool_calls=parallel)), range(20)))
    for text, streamed, summary in results:
        if not parallel:
            assert summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS, (text, summary)
            assert len(summary.tool_calls) == 1
        assert summary.tool_calls and text == ""
        for i, call in enumerate(summary.tool_calls):
            assert streamed[i] == [call.id, call.name, call.arguments]  # deltas add up to the summary's calls
            assert call.id.startswith("call_")
            args = json.loads(call.arguments)
            assert set(SCHEMAS[call.name]["required"]) <= args.keys()
            if call.name == "get_weather":
                assert args["unit"] in ("c", "f") and len(args["city"]) <= 12


def test_named_function_and_no_parallel(stub) -> None:
    choice = generation_pb2.ToolChoice(function_name="get_time")
    for seed in range(5):
        _, _, summary = run(stub, tool_request(seed, choice, parallel_tool_calls=False))
        assert [c.name for c in summary.tool_calls] == ["get_time"]
        assert isinstance(json.loads(summary.tool_calls[0].arguments)["zone"], int)


def test_none_never_calls(stub) -> None:
    choice = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
    for seed in range(10):
        text, streamed, summary = run(stub, tool_request(seed, choice, max_output_tokens=60))
        assert not summary.tool_calls and not streamed and "<tool_call>" not in text
        assert summary.finish_reason != generation_pb2.FINISH_REASON_TOOL_CALLS


def test_auto_calls_are_valid_when_made(stub) -> None:
    for seed in range(6):
        text, streamed, summary = run(stub, tool_request(seed, generation_pb2.ToolChoice(), max_output_tokens=80))
        assert "<tool_call>" not in text  # content never shows the tag: what follows it is a call
        for call in summary.tool_calls:
            json.loads(call.arguments)


def test_tool_round_trip_renders(stub, server: ServerThread) -> None:
    """An assistant turn with a call and the tool's result go through the model's template (prompt length checked)."""
    call = content_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris", "unit": "c"}')
    request = user_request("What is the weather in Paris?", tools=TOOLS, max_output_tokens=4)
    request.sampling.temperature = 0.0
    request.contents.append(content_pb2.Content(role="assistant", tool_calls=[call]))
    request.contents.append(
        content_pb2.Content(role="tool", tool_call_id="call_1", parts=[content_pb2.Part(text='{"temp": 21}')])
    )
    _, _, summary = run(stub, request)
    tok = server.engine("tiny").tokenizer
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    specs = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": json.loads(t.parameters_json_schema),
            },
        }
        for t in TOOLS
    ]
    rendered = tok.apply_chat_template(messages, tools=specs, tokenize=False, add_generation_prompt=True)
    assert '<tool_response>\n{"temp": 21}' in rendered and '"city": "Paris"' in rendered
    assert summary.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_bad_tools_are_invalid_argument(stub) -> None:
    request = user_request(
        "hi",
        tools=[
            generation_pb2.Tool(name="bad name!"),
            generation_pb2.Tool(name="ok", parameters_json_schema="{oops"),
            generation_pb2.Tool(name="listy", parameters_json_schema='{"type": "array", "items": {}}'),
        ],
        tool_choice=generation_pb2.ToolChoice(function_name="missing"),
    )
    request.contents.append(content_pb2.Content(role="tool", parts=[content_pb2.Part(text="x")]))
    with pytest.raises(grpc.RpcError) as info:
        run(stub, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = violation_descriptions(info.value)
    assert {
        "tools[0].name",
        "tools[1].parameters_json_schema",
        "tools[2].parameters_json_schema",
        "tool_choice.function_name",
        "contents[1].tool_call_id",
    } <= found.keys(), found
    assert "an object schema" in found["tools[2].parameters_json_schema"]  # OpenAI's rule: arguments are an object


def test_a_template_without_tools_gets_them_in_the_text(tmp_path) -> None:
    """A chat template that ignores `tools` (the embedded SmolLM2's plain ChatML) still shows the model the tools,
    its earlier calls and their results (before: the prompt was the same as without tools)."""
    ckpt = make_checkpoint(tmp_path / "t", family="qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert "tools" not in tok.chat_template
    call = content_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    request = user_request("Weather in Paris?", tools=TOOLS)
    request.contents.append(content_pb2.Content(role="assistant", tool_calls=[call]))
    request.contents.append(
        content_pb2.Content(role="tool", tool_call_id="call_1", parts=[content_pb2.Part(text='{"temp": 21}')])
    )
    text = tok.decode(tools.prompt_ids(tok, request.contents, tools.plan(request, tok)))
    assert text.count('"name": "get_weather"') == 2 and '"name": "get_time"' in text  # both tools, and the call
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text and "<tools>" in text
    plain = user_request("Weather in Paris?")
    assert "<tools>" not in tok.decode(
        tools.prompt_ids(tok, plain.contents, tools.ToolPlan([], "none", True, tools.HERMES))
    )
