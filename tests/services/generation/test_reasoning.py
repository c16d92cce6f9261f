"""Reasoning models (Qwen3-style `<think>...</think>`): the thinking comes as reasoning_text apart from the answer,
response_format and tool grammars hold for the answer only, and enable_thinking reaches the chat template. Over a
real gRPC server on tiny random Qwen3 checkpoints whose tokenizers carry the tags (plain added tokens, as Qwen3's)
and a Qwen3-style template (thinking switch) or an R1-style one (the prompt opens the thinking).

Before: the `<think>` block was part of the answer text; a grammar held from the first token (a JSON answer or a
required call could not be thought about first: `<think>` was masked); enable_thinking could not be sent."""

from __future__ import annotations

import json

import grpc
import pytest
import transformers
from support.checkpoints import make_checkpoint
from support.grpc_errors import violation_descriptions
from support.service_harness import ServerThread, user_request
from support.tool_calls import TOOLS, run

from omnivox.services.output import tool_parser
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing import reasoning, tools
from omnivox.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

_TURNS = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{- '\\n' + t | tojson }}{% endfor %}"
    "{{- '\\n</tools>\\nCall one within <tool_call></tool_call> tags.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set c = m.content %}"
    "{%- if '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + c }}"
    "{%- for t in m.tool_calls or [] %}{{- '<tool_call>\\n' }}"
    '{{- {"name": t.function.name, "arguments": t.function.arguments} | tojson }}{{- \'\\n</tool_call>\' }}'
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
)
# Qwen3's generation prompt: an empty think block when thinking is switched off
QWEN3_TEMPLATE = _TURNS + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# DeepSeek-R1 / Qwen3-Thinking-2507: the prompt opens the thinking, there is no switch
R1_TEMPLATE = _TURNS + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _checkpoint(path, template: str):
    ckpt = make_checkpoint(path, family="qwen3", num_hidden_layers=1, max_position_embeddings=1024)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])  # not special: kept in decoded text
    tok.chat_template = template
    tok.save_pretrained(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ckpt")
    specs = [
        ModelSpec(path=_checkpoint(root / "qwen3", QWEN3_TEMPLATE), name="qwen3"),
        ModelSpec(path=_checkpoint(root / "r1", R1_TEMPLATE), name="r1"),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(server.channel())


def generate(stub, request) -> tuple[str, str, list[int], generation_pb2.GenerateSummary]:
    """(reasoning, answer, token ids, summary) from the stream's deltas."""
    thought, text, ids, summary = "", "", [], None
    for response in stub.Generate(request):
        if response.WhichOneof("response") == "delta":
            thought += response.delta.reasoning_text
            text += response.delta.text
            ids += response.delta.token_ids
        else:
            summary = response.summary
    assert summary is not None
    return thought, text, ids, summary


def tag_ids(server: ServerThread, name: str) -> tuple[int, int]:
    vocab = server.engine(name).tokenizer.get_vocab()
    return vocab["<think>"], vocab["</think>"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\n<think>\nIt is <tool_call> a </thi", ("\nIt is <tool_call> a ", "")),  # a partial closing tag held
        ("<think>a</think>\n\n Answer.", ("a", "Answer.")),
        (" \n", ("", "")),  # may still open a think block
        (" Plain <think> answer", ("", " Plain <think> answer")),
    ],
)
def test_split_holds_back_and_is_chunking_independent(text: str, expected: tuple[str, str]) -> None:
    assert reasoning.split(text, reasoning.Start.EITHER) == expected
    out = reasoning.ReasoningOutput(reasoning.ThinkTags(0, 1), reasoning.Start.EITHER)
    got = ["", ""]
    for end in range(1, len(text) + 1):  # one character at a time gives the same as the whole
        delta = generation_pb2.GenerateDelta()
        out.rewrite(delta, text[:end])
        got = [got[0] + delta.reasoning_text, got[1] + delta.text]
    assert tuple(got) == expected
    assert reasoning.split("a</thi", reasoning.Start.THINKING, final=True) == ("a</thi", "")


def test_tool_calls_are_read_from_the_answer_only() -> None:
    """A `<tool_call>` written while thinking is not a call (Generate feeds the tool parser the answer)."""
    text = '<think>\nMaybe <tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n</think>\n\nHi'
    _, answer = reasoning.split(text, reasoning.Start.EITHER, final=True)
    assert tool_parser.parse(answer, tools.HERMES) == ("Hi", [])


def test_json_answer_after_thinking(stub, server: ServerThread) -> None:
    """R1-style (the prompt opens the thinking): free thinking, then an answer the schema holds; the deltas add up
    to the tokens' text with the tags in between; reasoning_tokens counts through </think>."""
    _, end = tag_ids(server, "r1")
    tok = server.engine("r1").tokenizer
    thoughts = []
    for seed in range(4):
        request = user_request(
            "Is it raining?",
            model="r1",
            response_format=generation_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA)),
            sampling=sampling_pb2.SamplingConfig(temperature=1.0, seed=seed, logit_bias={end: 4.0}),
            max_output_tokens=60,
        )
        thought, answer, ids, summary = generate(stub, request)
        assert end in ids, "the bias ends the thinking within the budget"
        assert json.loads(answer)["answer"] in ("yes", "no") and "</think>" not in thought
        assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == (thought + "</think>" + answer).replace(
            " ", ""
        )
        assert summary.usage.reasoning_tokens == ids.index(end) + 1
        thoughts.append(thought)
    assert any(thoughts), "some seed thinks for a while before answering"


def test_required_call_may_think_first(stub, server: ServerThread) -> None:
    """Qwen3-style (the model opens the thinking itself): `<think>` is allowed as the first token beside the call
    grammar's; the call follows the thinking and is parsed from the answer."""
    think, end = tag_ids(server, "qwen3")
    thought_first = 0
    for seed in range(3):
        request = user_request(
            "What is the weather in Paris?",
            model="qwen3",
            tools=TOOLS,
            tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
            parallel_tool_calls=False,
            sampling=sampling_pb2.SamplingConfig(temperature=1.0, seed=seed, logit_bias={think: 12.0, end: 10.0}),
            max_output_tokens=240,
        )
        text, calls, summary = run(stub, request)
        thought, *_ = generate(stub, request)
        assert summary.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS and text == "", summary
        assert [c.name for c in summary.tool_calls] == [calls[0][1]] and json.loads(summary.tool_calls[0].arguments)
        assert "</think>" not in thought  # (the bias has it write more <think> tags inside)
        thought_first += summary.usage.reasoning_tokens >= 2
    assert thought_first, "some seed thinks before its call"


def test_enable_thinking_false(stub, server: ServerThread) -> None:
    """Off: the template writes its empty think block into the prompt, the output is all answer, and the grammar
    holds from the first token; a template without the switch refuses it naming the field, and the server serves on."""
    tok = server.engine("qwen3").tokenizer
    request = user_request(
        "Is it raining?",
        model="qwen3",
        enable_thinking=False,
        response_format=generation_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA)),
        sampling=sampling_pb2.SamplingConfig(temperature=1.0, seed=1),
        max_output_tokens=30,
    )
    thought, answer, _, summary = generate(stub, request)
    messages = [{"role": "user", "content": "Is it raining?"}]
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert summary.usage.prompt_tokens == len(tok.encode(off, add_special_tokens=False))
    assert thought == "" and summary.usage.reasoning_tokens == 0 and json.loads(answer)["answer"] in ("yes", "no")
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, user_request("hi", model="r1", enable_thinking=False))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "enable_thinking" in violation_descriptions(
        info.value
    )
    assert generate(stub, user_request("hi", model="r1", enable_thinking=True, max_output_tokens=2))[3].usage


def test_gate_advances_and_rolls_back_across_the_closing_tag(server: ServerThread) -> None:
    """Speculative tokens are advanced and taken back: the grammar sees exactly the answer's tokens."""
    import llguidance

    from omnivox.engine.structured import compile_grammar, grammar_row, grammar_tokenizer

    tok = server.engine("qwen3").tokenizer
    think, end = tag_ids(server, "qwen3")
    vocab = server.engine("qwen3").model_config.vocab_size
    grammar = llguidance.LLMatcher.grammar_from_regex("yes|no")
    factory = compile_grammar(grammar_tokenizer(tok, vocab, [2]), grammar, vocab, [2])
    yes = tok.encode("yes", add_special_tokens=False)
    gate = reasoning.gate(factory, reasoning.ThinkTags(think, end), reasoning.Start.EITHER)()
    first = gate.allowed([])
    assert first[think] and first[yes[0]] and int(first.sum()) < vocab // 2  # <think> or the answer's first token
    assert grammar_row(gate) is gate.inner  # the first mask comes from the grammar: filled with the batch's
    gate.advance([think, 5, 6])
    assert gate.allowed([think, 5, 6]) is None and grammar_row(gate) is None  # thinking: anything, no mask to fill
    gate.advance([end, *yes])
    assert gate.inner.num_consumed == len(yes) and gate.must_end
    gate.rollback(len(yes) + 1)  # back into the thinking
    assert gate.inner.num_consumed == 0 and gate.answer_from is None and gate.allowed([think, 5, 6]) is None
    gate.advance([end])
    assert grammar_row(gate) is gate.inner
    assert not gate.allowed([think, 5, 6, end])[think] and gate.allowed([think, 5, 6, end])[yes[0]]


def test_cli_prints_the_thinking_to_stderr(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """`omnivox generate`: stdout is the answer (what a pipe or the chat history takes), the thinking on stderr;
    --no-thinking sends enable_thinking false."""
    import argparse

    from omnivox.services.cli import generate as cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    _, end = tag_ids(server, "r1")
    args = parser.parse_args(["generate", "Is it raining?", "--model", "r1", "--seed", "3", "--max-tokens", "40"])
    request = cli.build_request(args, [("user", args.prompt)])
    request.sampling.logit_bias[end] = 4.0
    answer = cli.stream_answer(stub, request, args)
    thought, expected, _, _ = generate(stub, request)
    out, err = capsys.readouterr()
    assert answer == expected and out.strip() == expected.strip() and thought and err.startswith(thought)
    args = parser.parse_args(["generate", "hi", "--model", "qwen3", "--no-thinking"])
    assert cli.build_request(args, [("user", "hi")]).enable_thinking is False
