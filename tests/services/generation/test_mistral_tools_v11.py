"""Mistral tokenizer v11+ tool calls (Mistral Small 3.2, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per
call, three special tokens, no JSON list; and Magistral's (v13) thinking between the special tokens `[THINK]` and
`[/THINK]` as reasoning_text. Over a real gRPC server on tiny random Mistral checkpoints shipped as Mistral ships
these models: a tekken.json tokenizer (v11, v13 with think tokens) and no chat template, so mistral_common writes the
prompts, the tools and the calls and results sent back.

Before: such a folder got Hermes (`<tool_call>`, never what the model writes, its tools written into the text as
Qwen's template writes them) and its turns joined by newlines; an HF template writing `[ARGS]` got v0.3's
`[TOOL_CALLS] [{...}]` grammar; `[THINK]` (dropped by decoding) left the thinking in the answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers
from support.checkpoints import make_checkpoint, make_tokenizer
from support.service_harness import ServerThread, user_request
from support.tool_calls import SCHEMAS, TOOLS, feed, run
from support.voxtral_checkpoint import write_tekken

from omnivox.services.output import tool_parser
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import reasoning, tool_grammar, tools
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

ID = re.compile(r"^[a-zA-Z0-9]{9}$")
TOOL_CALLS, ARGS, THINK, END_THINK = 9, 32, 34, 35  # ranks in the tiny tekken.json (Magistral's for the think tags)
CANNED = (
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "a[TOOL_CALLS]b}", "unit": "c"}'
    '[TOOL_CALLS]get_time[CALL_ID]abcdEFG12[ARGS]{"zone": 2}'
)


def _tekken_folder(path: Path, version: str) -> Path:
    """A tiny Mistral decoder with only a tekken.json of `version` (no audio section; `[THINK]` / `[/THINK]` at
    ranks 34 / 35 for v13), as the hub's Mistral Small 3.2 / Magistral folders ship their tokenizer."""
    tmp = path.parent / f"{path.name}-tekken.json"
    vocab_size = write_tekken(tmp)
    data = json.loads(tmp.read_text())
    data["config"]["version"] = version
    del data["audio"]
    if version >= "v13":
        data["special_tokens"][THINK]["token_str"] = "[THINK]"
        data["special_tokens"][END_THINK]["token_str"] = "[/THINK]"
    make_checkpoint(path, family="mistral", with_tokenizer=False, vocab_size=vocab_size, max_position_embeddings=2048)
    (path / "tekken.json").write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ckpt")
    specs = [
        ModelSpec(path=_tekken_folder(root / "small", "v11"), name="small"),
        ModelSpec(path=_tekken_folder(root / "magistral", "v13"), name="magistral"),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def ask(model: str, seed: int, choice: generation_pb2.ToolChoice, **fields) -> generation_pb2.GenerateRequest:
    return user_request(
        "What is the weather in Paris?",
        model=model,
        tools=TOOLS,
        tool_choice=choice,
        sampling=fields.pop("sampling", sampling_pb2.SamplingConfig(temperature=1.0, seed=seed)),
        max_output_tokens=fields.pop("max_output_tokens", 80),
        **fields,
    )


REQUIRED = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED)


def test_parsing_is_chunking_independent() -> None:
    """Content before the first tag, a tag inside an argument string, v11's `[CALL_ID]` taken as the call's id; the
    deltas add up to the complete calls however the text was chunked."""
    per_char, per_seven = feed(tools.MISTRAL_V11, CANNED, 1), feed(tools.MISTRAL_V11, CANNED, 7)
    assert per_char == per_seven
    content, streamed, done = per_char
    assert content == "Sure."
    assert done == [("get_weather", '{"city": "a[TOOL_CALLS]b}", "unit": "c"}'), ("get_time", '{"zone": 2}')]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == done
    stream = tool_parser.ToolCallStream(tools.MISTRAL_V11)
    stream.update(CANNED, final=True)
    assert stream.ids[1] == "abcdEFG12" and ID.match(stream.ids[0])
    # the name is not sent before its [ARGS] (a name token may be followed by more of it)
    assert tool_parser.parse("[TOOL_CALLS]get_wea", tools.MISTRAL_V11) == ("", [])


def test_format_is_read_from_the_tekken_version_and_from_the_template(server: ServerThread) -> None:
    for name in ("small", "magistral"):
        assert tools.format_of(server.engine(name).tokenizer) is tools.MISTRAL_V11
    hf = type("T", (), {"chat_template": "{{- '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}"})()
    assert tools.format_of(hf) is tools.MISTRAL_V11
    assert reasoning.tags_of(server.engine("small").tokenizer) is None  # v11: no think tokens


@pytest.mark.parametrize("model", ["small", "magistral"])
def test_required_calls_round_trip_through_mistral_common(stub, server: ServerThread, model: str) -> None:
    """Required: the model's own tags (token ids 9 and 32, not spelled in bytes), valid arguments, 9-alphanumeric ids,
    streamed deltas equal to the summary's calls; sent back with a result, the conversation is what mistral_common
    writes for it (v11: `[CALL_ID]id` and `[TOOL_RESULTS]id[TOOL_CONTENT]...`; v13: no ids)."""
    tok = server.engine(model).tokenizer
    calls = None
    for seed in range(3):
        request = ask(model, seed, REQUIRED)
        text, streamed, summary = run(stub, request)
        ids = [i for r in stub.Generate(request) if r.WhichOneof("response") == "delta" for i in r.delta.token_ids]
        assert text == "" and summary.tool_calls and ids[0] == TOOL_CALLS and ARGS in ids, (text, summary)
        for i, call in enumerate(summary.tool_calls):
            assert streamed[i] == [call.id, call.name, call.arguments] and ID.match(call.id)
            assert set(SCHEMAS[call.name]["required"]) <= json.loads(call.arguments).keys()
        if summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS:
            calls = summary.tool_calls
    assert calls is not None
    follow = user_request("What is the weather in Paris?", model=model, tools=TOOLS, max_output_tokens=3)
    follow.contents.append(content_pb2.Content(role="assistant", tool_calls=calls))
    for call in calls:
        follow.contents.append(
            content_pb2.Content(role="tool", tool_call_id=call.id, parts=[content_pb2.Part(text='{"t": 21}')])
        )
    _, _, summary = run(stub, follow)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    messages.append({"role": "assistant", "content": "", "tool_calls": [_call(c) for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"t": 21}'} for c in calls]
    spec = [{"type": "function", "function": _function(t)} for t in TOOLS]
    want = tok.apply_chat_template(messages, tools=spec, tokenize=True, return_dict=False)
    assert summary.usage.prompt_tokens == len(want)
    rendered = tok.decode(want, skip_special_tokens=False)
    first = calls[0]
    written_id = f"[CALL_ID]{first.id}" if model == "small" else ""
    assert f"[TOOL_CALLS]{first.name}{written_id}[ARGS]{first.arguments}" in rendered
    assert ('[TOOL_CONTENT]{"t": 21}[/TOOL_RESULTS]' in rendered) == (model == "small")


def _call(c: content_pb2.ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}


def _function(t: generation_pb2.Tool) -> dict:
    return {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json_schema)}


def test_named_auto_and_none(stub) -> None:
    """Named: one call of that function; auto: any call is valid and its tags never show in the content; none: no
    call ever."""
    named = generation_pb2.ToolChoice(function_name="get_time")
    for seed in range(2):
        text, _, summary = run(stub, ask("small", seed, named))
        assert text == "" and [c.name for c in summary.tool_calls] == ["get_time"]
        assert summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS
        auto = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_AUTO)
        text, _, summary = run(stub, ask("small", seed, auto, max_output_tokens=30))
        assert "[TOOL_CALLS]" not in text and "[ARGS]" not in text
        assert all(ID.match(c.id) and json.loads(c.arguments) is not None for c in summary.tool_calls)
        none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
        text, streamed, summary = run(stub, ask("small", seed, none, max_output_tokens=20))
        assert not summary.tool_calls and not streamed


def test_magistral_thinks_in_reasoning_text_then_calls(stub, server: ServerThread) -> None:
    """Magistral: `[THINK]` is allowed beside the call grammar's first token; the thinking streams as
    reasoning_text (the tags in neither field), the call is parsed from the answer, reasoning_tokens counts through
    `[/THINK]`."""
    tok = server.engine("magistral").tokenizer
    thought_first = 0
    for seed in range(3):
        bias = {THINK: 12.0, END_THINK: 11.0}
        sampling = sampling_pb2.SamplingConfig(temperature=1.0, seed=seed, logit_bias=bias)
        request = ask("magistral", seed, REQUIRED, sampling=sampling, parallel_tool_calls=False, max_output_tokens=120)
        thought, text, ids, summary = "", "", [], None
        for response in stub.Generate(request):
            if response.WhichOneof("response") == "delta":
                thought += response.delta.reasoning_text
                text += response.delta.text
                ids += response.delta.token_ids
            else:
                summary = response.summary
        assert summary is not None and summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS, summary
        assert text == "" and json.loads(summary.tool_calls[0].arguments) is not None
        assert "[/THINK]" not in thought  # (the bias has it write more [THINK] tags inside)
        if ids[0] == THINK:
            assert summary.usage.reasoning_tokens == ids.index(END_THINK) + 1
            assert tok.decode(ids[1 : ids.index(END_THINK)], skip_special_tokens=False) == thought
            thought_first += bool(thought)
    assert thought_first, "some seed thinks before its call"


def test_hf_tokenizer_grammar_writes_the_tags_as_its_tokens(tmp_path: Path) -> None:
    """An HF-format folder (tokenizer.json with `[TOOL_CALLS]` / `[ARGS]` as special tokens, a template writing
    `[ARGS]`): required takes repeated `[TOOL_CALLS]name[ARGS]{...}` in those tokens and not v0.3's list; auto takes
    text, or text and then calls; none never the tag."""
    import llguidance
    import llguidance.hf

    make_tokenizer(tmp_path, 384)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    schema = tool_grammar.call_schema(tools.MISTRAL_V11, "get_time", SCHEMAS["get_time"], True)
    call = '[TOOL_CALLS]get_time[ARGS]{"zone": 3}'

    def accepts(choice: str, text: str) -> bool:
        grammar = tool_grammar.grammar(tools.MISTRAL_V11, [schema], choice, True, added=tool_grammar.added_tokens(tok))
        m = llguidance.LLMatcher(llg, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts(tools.REQUIRED, call + call) and not accepts(tools.REQUIRED, '[TOOL_CALLS] [{"name": "get_time"}]')
    assert not accepts(tools.REQUIRED, '[TOOL_CALLS]get_time[ARGS]{"zone": "x"}')  # strict: the schema holds
    assert accepts(tools.AUTO, "Sure. " + call) and accepts(tools.AUTO, "No call.")
    assert accepts(tools.NONE, "No call.") and not accepts(tools.NONE, "Sure. " + call)


def test_plain_turns_are_written_by_mistral_common(stub, server: ServerThread) -> None:
    """No tools: a tekken folder's turns are mistral_common's (they were joined by newlines); Magistral's thinking
    still comes apart from the answer."""
    request = user_request("Is it raining?", model="magistral", max_output_tokens=40)
    request.contents.insert(0, content_pb2.Content(role="system", parts=[content_pb2.Part(text="Be brief.")]))
    request.sampling.CopyFrom(sampling_pb2.SamplingConfig(temperature=1.0, seed=0, logit_bias={THINK: 12.0}))
    thought, text, summary = "", "", None
    for response in stub.Generate(request):
        if response.WhichOneof("response") == "delta":
            thought, text = thought + response.delta.reasoning_text, text + response.delta.text
        else:
            summary = response.summary
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is it raining?"}]
    want = server.engine("magistral").tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert summary is not None and summary.usage.prompt_tokens == len(want)
    assert thought and summary.usage.reasoning_tokens > 0 and "[THINK]" not in text


def test_a_final_assistant_turn_with_tools_is_continued(stub, server: ServerThread) -> None:
    """With tools, as without (test_plain_turns_...): a request ending on an assistant turn continues it, the prompt
    mistral_common writes with continue_final_message (it was INVALID_ARGUMENT on contents: mistral_common refuses
    a prompt that ends on an assistant turn unless told to continue it)."""
    request = user_request("What is the weather in Paris?", model="small", tools=TOOLS, max_output_tokens=3)
    request.contents.append(content_pb2.Content(role="assistant", parts=[content_pb2.Part(text="Let me check")]))
    _, _, summary = run(stub, request)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    messages.append({"role": "assistant", "content": "Let me check"})
    spec = [{"type": "function", "function": _function(t)} for t in TOOLS]
    tok = server.engine("small").tokenizer
    want = tok.apply_chat_template(messages, tools=spec, tokenize=True, return_dict=False, continue_final_message=True)
    assert tok.decode(want, skip_special_tokens=False).endswith("[/INST]Let me check")
    assert summary.usage.prompt_tokens == len(want)
