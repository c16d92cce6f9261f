"""Mistral v0.3 tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` after a special token, call ids of 9
alphanumerics (the only ids its chat template takes back), and the round trip through that template, over a real
gRPC server on a tiny random Mistral checkpoint whose tokenizer carries the v0.3 control tokens and chat template.

Before: a Mistral template fell back to Hermes (`<tool_call>` grammar, never what the model writes) and the ids
(`call_` + 24 hex) made the template raise on the follow-up turn: 'cannot build the prompt'."""

from __future__ import annotations

import json
import re

import grpc
import pytest
import transformers
from support.checkpoints import make_checkpoint
from support.grpc_errors import violation_descriptions
from support.service_harness import ServerThread, user_request
from support.tool_calls import SCHEMAS, TOOLS, feed, run

from omnivox.services.output import tool_parser
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import tool_grammar, tools
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

# Mistral-7B-Instruct-v0.3's tokenizer_config.json chat_template, shortened where it only checks role order: tools
# before the last user turn, calls written back as `[TOOL_CALLS] [` + each function's JSON with its id, results as
# `[TOOL_RESULTS] {"content": ..., "call_id": ...}`, and the same raise on an id that is not 9 characters long.
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == user_messages[-1]) %}{{- '[AVAILABLE_TOOLS] [' }}"
    '{%- for tool in tools %}{%- set tool = tool.function %}{{- \'{"type": "function", "function": {\' }}'
    "{%- for key, val in tool.items() if key != 'return' %}"
    "{%- if val is string %}{{- '\"' + key + '\": \"' + val + '\"' }}"
    "{%- else %}{{- '\"' + key + '\": ' + val|tojson }}{%- endif %}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '}}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' }}{%- endif %}{%- endfor %}"
    "{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token}}"
    "{%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}"
    "{%- if message.content is defined and message.content.content is defined %}"
    "{%- set content = message.content.content %}{%- else %}{%- set content = message.content %}{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + content|string + ', ' }}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)
# v0.3's control tokens (ids 3-10 there), special: skipped when decoding as usual
CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]
CONTROL += ["[/TOOL_RESULTS]"]
ID = re.compile(r"^[a-zA-Z0-9]{9}$")
CANNED = (
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "a, b]}", "unit": "c"}}, '
    '{"name": "get_time", "arguments": {"zone": 2}}]'
)


def test_parsing_is_chunking_independent() -> None:
    """Content before the tag, a `, ]}` inside an argument string, two calls; deltas add up to the complete calls."""
    per_char, per_seven = feed(tools.MISTRAL, CANNED, 1), feed(tools.MISTRAL, CANNED, 7)
    assert per_char[0] == per_seven[0] == "Sure. " and per_char[2] == per_seven[2]
    content, streamed, done = per_char
    assert done == [("get_weather", '{"city": "a, b]}", "unit": "c"}'), ("get_time", '{"zone": 2}')]
    assert [streamed[i] for i in sorted(streamed)] == done
    # a call is complete only once the list goes on or closes: `}` alone may still close the arguments
    _, calls = tool_parser.parse(CANNED[: CANNED.index("}}, ") + 2], tools.MISTRAL)
    assert not calls[0].complete
    stream = tool_parser.ToolCallStream(tools.MISTRAL)
    stream.update(CANNED, final=True)
    assert all(ID.match(i) for i in stream.ids) and len(set(stream.ids)) == 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    ckpt = make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-mistral", family="mistral", max_position_embeddings=2048
    )
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.add_special_tokens({"additional_special_tokens": CONTROL})
    tok.chat_template = MISTRAL_V03_TEMPLATE
    tok.save_pretrained(ckpt)
    with ServerThread([ModelSpec(path=ckpt, name="tiny")], EngineOptions(kv_cache_gib=0.02)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def ask(seed: int, mode: int, **fields) -> generation_pb2.GenerateRequest:
    return user_request(
        "What is the weather in Paris?",
        tools=TOOLS,
        tool_choice=generation_pb2.ToolChoice(mode=mode),
        sampling=sampling_pb2.SamplingConfig(temperature=1.0, seed=seed),
        max_output_tokens=fields.pop("max_output_tokens", 100),
        **fields,
    )


def test_required_calls_in_mistral_format_and_round_trip(stub, server: ServerThread) -> None:
    """The calls are Mistral's (the tag kept out of the content), valid, with 9-alphanumeric ids; sent back with the
    tool's result they render through the v0.3 template, whose raise on other ids used to refuse the follow-up."""
    tok = server.engine("tiny").tokenizer
    assert tools.format_of(tok) is tools.MISTRAL
    results = [run(stub, ask(seed, generation_pb2.TOOL_CHOICE_MODE_REQUIRED)) for seed in range(4)]
    for text, streamed, summary in results:
        assert text == "" and summary.tool_calls, (text, summary)
        for i, call in enumerate(summary.tool_calls):
            assert streamed[i] == [call.id, call.name, call.arguments] and ID.match(call.id)
            assert set(SCHEMAS[call.name]["required"]) <= json.loads(call.arguments).keys()
    one = next(s for _, _, s in results if s.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS)
    follow = user_request("What is the weather in Paris?", tools=TOOLS, max_output_tokens=3)
    follow.contents.append(content_pb2.Content(role="assistant", tool_calls=one.tool_calls))
    for call in one.tool_calls:
        result = content_pb2.Content(role="tool", tool_call_id=call.id, parts=[content_pb2.Part(text='{"t": 21}')])
        follow.contents.append(result)
    _, _, summary = run(stub, follow)
    rendered = tok.decode(tools.prompt_ids(tok, follow.contents, tools.plan(follow, tok)))
    assert f'"call_id": "{one.tool_calls[0].id}"}}[/TOOL_RESULTS]' in rendered
    assert f'[TOOL_CALLS] [{{"name": "{one.tool_calls[0].name}", "arguments": {{' in rendered
    assert summary.usage.prompt_tokens == len(tools.prompt_ids(tok, follow.contents, tools.plan(follow, tok)))


def test_auto_and_none(stub) -> None:
    """auto: a call, when made, is valid and its tag never shows in the content; none: never a call."""
    for seed in range(3):
        text, _, summary = run(stub, ask(seed, generation_pb2.TOOL_CHOICE_MODE_AUTO, max_output_tokens=40))
        assert "[TOOL_CALLS]" not in text and all(ID.match(c.id) for c in summary.tool_calls)
        for call in summary.tool_calls:
            json.loads(call.arguments)
        text, streamed, summary = run(stub, ask(seed, generation_pb2.TOOL_CHOICE_MODE_NONE, max_output_tokens=30))
        assert not summary.tool_calls and not streamed and "[TOOL_CALLS]" not in text


def test_ids_the_template_refuses_are_invalid_argument(stub) -> None:
    """An id another server made (`call_1`) names its field, not 'cannot build the prompt'; the server serves on."""
    request = user_request("Weather?", tools=TOOLS)
    call = content_pb2.ToolCall(id="call_1", name="get_time", arguments='{"zone": 1}')
    request.contents.append(content_pb2.Content(role="assistant", tool_calls=[call]))
    request.contents.append(content_pb2.Content(role="tool", tool_call_id="call_1", parts=[content_pb2.Part(text="1")]))
    with pytest.raises(grpc.RpcError) as info:
        run(stub, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"contents[1].tool_calls[0].id", "contents[2].tool_call_id"} <= violation_descriptions(info.value).keys()
    assert run(stub, user_request("hi", max_output_tokens=2))[2].usage.output_tokens >= 1


def test_mistral_nemo_writes_the_list_without_a_space(server: ServerThread) -> None:
    """Mistral-Nemo's template writes `[TOOL_CALLS][`: the grammar opens the list the same way (what the model saw)."""
    import llguidance
    import llguidance.hf

    tok = server.engine("tiny").tokenizer
    nemo = MISTRAL_V03_TEMPLATE.replace("'[TOOL_CALLS] ['", "'[TOOL_CALLS]['")
    assert tools.format_of(type("T", (), {"chat_template": nemo})()) is tools.MISTRAL_NEMO
    assert tools.format_of(tok) is tools.MISTRAL
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    call = '{"name": "get_time", "arguments": {"zone": 3}}'

    def accepts(fmt: tool_parser.ToolFormat, text: str) -> bool:
        schema = tool_grammar.call_schema(fmt, "get_time", SCHEMAS["get_time"], True)
        grammar = tool_grammar.grammar(fmt, [schema], tools.REQUIRED, True, added=tool_grammar.added_tokens(tok))
        m = llguidance.LLMatcher(llg, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts(tools.MISTRAL_NEMO, f"[TOOL_CALLS][{call}, {call}]")
    assert not accepts(tools.MISTRAL_NEMO, f"[TOOL_CALLS] [{call}]") and accepts(
        tools.MISTRAL, f"[TOOL_CALLS] [{call}]"
    )
    assert feed(tools.MISTRAL_NEMO, f"[TOOL_CALLS][{call}]", 1)[2] == [("get_time", '{"zone": 3}')]
