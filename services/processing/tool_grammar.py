"""The grammars that constrain a model's own tool-call format (llguidance Lark, the call object as an embedded `%json`
schema per tool), for services/processing/tools.py:
- `required` / a named function: the output is one (or, with parallel_tool_calls, up to MAX_PARALLEL_CALLS) calls
  from the first token.
- `auto`: free text that never contains the opening tag, or free text up to the tag (a lazy lexeme) and then calls:
  the grammar is armed only by the tag. Llama's `auto` arms on a `{` (or the python tag) at the start of the output,
  Mistral v0.3's on its tag at the start (where v0.3 writes its calls), Mistral v11+'s on its tag anywhere.
- `none`: free text that never contains the opening tag (Hermes), so a call can never appear.
A tag that is one of the tokenizer's added tokens is written by its token id (`_tag`).
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

import llguidance

from omnivox.services.output.tool_parser import ToolFormat

AUTO, NONE, REQUIRED = "auto", "none", "required"
# Calls one answer may make. Unbounded, a small model at temperature 0 repeated the same call until the context was
# full (8,000 tokens, minutes) on `tool_choice: required` with no max_output_tokens; after this many only the end of
# the message is allowed.
MAX_PARALLEL_CALLS = 16
# Separators as the chat templates' tojson writes them, with no other whitespace: what the model saw, and bounded.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# tokenizer -> (its size with added tokens, its added tokens): get_added_vocab() took 1.7 ms with 1,000 of them
_ADDED: weakref.WeakKeyDictionary[Any, tuple[int, dict[str, int]]] = weakref.WeakKeyDictionary()


def added_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (text -> id), cached per tokenizer; {} for one without them. A Tekken tokenizer's
    (Voxtral's, through mistral_common) are its special tokens: `[TOOL_CALLS]` was written as a text literal, which a
    special token never matches, so the grammar masked the model's own tag (id 9) and made it spell the tag in bytes."""
    from omnivox.engine.structured import tekkenizer

    if (tekken := tekkenizer(tokenizer)) is not None:
        if tokenizer not in _ADDED:
            _ADDED[tokenizer] = (0, {tekken.id_to_piece(i): i for i in range(tekken.num_special_tokens)})
        return _ADDED[tokenizer][1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "get_added_vocab"):
        return {}
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _ADDED.get(tokenizer)
    if cached is None or cached[0] != size:
        cached = (size, dict(tokenizer.get_added_vocab()))
        _ADDED[tokenizer] = cached
    return cached[1]


def call_schema(fmt: ToolFormat, name: str, params: dict, strict: bool) -> dict:
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


def grammar(
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
    if fmt.named:
        return _named_grammar(fmt, calls, choice, parallel, added)
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
    schema["x-guidance"] = JSON_STYLE
    return f"%json {json.dumps(schema)}"


def _array_grammar(fmt: ToolFormat, calls: list[dict], choice: str, parallel: bool, added: dict[str, int]) -> str:
    """Mistral: `[TOOL_CALLS] [call, call]`, the list opened as its template writes it back (`[TOOL_CALLS] [`)."""
    tag = _tag(fmt.open_tag, added)
    more = f" ({json.dumps(fmt.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    lines = [f'calls: {tag} {json.dumps(fmt.list_open)} call{more} "]"', f"call: {_call_body(fmt, calls)}"]
    # A special token is outside every regex's language: FREE can never write the tag. A plain-text tag is excluded.
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*{re.escape(fmt.open_tag)}.*)/"
    if choice == AUTO:
        lines += ["start: FREE | calls", free]
    elif choice == NONE:
        lines += ["start: FREE", free]
    else:
        lines.append("start: calls")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def _named_grammar(fmt: ToolFormat, calls: list[dict], choice: str, parallel: bool, added: dict[str, int]) -> str:
    """Mistral v11+: `[TOOL_CALLS]name[ARGS]{arguments}` per call, as mistral_common's own grammar has the model
    write them (guidance/grammar_factory.py), without the optional whitespace it allows around them: none is what
    its tokenizer writes the calls back with. `auto` admits text before the first call, as that grammar does."""
    bodies = []
    for c in calls:
        args = {**c["properties"][fmt.args_key], "x-guidance": JSON_STYLE}  # at the root of its own %json: refs hold
        name = c["properties"]["name"]["const"]
        bodies.append(f"{json.dumps(name)} {_tag(fmt.args_tag, added)} %json {json.dumps(args)}")
    body = bodies[0] if len(bodies) == 1 else "(" + " | ".join(f"({b})" for b in bodies) + ")"
    more = f" call{{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    tag = fmt.open_tag
    lines = [f"call_body: {body}", f"call: {_tag(tag, added)} call_body", f"calls: call{more}"]
    free = f"FREE: /(?s:.*)/ & ~/(?s:.*{re.escape(tag)}.*)/"  # a special token is outside every regex's language
    if choice == AUTO and tag in added:
        lines += ["start: FREE | FREE? calls", free]
    elif choice == AUTO:
        lines += [f"start: FREE | lz call_body{more}", free, f"lz[lazy]: /(?s:.*){re.escape(tag)}/"]
    elif choice == NONE:
        lines += ["start: FREE", free]
    else:
        lines.append("start: calls")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))
