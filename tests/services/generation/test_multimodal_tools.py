"""Tool calls with images and audio (vision and voice agents), over a real gRPC server on tiny random checkpoints:
[image or audio, question] + tools -> a call that parses and validates; the result sent back (role tool) with the
image / audio still in the history -> an answer. The prompt is the one transformers' processor (or mistral_common,
for Voxtral) writes for the same messages and tools, token for token. Models whose template renders no tools refuse
them (INVALID_ARGUMENT on `tools`); a spoken question to a text model (`--asr-model`) is a cascade with tools.

The tool-capable templates below are modelled on the real Qwen2.5-VL / Qwen2.5 ones (a `# Tools` system block, calls
as `<tool_call>` JSON, results as `<tool_response>` in a user turn), with the family's image or audio marker.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import grpc
import jsonschema
import numpy as np
import pytest
import transformers
from google.rpc import error_details_pb2
from support.audio_checkpoints import encode, make_qwen2_audio, tone
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, nothing_left
from support.vision_checkpoints import chat_template, make_llava, make_qwen2_5_vl, png_bytes, sample_image
from support.voxtral_checkpoint import make_voxtral_bundle
from support.whisper_checkpoints import make_whisper

from omnivox.services.calls.whisper import transcribe
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{%- if p.type == 'image' %}{IMAGE}{% elif p.type == 'audio' %}{AUDIO}{% elif p.type == 'text' %}{{ p.text }}"
    "{%- endif %}{% endfor %}{% endif %}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_TEMPLATE = _TOOLS_TEMPLATE.replace("{IMAGE}", "<|vision_start|><|image_pad|><|vision_end|>")
AUDIO_TEMPLATE = _TOOLS_TEMPLATE.replace("{AUDIO}", "<|audio_bos|><|AUDIO|><|audio_eos|>")

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},  # few tokens (bytes)
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = generation_pb2.Tool(
    name="get_weather", description="Weather now", parameters_json_schema=json.dumps(WEATHER), strict=True
)
SPEC = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
IMAGE = sample_image(40, 32, seed=4)
CLIP = encode(tone(1.2, freq=330.0), 16000, "WAV")
STEPS = 96  # room for a whole call spelt in characters (the grammar ends it)


def _with_template(folder: Path, template: str) -> Path:
    (folder / "chat_template.jinja").write_text(template)  # the processor's (and tokenizer's) template
    return folder


def _hub_layout(folder: Path) -> Path:
    """As the hub's Qwen2.5-VL ships: the processor's chat_template.json renders no tools, the tokenizer's template
    (tokenizer_config.json) does; a request with tools is rendered by the tokenizer's, as vLLM's chat API does."""
    (folder / "chat_template.jinja").unlink()
    plain = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": plain}))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": VL_TEMPLATE}))
    return folder


def _with_eos(folder: Path) -> Path:
    """make_qwen2_audio's config names no end of sequence (the real one's generation config does: <|im_end|>); a
    grammar needs one to end on."""
    config = json.loads((folder / "config.json").read_text())
    eos = transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|im_end|>")
    config["text_config"]["eos_token_id"] = config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmtools")
    text = make_checkpoint(root / "text", family="llama", max_position_embeddings=4096)
    (text / "chat_template.jinja").write_text(_TOOLS_TEMPLATE)  # a text model with Qwen's tools template
    specs = [
        ModelSpec(path=_with_template(make_qwen2_5_vl(root / "vl"), VL_TEMPLATE), name="vl"),
        ModelSpec(path=_hub_layout(make_qwen2_5_vl(root / "vl-hub")), name="vl-hub"),
        ModelSpec(path=_with_eos(_with_template(make_qwen2_audio(root / "qa"), AUDIO_TEMPLATE)), name="qa"),
        ModelSpec(path=make_qwen2_audio(root / "qa-plain"), name="qa-plain"),  # its default template: no tools
        ModelSpec(path=make_llava(root / "llava"), name="llava"),  # no tools in its template
        ModelSpec(path=make_voxtral_bundle(root / "voxtral"), name="voxtral"),
        # Voxtral on a v13 tokenizer: calls written `[TOOL_CALLS]name[ARGS]{...}`
        ModelSpec(path=make_voxtral_bundle(root / "voxtral13", version="v13"), name="voxtral13"),
        ModelSpec(path=text, name="text"),
        ModelSpec(path=make_whisper(root / "whisper"), name="whisper"),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02), asr_model="whisper") as server:
        yield {"server": server, "stub": generation_pb2_grpc.GenerationServiceStub(server.channel())}


def _media(kind: str) -> content_pb2.Part:
    if kind == "image":
        return content_pb2.Part(image=content_pb2.ImagePart(data=png_bytes(IMAGE)))
    return content_pb2.Part(audio=content_pb2.AudioPart(data=CLIP))


def _request(model: str, contents: list[content_pb2.Content], **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("max_output_tokens", STEPS)
    sampling = sampling_pb2.SamplingConfig(temperature=0.0)
    return generation_pb2.GenerateRequest(model=model, contents=contents, tools=[TOOL], sampling=sampling, **fields)


def _generate(stub, request, ids: list[int] | None = None) -> generation_pb2.GenerateSummary:
    """The summary; the output's token ids appended to `ids`."""
    summary = None
    for response in stub.Generate(request, timeout=120):
        if ids is not None:
            ids.extend(response.delta.token_ids)
        if response.HasField("summary"):
            summary = response.summary
    assert summary is not None
    return summary


def _round_trip(s, model: str, kind: str, call_id: str = "call_1", call_ids: list[int] | None = None):
    """[media, question] + tools (required) -> one valid call; the result sent back with the media still in the
    history -> an answer (tool_choice none). Returns the history and both prompts' token counts; the call's token ids
    are appended to `call_ids`."""
    question = content_pb2.Content(role="user", parts=[_media(kind), content_pb2.Part(text="Weather there?")])
    required = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED)
    first = _generate(s["stub"], _request(model, [question], tool_choice=required, parallel_tool_calls=False), call_ids)
    assert first.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS
    assert [c.name for c in first.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(first.tool_calls[0].arguments), WEATHER)
    call = content_pb2.ToolCall(id=call_id, name="get_weather", arguments=first.tool_calls[0].arguments)
    history = [
        question,
        content_pb2.Content(role="assistant", tool_calls=[call]),
        content_pb2.Content(role="tool", tool_call_id=call_id, parts=[content_pb2.Part(text='{"temp": 21}')]),
    ]
    none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
    answer = _generate(s["stub"], _request(model, history, tool_choice=none))
    assert answer.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
    assert not answer.tool_calls and answer.usage.output_tokens > 0
    return history, first.usage.prompt_tokens, answer.usage.prompt_tokens


def _messages(history: list[content_pb2.Content], media: dict) -> list[dict]:
    """The history as a user of transformers' processor writes it (OpenAI's shape; tool turns' content a string)."""
    out = []
    for c in history:
        if c.role == "tool":
            out.append({"role": "tool", "tool_call_id": c.tool_call_id, "content": c.parts[0].text})
        elif c.tool_calls:
            calls = [
                {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": json.loads(t.arguments)}}
                for t in c.tool_calls
            ]
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            parts = [media if p.WhichOneof("kind") != "text" else {"type": "text", "text": p.text} for p in c.parts]
            out.append({"role": c.role, "content": parts})
    return out


def _processor_ids(s, model: str, messages: list[dict], tools: list[dict] | None = SPEC) -> list[int]:
    processor = s["server"].registry.lookup(model).prompt_builder
    processor = (getattr(processor, "image", None) or processor.audio).processor
    template = processor.chat_template if "tools" in processor.chat_template else processor.tokenizer.chat_template
    out = processor.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=True, return_dict=True, add_generation_prompt=True
    )
    return list(np.asarray(out["input_ids"]).reshape(-1))


@pytest.mark.parametrize(("model", "kind"), [("vl", "image"), ("vl-hub", "image"), ("qa", "audio")])
def test_media_question_with_tools_calls_and_the_prompt_is_the_processors(served, model, kind):
    history, first_n, answer_n = _round_trip(served, model, kind)
    media = {"type": "image", "image": IMAGE} if kind == "image" else {"type": "audio", "audio": tone(1.2, freq=330.0)}
    first = _processor_ids(served, model, _messages(history[:1], media))
    whole = _processor_ids(served, model, _messages(history, media))
    assert (first_n, answer_n) == (len(first), len(whole))
    # A follow-up that no longer sends the tools: the calls and results still rendered by the tools template
    later = _generate(
        served["stub"], generation_pb2.GenerateRequest(model=model, contents=history, max_output_tokens=2)
    )
    assert later.usage.prompt_tokens == len(_processor_ids(served, model, _messages(history, media), tools=None))
    builder = served["server"].registry.lookup(model).prompt_builder
    for contents, want in ((history[:1], first), (history, whole)):
        prompt = builder.build(contents, SPEC)
        try:
            assert prompt.token_ids == want  # markers expanded as the processor expands them
        finally:
            prompt.release()
    nothing_left(served["server"], model)


@pytest.mark.parametrize("model", ["voxtral", "voxtral13"])
def test_voxtral_audio_question_with_tools_round_trip(served, model):
    """v7: `[TOOL_CALLS][{...}]`; v13 (before: tools refused): `[TOOL_CALLS]name[ARGS]{...}`, [ARGS] its token too."""
    ids: list[int] = []
    history, first_n, answer_n = _round_trip(served, model, "audio", "abc123XYZ", ids)  # Mistral: 9 characters
    assert ids[0] == 9  # its own [TOOL_CALLS] special token, not the tag spelt in bytes
    assert (32 in ids) == (model == "voxtral13")  # [ARGS]
    audio = {"type": "audio", "base64": base64.b64encode(CLIP).decode()}
    backend = served["server"].registry.lookup(model).bundle.audio.processor.tokenizer
    for contents, n in ((history[:1], first_n), (history, answer_n)):
        want = backend.apply_chat_template(_messages(contents, audio), tools=SPEC, tokenize=True, return_dict=False)
        assert n == len(want)
        prompt = served["server"].registry.lookup(model).prompt_builder.build(contents, SPEC)
        try:
            assert prompt.token_ids == list(want)
        finally:
            prompt.release()
    nothing_left(served["server"], model)


def test_spoken_question_to_a_text_model_with_tools(served):
    """The cascade as a voice agent: the audio is transcribed (in every turn that holds it), the text model calls."""
    history, first_n, answer_n = _round_trip(served, "text", "audio")
    tokenizer = served["server"].registry.lookup("text").engine.tokenizer
    whisper = served["server"].registry.lookup("whisper").bundle.whisper
    samples = whisper.decode(history[0].parts[0].audio, "audio").samples
    spoken = served["server"].run(transcribe(whisper, samples, language=None)).text
    messages = _messages(history, {"type": "text", "text": spoken})
    for m in messages:  # a text template: one string per turn
        if isinstance(m["content"], list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
    for msgs, n in ((messages[:1], first_n), (messages, answer_n)):
        text = tokenizer.apply_chat_template(msgs, tools=SPEC, tokenize=False, add_generation_prompt=True)
        assert n == len(tokenizer.encode(text, add_special_tokens=False))
    # The next turn re-sends the spoken question: its transcript is remembered, Whisper does not run again
    steps = served["server"].registry.lookup("whisper").engine.num_steps
    none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
    again = _generate(served["stub"], _request("text", history, tool_choice=none, max_output_tokens=2))
    assert again.usage.prompt_tokens == answer_n
    assert served["server"].registry.lookup("whisper").engine.num_steps == steps


@pytest.mark.parametrize(("model", "kind"), [("llava", "image"), ("qa-plain", "audio")])
def test_template_without_tools_refuses_them_naming_tools(served, model, kind):
    contents = [content_pb2.Content(role="user", parts=[_media(kind), content_pb2.Part(text="Weather there?")])]
    for request in (
        _request(model, contents),
        generation_pb2.GenerateRequest(  # a tool turn without tools: the template could not show it either
            model=model,
            contents=[
                *contents,
                content_pb2.Content(role="tool", tool_call_id="c", parts=[content_pb2.Part(text="1")]),
            ],
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            _generate(served["stub"], request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (bad,) = [d for d in status_details(err.value) if isinstance(d, error_details_pb2.BadRequest)]
        assert [v.field for v in bad.field_violations] == ["tools"]
    none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)  # a choice alone changes nothing
    summary = _generate(
        served["stub"],
        generation_pb2.GenerateRequest(model=model, contents=contents, max_output_tokens=2, tool_choice=none),
    )
    assert summary.usage.output_tokens == 2  # still serving
    nothing_left(served["server"], model)


def test_grammar_on_a_model_without_end_of_sequence_is_invalid_argument(served):
    """make_qwen2_audio's config names no eos: a response_format was INTERNAL 'eos_token list must not be empty'."""
    contents = [content_pb2.Content(role="user", parts=[_media("audio"), content_pb2.Part(text="Which?")])]
    request = generation_pb2.GenerateRequest(
        model="qa-plain", contents=contents, response_format=generation_pb2.ResponseFormat(regex="(yes|no)")
    )
    with pytest.raises(grpc.RpcError) as err:
        _generate(served["stub"], request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad,) = [d for d in status_details(err.value) if isinstance(d, error_details_pb2.BadRequest)]
    assert [v.field for v in bad.field_violations] == ["response_format.regex"]
