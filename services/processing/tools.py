"""Tool calls for Generate: validation, the prompt (the model's chat template renders tools and tool turns), the
grammar that constrains the model's own tool-call format, and Generate's view of the calls in the output.

Formats (chosen from the chat template's text):
- Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, calls separated by a newline.
- Llama 3 JSON: `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), calls separated by `; `.
- Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the tag a special token, kept in the text
  for these requests as vLLM keeps it); call ids are 9 alphanumerics, the only ids its template takes back.
- Mistral tokenizer v11+ (Mistral Small 3.2, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per call, three
  special tokens, no list; ids made as v0.3's.

A tekken.json folder (transformers' MistralCommonBackend: no chat template) has its format read from what
mistral_common writes for an assistant's call (`mistral_common_format`), and its prompts written by mistral_common.

Grammars: services/processing/tool_grammar.py.

Vision and audio models (`media_format`): their own prompt builder renders the tools, calls and results with the
images and audio (services/processing/image_prompt.py, audio_prompt.py, voxtral_prompt.py), through the processor's template or
else its tokenizer's (services/processing/tool_formats.py `media_template`); a model whose template renders no tools refuses them on `tools`.

Parsing (services/output/tool_parser.py) re-reads the whole text so far on every update, so deltas are the same however the
text arrived in chunks.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance

from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.output.tool_parser import (
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ID,
    MISTRAL_NEMO,
    MISTRAL_V11,
    ToolCallStream,
    ToolFormat,
)
from omnivox.services.processing.structured import GrammarCompiler, GrammarSpec, load_json
from omnivox.services.processing.tool_formats import format_of, is_mistral_common, mistral_common_format
from omnivox.services.processing.tool_grammar import (
    AUTO,
    JSON_STYLE,
    NONE,
    REQUIRED,
    added_tokens,
    call_schema,
    grammar,
)

# The formats and their detection, named here for callers of this module (tool_formats / tool_parser define them).
__all__ = ["HERMES", "LLAMA3", "MISTRAL", "MISTRAL_NEMO", "MISTRAL_V11", "format_of", "mistral_common_format"]
from omnivox.v1 import content_pb2, generation_pb2

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# The grammar compiler refuses JSON nested past 128 levels (serde_json's limit) and the call object adds a few; the
# refs of a schema deeper than this could not be rebased without hitting Python's recursion limit.
MAX_SCHEMA_DEPTH = 100


@dataclass
class ToolPlan:
    """What a request's tools ask for: the chat template's `tools`, the choice and the grammar (None: unconstrained)."""

    tools: list[dict]  # [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # auto | none | required | a function name
    parallel: bool
    fmt: ToolFormat
    grammar: GrammarSpec | None = None
    strict_schemas: dict[int, dict] = field(default_factory=dict)  # tools[i] -> its parameters schema, if strict

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != NONE


# The keys of OpenAI's function object, which wraps the arguments' schema in "parameters".
_OPENAI_FUNCTION = frozenset({"name", "description", "parameters", "strict"})
_WRAPPED = 'is OpenAI\'s function object ({"name", "parameters", ...}): send its "parameters" member'


def _schema(tool: generation_pb2.Tool, i: int, v: list[FieldViolation]) -> dict:
    if not tool.parameters_json_schema:
        return {"type": "object"}
    try:
        schema = load_json(tool.parameters_json_schema)
    except ValueError as exc:
        v.append(FieldViolation(f"tools[{i}].parameters_json_schema", str(exc)))
        return {}
    if not isinstance(schema, dict):
        v.append(FieldViolation(f"tools[{i}].parameters_json_schema", "must be a JSON object (a schema)"))
        return {}
    if isinstance(schema.get("parameters"), dict) and schema.keys() <= _OPENAI_FUNCTION:
        # a valid schema of unknown keywords: any JSON value would do as the arguments, the real schema unused
        v.append(FieldViolation(f"tools[{i}].parameters_json_schema", _WRAPPED))
        return {}
    if schema.get("type", "object") != "object":
        # a call's arguments are a JSON object, keyword arguments by name (OpenAI refuses other `parameters`, and
        # Hermes / Llama 3 / Mistral templates write `arguments` back as a mapping)
        why = f'must be an object schema ("type": "object"), got "type": {_tojson(schema["type"])}'
        v.append(FieldViolation(f"tools[{i}].parameters_json_schema", why))
        return {}
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        v.append(FieldViolation(f"tools[{i}].parameters_json_schema", f"nested deeper than {MAX_SCHEMA_DEPTH} levels"))
        return {}
    return schema


def _depth(value: Any) -> int:
    """How many objects and arrays deep a JSON value nests (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _check_ids(request: generation_pb2.GenerateRequest, v: list[FieldViolation]) -> None:
    """Mistral's template raises on any other id ("Tool call IDs should be alphanumeric strings with length 9!"):
    name the field instead of 'cannot build the prompt'."""
    why = "Mistral's chat template takes only ids of 9 letters and digits (as this server makes them)"
    for i, c in enumerate(request.contents):
        if c.role == "tool" and c.tool_call_id and not MISTRAL_ID.match(c.tool_call_id):
            v.append(FieldViolation(f"contents[{i}].tool_call_id", why))
        for j, call in enumerate(c.tool_calls):
            if not MISTRAL_ID.match(call.id):
                v.append(FieldViolation(f"contents[{i}].tool_calls[{j}].id", why))


def uses_tools(request: generation_pb2.GenerateRequest) -> bool:
    """The request sends tools, a tool choice, or tool turns (calls, results)."""
    has_turns = any(c.role == "tool" or c.tool_calls for c in request.contents)
    return bool(request.tools) or request.HasField("tool_choice") or has_turns


def media_format(request: generation_pb2.GenerateRequest, builder: Any) -> ToolFormat | None:
    """The call format of a multimodal model's prompt builder (images or audio with tools, as vLLM's chat API takes
    them: the model's own template renders both); None when the request uses no tools. INVALID_ARGUMENT on `tools`
    when the model's template cannot render tools (LLaVA's, SmolVLM's, Qwen2-Audio's, Whisper's)."""
    if not uses_tools(request):
        return None
    if not request.tools and not any(c.role == "tool" or c.tool_calls for c in request.contents):
        return HERMES  # a tool_choice alone: nothing to render nor parse (plan checks the choice)
    fmt = builder.tool_format() if hasattr(builder, "tool_format") else None
    if fmt is None:
        why = "this model's chat template does not render tools (nor tool calls and results)"
        raise errors.invalid_argument([FieldViolation("tools", why)])
    return fmt


def plan(request: generation_pb2.GenerateRequest, tokenizer: Any, media: ToolFormat | None = None) -> ToolPlan | None:
    """Validate tools / tool_choice / tool turns; None when the request uses none of them. `media`: the call format
    of a multimodal model's template (`media_format`), whose turns may hold image and audio parts too."""
    if not uses_tools(request):
        return None
    v: list[FieldViolation] = []
    if len(request.tools) > MAX_TOOLS:
        v.append(FieldViolation("tools", f"at most {MAX_TOOLS} tools, got {len(request.tools)}"))
    fmt = media if media is not None else format_of(tokenizer)
    tools, calls, names = [], {}, set()
    for i, tool in enumerate(request.tools):
        if not NAME.match(tool.name):
            v.append(FieldViolation(f"tools[{i}].name", "must match [a-zA-Z0-9_-]{1,64}"))
        elif tool.name in names:
            v.append(FieldViolation(f"tools[{i}].name", f"{tool.name!r} appears twice"))
        names.add(tool.name)
        params = _schema(tool, i, v)
        fn = {"name": tool.name, "description": tool.description, "parameters": params}
        tools.append({"type": "function", "function": fn})
        calls[tool.name] = call_schema(fmt, tool.name, params, tool.strict)
    choice = AUTO if request.tools else NONE
    tc = request.tool_choice
    kind = tc.WhichOneof("choice") if request.HasField("tool_choice") else None
    if kind == "mode" and tc.mode != generation_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        choice = {
            generation_pb2.TOOL_CHOICE_MODE_AUTO: AUTO,
            generation_pb2.TOOL_CHOICE_MODE_NONE: NONE,
            generation_pb2.TOOL_CHOICE_MODE_REQUIRED: REQUIRED,
        }.get(tc.mode, AUTO)
    elif kind == "function_name":
        choice = tc.function_name
        if choice not in calls:
            v.append(FieldViolation("tool_choice.function_name", f"no tool named {choice!r} in tools"))
    if choice in (AUTO, REQUIRED) and kind is not None and not request.tools:
        v.append(FieldViolation("tool_choice", "needs tools"))
    if request.tools and request.HasField("response_format") and choice != NONE:
        v.append(FieldViolation("response_format", "cannot be combined with tools unless tool_choice is NONE"))
    if (
        request.tools and request.ignore_eos and choice != NONE
    ):  # as with response_format (services/processing/structured.py)
        # a finished call admits only end-of-sequence: ignored, it was generated again until max_output_tokens
        v.append(FieldViolation("ignore_eos", "cannot be combined with tool calls unless tool_choice is NONE"))
    for i, c in enumerate(request.contents):
        if c.role == "tool" and not c.tool_call_id:
            v.append(FieldViolation(f"contents[{i}].tool_call_id", "a tool turn names the call it answers"))
        if c.tool_calls and c.role != "assistant":
            v.append(FieldViolation(f"contents[{i}].tool_calls", "only an assistant turn carries tool calls"))
        for j, part in enumerate(c.parts):
            if media is None and part.WhichOneof("kind") not in ("text", None):
                v.append(FieldViolation(f"contents[{i}].parts[{j}]", "with tools, turns take text parts only"))
        for j, call in enumerate(c.tool_calls):
            try:
                load_json(call.arguments or "{}")
            except ValueError as exc:
                v.append(FieldViolation(f"contents[{i}].tool_calls[{j}].arguments", str(exc)))
    if fmt.mistral:
        _check_ids(request, v)
    if v:
        raise errors.invalid_argument(v)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    strict = {i: t["function"]["parameters"] for i, t in enumerate(tools) if request.tools[i].strict}
    result = ToolPlan(tools, choice, parallel, fmt, strict_schemas=strict)
    if request.tools and request.HasField("response_format") and choice == NONE:
        return result  # the response_format constrains the output
    if request.tools:
        allowed = [calls[choice]] if choice in calls else list(calls.values())
        mode = choice if choice in (AUTO, NONE) else REQUIRED
        python_tag = fmt is LLAMA3 and "<|python_tag|>" in tokenizer.get_vocab()
        added = added_tokens(tokenizer)
        text = grammar(fmt, allowed, mode, parallel and choice not in calls, python_tag, added)
        result.grammar = GrammarSpec("tools", text)
    return result


def messages(contents: list[content_pb2.Content]) -> list[dict]:
    """The conversation as chat-template messages, with assistant tool calls and tool results."""
    out = []
    for c in contents:
        text = "\n".join(p.text for p in c.parts if p.WhichOneof("kind") == "text")
        out.append({"role": c.role or "user", "content": text, **turn_fields(c)})
    return out


def turn_fields(content: content_pb2.Content) -> dict[str, Any]:
    """A turn's tool fields as chat templates read them: an assistant's `tool_calls`, a result's `tool_call_id`."""
    fields: dict[str, Any] = {}
    if content.tool_calls:
        fields["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")},
            }
            for call in content.tool_calls
        ]
    if content.role == "tool":
        fields["tool_call_id"] = content.tool_call_id
    return fields


def tool_turn_content(content: content_pb2.Content, parts: list[dict]) -> str | list[dict]:
    """A multimodal turn's chat-template content: `parts` ({"type": ...} dicts), but one string for a tool result or
    an assistant's calls of text only (templates read those turns' `message.content` as text, as transformers' and
    vLLM's examples send them)."""
    if (content.role == "tool" or content.tool_calls) and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def prompt_ids(
    tokenizer: Any,
    contents: list[content_pb2.Content],
    tool_plan: ToolPlan,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    msgs = messages(contents)
    if is_mistral_common(tokenizer):  # tekken.json: mistral_common writes the tools, calls and results itself
        # A final assistant turn is continued, as ChatPromptBuilder does without tools (mistral_common refuses to end
        # a prompt on an assistant turn otherwise: "Expected last role User or Tool (or Assistant with prefix)")
        continue_final = bool(msgs) and msgs[-1]["role"] == "assistant"
        ids = tokenizer.apply_chat_template(
            msgs,
            tools=tool_plan.tools or None,
            tokenize=True,
            return_dict=False,
            continue_final_message=continue_final,
        )
        return list(ids)
    has_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
    if (tool_plan.tools or has_turns) and "tools" not in str(getattr(tokenizer, "chat_template", "") or ""):
        # calls and results are written in even when the request no longer sends the tools (a follow-up after the
        # result came): the template dropped the call (an empty assistant turn) and showed a "tool" role turn
        msgs = _hermes_in_text(msgs, tool_plan.tools)
    text = tokenizer.apply_chat_template(
        msgs, tools=tool_plan.tools or None, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _hermes_in_text(msgs: list[dict], tools: list[dict]) -> list[dict]:
    """For a chat template that ignores `tools` (the embedded SmolLM2's): the tools, calls and results written into
    the turns' text as Qwen2.5's template writes them, so the model sees the tools the grammar lets it call (else
    `auto` never called and `required` called blind)."""
    block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(_tojson(t) for t in tools)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>"
    )
    out = [dict(m) for m in msgs]
    if tools and out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    elif tools:
        out.insert(0, {"role": "system", "content": block})
    merged: list[dict] = []
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(f"<tool_call>\n{_tojson(c['function'])}\n</tool_call>" for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if merged and merged[-1].get("tool_results"):  # consecutive results share one user turn, as in Qwen's
                merged[-1]["content"] += "\n" + response
                continue
            m = {"role": "user", "content": response, "tool_results": True}
        merged.append(m)
    for m in merged:
        m.pop("tool_results", None)
    return merged


def _tojson(value: Any) -> str:
    """JSON as chat templates' `tojson` writes it (transformers': non-ASCII kept; json.dumps wrote "東京" as
    "\\u6771\\u4eac", two to three times the tokens, and not what the model reads or writes elsewhere)."""
    return json.dumps(value, ensure_ascii=False)


async def constrain(tool_plan: ToolPlan | None, params: Any, compiler: GrammarCompiler, salt: str) -> None:
    """Set params.constraint_factory from the tool grammar (compiled off the loop by the model's grammar compiler,
    cached per cache salt)."""
    if tool_plan is not None and tool_plan.fmt.mistral and tool_plan.parses_calls:
        # `[TOOL_CALLS]` (and v11's `[ARGS]`) are special tokens: decoded as usual they left the text, and the calls
        # showed as content
        params.skip_special_tokens = False
    if tool_plan is not None and tool_plan.grammar is not None:
        try:
            params.constraint_factory = await compiler.factory(tool_plan.grammar, salt)
        except errors.ServiceError:
            # The call grammar's error names only "tools" (and prints the whole grammar): name the tool whose schema
            # does not compile. Only on this failure path, each strict tool's schema compiled alone, off the loop.
            check = asyncio.to_thread(_uncompilable, tool_plan.strict_schemas)
            try:
                found = await asyncio.wait_for(check, compiler.timeout_s)
            except TimeoutError:
                found = []
            if found:
                raise errors.invalid_argument(found) from None
            raise


def _uncompilable(schemas: dict[int, dict]) -> list[FieldViolation]:
    """The first strict tool schema that llguidance refuses on its own, as a violation naming it ([] if none)."""
    for i, schema in schemas.items():
        try:
            alone = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
            message = llguidance.LLMatcher.validate_grammar(alone)
        except ValueError as exc:
            message = str(exc)
        if message:
            return [FieldViolation(f"tools[{i}].parameters_json_schema", f"does not compile: {message}")]
    return []


class ToolOutput:
    """Generate's view of a tool-calling response: rewrites deltas, flushes the tail, completes the summary."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.stream = ToolCallStream(tool_plan.fmt)

    def rewrite(self, response: generation_pb2.GenerateResponse, text_so_far: str) -> None:
        content, calls = self.stream.update(text_so_far)
        response.delta.text = content
        response.delta.tool_calls.extend(calls)

    def flush(self, text: str) -> generation_pb2.GenerateResponse | None:
        content, calls = self.stream.update(text, final=True)
        if not content and not calls:
            return None
        return generation_pb2.GenerateResponse(delta=generation_pb2.GenerateDelta(text=content, tool_calls=calls))

    def complete(self, response: generation_pb2.GenerateResponse, text: str) -> None:
        calls = self.stream.complete_calls(text)
        response.summary.tool_calls.extend(calls)
        if calls and response.summary.finish_reason == generation_pb2.FINISH_REASON_STOP:
            response.summary.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS
