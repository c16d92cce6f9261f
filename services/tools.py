"""Tool calls for Generate: validation, the prompt (the model's chat template renders tools and tool turns), the
grammar that constrains the model's own tool-call format, and Generate's view of the calls in the output.

Formats (chosen from the chat template's text):
- Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, calls separated by a newline.
- Llama 3 JSON: `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), calls separated by `; `.
- Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the tag a special token, kept in the text
  for these requests as vLLM keeps it); call ids are 9 alphanumerics, the only ids its template takes back.

Grammars (llguidance Lark, the call object as an embedded `%json` schema per tool):
- `required` / a named function: the output is one (or, with parallel_tool_calls, up to MAX_PARALLEL_CALLS) calls
  from the first token.
- `auto`: free text that never contains the opening tag, or free text up to the tag (a lazy lexeme) and then calls:
  the grammar is armed only by the tag. Llama's `auto` arms on a `{` (or the python tag) at the start of the output,
  Mistral's on its tag at the start (where v0.3 writes its calls).
- `none`: free text that never contains the opening tag (Hermes), so a call can never appear.

Parsing (services/tool_parser.py) re-reads the whole text so far on every update, so deltas are the same however the
text arrived in chunks.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

import llguidance

from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.structured import GrammarSpec, load_json
from omnivox.services.tool_parser import HERMES, LLAMA3, MISTRAL, ToolCallStream, ToolFormat
from omnivox.v1 import content_pb2, generation_pb2

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# Calls one answer may make. Unbounded, a small model at temperature 0 repeated the same call until the context was
# full (8,000 tokens, minutes) on `tool_choice: required` with no max_output_tokens; after this many only the end of
# the message is allowed.
MAX_PARALLEL_CALLS = 16
# The grammar compiler refuses JSON nested past 128 levels (serde_json's limit) and the call object adds a few; the
# refs of a schema deeper than this could not be rebased without hitting Python's recursion limit.
MAX_SCHEMA_DEPTH = 100
AUTO, NONE, REQUIRED = "auto", "none", "required"
# Separators as the chat templates' tojson writes them, with no other whitespace: what the model saw, and bounded.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def format_of(tokenizer: Any) -> ToolFormat:
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "[TOOL_CALLS]" in template:  # Mistral's template writes calls back with its tag (a tokenizer that has the
        return MISTRAL  # token but a template without tools gets Hermes written into the text: prompt_ids)
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3
    return HERMES


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


def _call_schema(fmt: ToolFormat, name: str, params: dict, strict: bool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, fmt.args_key: params if strict else {"type": "object"}},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
    }


# Values that are data, not subschemas: a `$ref` key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebase_refs(node: Any, prefix: str) -> Any:
    """A copy of a schema with each local `$ref` ("#" or "#/...") moved under `prefix`, the JSON pointer fragment
    where the schema now sits. A tool's parameters schema is embedded in its call object's schema, so its
    `#/$defs/...` refs (pydantic writes one for every nested model) resolved against the call object: "Pointer
    '/$defs/unit' does not exist" refused a valid tool."""
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    if not isinstance(node, dict) or isinstance(node.get("$id"), str):
        return node  # under an $id, "#..." refs resolve against that resource: they stay as written
    out = {k: v if k in _DATA_KEYWORDS else _rebase_refs(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = prefix + ref[1:]
    return out


def _rebased(call: dict, key: str, at: str) -> dict:
    """The call-object schema `call`, placed at pointer `at` of the grammar's schema, with its arguments' refs
    rebased to there."""
    props = dict(call["properties"])
    props[key] = _rebase_refs(props[key], f"{at}/properties/{key}")
    return {**call, "properties": props}


def _tag(text: str, added: dict[str, int]) -> str:
    """A tag as a Lark sequence: by token id where the tag (without its whitespace) is one of the tokenizer's added
    tokens. llguidance takes every added token for a special one, which a string literal never matches: Qwen's
    `<tool_call>` (an added token) was the only token a required call's mask allowed, and then the grammar refused
    it ('token doesn't satisfy the grammar'): INTERNAL on the first token of every required or named call."""
    core = text.strip()
    if core not in added:
        return json.dumps(text)
    lead, trail = text[: text.index(core)], text[text.index(core) + len(core) :]
    return " ".join(
        [*([json.dumps(lead)] if lead else []), f"<[{added[core]}]>", *([json.dumps(trail)] if trail else [])]
    )


def _grammar(
    fmt: ToolFormat,
    calls: list[dict],
    choice: str,
    parallel: bool,
    python_tag: bool = False,
    added: dict[str, int] | None = None,
) -> str:
    """A Lark grammar (llguidance) for the choice; `calls` are the allowed call-object schemas. `python_tag`: the
    tokenizer has Llama 3's `<|python_tag|>` special token, which may open the calls. `added`: the tokenizer's added
    tokens (text -> id), which the tags are written with when they are one of them."""
    added = added or {}
    if fmt.array:
        return _array_grammar(fmt, calls, choice, parallel, added)
    body = _call_body(fmt, calls)
    open_tag, close_tag = _tag(fmt.open_tag, added), _tag(fmt.close_tag, added)
    call = f"{open_tag} {body} {close_tag}" if fmt.open_tag else body
    more = f" ({json.dumps(fmt.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    calls_rule = f"calls: call{more}"
    lines = [calls_rule, f"call: {call}"]
    tag = fmt.open_tag.strip() or "{"
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*{re.escape(tag)}.*)/"
    if choice == AUTO and fmt.open_tag:
        rest = fmt.open_tag[len(tag) :]
        after = f"{json.dumps(rest)} {body} {close_tag}" if rest else f"{body} {close_tag}"
        lines.append(f"calls_after_tag: {after}{more}")
        if tag in added:  # a token no regex matches: free text ends where it comes
            lines += [f"start: FREE | FREE? <[{added[tag]}]> calls_after_tag", free]
        else:
            lines += ["start: FREE | lz calls_after_tag", free, f"lz[lazy]: /(?s:.*){re.escape(tag)}/"]
    elif choice == AUTO:  # Llama: plain text that does not start with a call, or calls
        lines += ["start: TEXT | tagged", r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/"]
    elif choice == NONE and fmt.open_tag:
        lines += ["start: FREE", free]
    elif choice == NONE:  # Llama: a call is a whole message starting with "{"; braces later in the text are fine
        lines += ["start: TEXT", r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/"]
    else:
        lines.append("start: tagged" if not fmt.open_tag else "start: calls")
    if not fmt.open_tag:
        lines.append("tagged: <|python_tag|>? calls" if python_tag else "tagged: calls")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def _call_body(fmt: ToolFormat, calls: list[dict]) -> str:
    """`%json` of the call object (one of `calls`), with the templates' separators."""
    key = fmt.args_key
    if len(calls) == 1:
        schema = _rebased(calls[0], key, "#")
    else:
        schema = {"anyOf": [_rebased(c, key, f"#/anyOf/{i}") for i, c in enumerate(calls)]}
    schema["x-guidance"] = _JSON_STYLE
    return f"%json {json.dumps(schema)}"


def _array_grammar(fmt: ToolFormat, calls: list[dict], choice: str, parallel: bool, added: dict[str, int]) -> str:
    """Mistral: `[TOOL_CALLS] [call, call]`, the list opened as its template writes it back (`[TOOL_CALLS] [`)."""
    tag = _tag(fmt.open_tag, added)
    more = f" ({json.dumps(fmt.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    lines = [f'calls: {tag} " [" call{more} "]"', f"call: {_call_body(fmt, calls)}"]
    # A special token is outside every regex's language: FREE can never write the tag. A plain-text tag is excluded.
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*{re.escape(fmt.open_tag)}.*)/"
    if choice == AUTO:
        lines += ["start: FREE | calls", free]
    elif choice == NONE:
        lines += ["start: FREE", free]
    else:
        lines.append("start: calls")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


_MISTRAL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")


def _check_ids(request: generation_pb2.GenerateRequest, v: list[FieldViolation]) -> None:
    """Mistral's template raises on any other id ("Tool call IDs should be alphanumeric strings with length 9!"):
    name the field instead of 'cannot build the prompt'."""
    why = "Mistral's chat template takes only ids of 9 letters and digits (as this server makes them)"
    for i, c in enumerate(request.contents):
        if c.role == "tool" and c.tool_call_id and not _MISTRAL_ID.match(c.tool_call_id):
            v.append(FieldViolation(f"contents[{i}].tool_call_id", why))
        for j, call in enumerate(c.tool_calls):
            if not _MISTRAL_ID.match(call.id):
                v.append(FieldViolation(f"contents[{i}].tool_calls[{j}].id", why))


def plan(request: generation_pb2.GenerateRequest, tokenizer: Any) -> ToolPlan | None:
    """Validate tools / tool_choice / tool turns; None when the request uses none of them."""
    has_turns = any(c.role == "tool" or c.tool_calls for c in request.contents)
    if not request.tools and not request.HasField("tool_choice") and not has_turns:
        return None
    v: list[FieldViolation] = []
    if len(request.tools) > MAX_TOOLS:
        v.append(FieldViolation("tools", f"at most {MAX_TOOLS} tools, got {len(request.tools)}"))
    fmt = format_of(tokenizer)
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
        calls[tool.name] = _call_schema(fmt, tool.name, params, tool.strict)
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
    if request.tools and request.ignore_eos and choice != NONE:  # as with response_format (services/structured.py)
        # a finished call admits only end-of-sequence: ignored, it was generated again until max_output_tokens
        v.append(FieldViolation("ignore_eos", "cannot be combined with tool calls unless tool_choice is NONE"))
    for i, c in enumerate(request.contents):
        if c.role == "tool" and not c.tool_call_id:
            v.append(FieldViolation(f"contents[{i}].tool_call_id", "a tool turn names the call it answers"))
        if c.tool_calls and c.role != "assistant":
            v.append(FieldViolation(f"contents[{i}].tool_calls", "only an assistant turn carries tool calls"))
        for j, part in enumerate(c.parts):
            if part.WhichOneof("kind") not in ("text", None):
                v.append(FieldViolation(f"contents[{i}].parts[{j}]", "with tools, turns take text parts only"))
        for j, call in enumerate(c.tool_calls):
            try:
                load_json(call.arguments or "{}")
            except ValueError as exc:
                v.append(FieldViolation(f"contents[{i}].tool_calls[{j}].arguments", str(exc)))
    if fmt is MISTRAL:
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
        added = _added_tokens(tokenizer)
        text = _grammar(fmt, allowed, mode, parallel and choice not in calls, python_tag, added)
        result.grammar = GrammarSpec("tools", text)
    return result


# tokenizer -> (its size with added tokens, its added tokens): get_added_vocab() took 1.7 ms with 1,000 of them
_ADDED: weakref.WeakKeyDictionary[Any, tuple[int, dict[str, int]]] = weakref.WeakKeyDictionary()


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (text -> id), cached per tokenizer; {} for one without them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "get_added_vocab"):
        return {}
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _ADDED.get(tokenizer)
    if cached is None or cached[0] != size:
        cached = (size, dict(tokenizer.get_added_vocab()))
        _ADDED[tokenizer] = cached
    return cached[1]


def messages(contents: list[content_pb2.Content]) -> list[dict]:
    """The conversation as chat-template messages, with assistant tool calls and tool results."""
    out = []
    for c in contents:
        text = "\n".join(p.text for p in c.parts if p.WhichOneof("kind") == "text")
        message: dict[str, Any] = {"role": c.role or "user", "content": text}
        if c.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")},
                }
                for call in c.tool_calls
            ]
        if c.role == "tool":
            message["tool_call_id"] = c.tool_call_id
        out.append(message)
    return out


def prompt_ids(
    tokenizer: Any,
    contents: list[content_pb2.Content],
    tool_plan: ToolPlan,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    msgs = messages(contents)
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


async def constrain(tool_plan: ToolPlan | None, params: Any, engine: Any) -> None:
    """Set params.constraint_factory from the tool grammar (compiled off the loop by the model's grammar worker)."""
    if tool_plan is not None and tool_plan.fmt is MISTRAL and tool_plan.parses_calls:
        # `[TOOL_CALLS]` is a special token: decoded as usual it left the text, and the calls showed as content
        params.skip_special_tokens = False
    if tool_plan is not None and tool_plan.grammar is not None:
        from omnivox.services.structured import compiler_for

        compiler = compiler_for(engine)
        try:
            params.constraint_factory = await compiler.factory(tool_plan.grammar)
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
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
            message = llguidance.LLMatcher.validate_grammar(grammar)
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
