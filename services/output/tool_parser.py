"""The tool-call parser: the calls in a model's output text, re-read from the whole text on every update.

`parse` is a pure function of the text, so `ToolCallStream`'s deltas are the same however the text arrived in chunks.
What may still change is held back: a tag that may be starting, and a suffix that may close the call object (its
`}`s, whitespace, a partial closing tag or separator).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field

from omnivox.v1 import content_pb2, generation_pb2


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open_tag: str  # text that starts a call ("" for Llama's bare JSON)
    close_tag: str
    separator: str  # between calls
    args_key: str
    # Mistral's calls are one JSON list after the tag (`[TOOL_CALLS] [{...}, {...}]`), not one tagged object each:
    # what opens the list after the tag, as the template writes it back ("" for the other formats)
    list_open: str = ""
    # Mistral tokenizer v11+ (`[TOOL_CALLS]name[ARGS]{...}`, one tag per call): the special token between the name
    # and the arguments object ("" for the other formats)
    args_tag: str = ""

    @property
    def array(self) -> bool:
        return bool(self.list_open)

    @property
    def named(self) -> bool:
        """Each call is `open_tag name args_tag {arguments}`: the name in the text, not in a JSON object."""
        return bool(self.args_tag)

    @property
    def mistral(self) -> bool:
        """A Mistral format: its tags are special tokens kept in the text, its call ids 9 alphanumerics."""
        return self.array or self.named

    def new_id(self) -> str:
        """A call id in the form the model's chat template takes back: Mistral v0.3's template raises unless an id
        is 9 alphanumerics ("Tool call IDs should be alphanumeric strings with length 9!"), as vLLM makes them."""
        if self.mistral:
            return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
        return "call_" + uuid.uuid4().hex[:24]


_ALPHANUMERIC = string.ascii_letters + string.digits
MISTRAL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")
HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3 = ToolFormat("llama3", "", "", "; ", "parameters")
# Mistral v0.3 (tokenizer v3): `[TOOL_CALLS]` is a special token; its template writes `[TOOL_CALLS] [` + calls + `]`
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "]", ", ", "arguments", list_open=" [")
# Mistral-Nemo's template writes the list with no space: `[TOOL_CALLS][` + calls + `]`
MISTRAL_NEMO = ToolFormat("mistral_nemo", "[TOOL_CALLS]", "]", ", ", "arguments", list_open="[")
# Mistral tokenizer v11 and later (Mistral Small 3.2, Devstral, Magistral, Ministral 3): `[TOOL_CALLS]name[ARGS]{...}`
# per call, all three special tokens, no list and no id in what the model writes (mistral_common's own grammar,
# guidance/grammar_factory.py); v11 writes an earlier call's id back as `name[CALL_ID]id[ARGS]`, which is read too.
MISTRAL_V11 = ToolFormat("mistral_v11", "[TOOL_CALLS]", "", "", "arguments", args_tag="[ARGS]")
CALL_ID_TAG = "[CALL_ID]"


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # what may be streamed so far (complete: the whole arguments JSON text)
    complete: bool
    id: str | None = None  # the id the model wrote (Mistral v11's `[CALL_ID]`), else one is made


def _args_start(body: str, key: str) -> int | None:
    m = re.search(r'"' + key + r'"\s*:\s*', body)
    return m.end() if m else None


def _parse_body(body: str, fmt: ToolFormat, complete: bool) -> ParsedCall:
    m = re.search(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
    name = json.loads(f'"{m.group(1)}"') if m else None
    start = _args_start(body, fmt.args_key)
    if start is None:
        return ParsedCall(name, "", complete)
    raw = body[start:]
    if complete:
        end = raw.rstrip().rfind("}")  # the call object's own closing brace
        return ParsedCall(name, raw[:end].rstrip() if end >= 0 else raw, True)
    return ParsedCall(name, raw.rstrip("} \n\t\r"), False)  # hold back what may close the call object


def parse(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """(content text safe to show, the calls so far) — a pure function of the text."""
    if fmt.array:
        return _parse_array(text, fmt)
    if fmt.named:
        return _parse_named(text, fmt)
    if fmt.open_tag:
        tag, close = fmt.open_tag.strip(), fmt.close_tag.strip()
        first = text.find(tag)
        if first < 0:
            k = _partial_suffix(text, tag)  # hold back a tag that may be starting
            return text[: len(text) - k], []
        # Each call ends where its JSON object does (read outside strings: arguments may hold the tags themselves,
        # '{"text": "use </tool_call>"}', which a search for the closing tag took for the call's end and lost it).
        calls, pos = [], first + len(tag)
        while True:
            end = _object_end(text, pos)
            if end is None:  # still being written
                calls.append(_parse_body(text[pos:], fmt, False))
                break
            closed = text[end:].lstrip().startswith(close)
            calls.append(_parse_body(text[pos:end], fmt, closed))
            following = text.find(tag, end) if closed else -1
            if following < 0:
                break
            pos = following + len(tag)
        return text[:first], calls
    body = text.lstrip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :]
    if not body.lstrip().startswith("{"):
        return (text, []) if body else ("", [])
    calls = []
    pieces = _split_top_level(body, fmt.separator)
    for k, piece in enumerate(pieces):
        done = k < len(pieces) - 1 or _balanced(piece)
        if not done:  # hold back a separator that may be starting
            piece = piece[: len(piece) - _partial_suffix(piece, fmt.separator)]
        calls.append(_parse_body(piece, fmt, done))
    return "", calls


def _parse_array(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """Mistral's `[TOOL_CALLS] [{call}, {call}]`: a call is complete once a `,` or the list's `]` follows it."""
    first = text.find(fmt.open_tag)
    if first < 0:
        return text[: len(text) - _partial_suffix(text, fmt.open_tag)], []
    pos = _skip_space(text, first + len(fmt.open_tag))
    if pos == len(text) or text[pos] != "[":
        return text[:first], []
    calls: list[ParsedCall] = []
    pos += 1
    while True:
        end = _object_end(text, pos)
        if end is None:  # still being written
            if text[pos:].strip():
                calls.append(_parse_body(text[pos:], fmt, False))
            break
        after = _skip_space(text, end)
        closed = after < len(text) and text[after] in ",]"
        calls.append(_parse_body(text[pos:end], fmt, closed))
        if not closed or text[after] == "]":
            break
        pos = after + 1
    return text[:first], calls


def _parse_named(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """Mistral v11+'s `[TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}`: a name is known once its `[ARGS]`
    has come (a name token may still be followed by more of it); the arguments stream as written, and a call is
    complete when its object closes (nothing wraps it: no `}` or `]` to hold back)."""
    first = text.find(fmt.open_tag)
    if first < 0:
        return text[: len(text) - _partial_suffix(text, fmt.open_tag)], []
    calls: list[ParsedCall] = []
    pos = first + len(fmt.open_tag)
    while True:
        args_at = text.find(fmt.args_tag, pos)
        if args_at < 0:  # the name (or its id) is still being written
            break
        head = text[pos:args_at]
        name, _, call_id = head.partition(CALL_ID_TAG)
        call_id = call_id.strip() if MISTRAL_ID.match(call_id.strip()) else ""  # else one in the form is made
        start = _skip_space(text, args_at + len(fmt.args_tag))
        end = _object_end(text, start)
        if end is None:
            calls.append(ParsedCall(name.strip(), text[start:], False, call_id or None))
            break
        calls.append(ParsedCall(name.strip(), text[start:end], True, call_id or None))
        following = text.find(fmt.open_tag, end)
        if following < 0:
            break
        pos = following + len(fmt.open_tag)
    return text[:first], calls


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _balanced(s: str) -> bool:
    """True when `s` is one complete JSON value."""
    try:
        json.loads(s)
        return True
    except json.JSONDecodeError:
        return False
    except RecursionError:  # nested past ~1,000 levels (a model may write that): the brackets tell
        return _closes(s)


def _structure(s: str, start: int = 0) -> Generator[tuple[int, str, int], None, bool]:
    """(index, character, bracket depth after it) for each character of s[start:] outside JSON strings (quotes and
    string contents are skipped; the depth counts `{` and `[` not yet closed). Returns True when s ends in a string."""
    depth, in_str, esc = 0, False, False
    for j in range(start, len(s)):
        ch = s[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        yield j, ch, depth
    return in_str


def _object_end(s: str, start: int) -> int | None:
    """The index just past the JSON object that starts at `start` (after whitespace), or None while it is open."""
    i = start
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    if i == len(s) or s[i] != "{":
        return None
    return next((j + 1 for j, ch, depth in _structure(s, i) if depth == 0 and ch in "}]"), None)


def _closes(s: str) -> bool:
    """True when every bracket that `s` opens outside strings is closed (the grammar made the rest valid JSON)."""
    scan, depth = _structure(s), 0
    while True:
        try:
            _, _, depth = next(scan)
        except StopIteration as end:
            return depth == 0 and not end.value


def _split_top_level(s: str, sep: str) -> list[str]:
    out, last = [], 0
    for i, _, depth in _structure(s):
        if depth == 0 and i >= last and s.startswith(sep, i):
            out.append(s[last:i])
            last = i + len(sep)
    out.append(s[last:])
    return [p for p in out if p.strip()]


@dataclass
class ToolCallStream:
    """Turns the growing output text into content deltas and tool_calls deltas (chunking-independent)."""

    fmt: ToolFormat
    ids: list[str] = field(default_factory=list)
    sent_content: int = 0
    sent_args: list[int] = field(default_factory=list)

    def update(self, text: str, final: bool = False) -> tuple[str, list[generation_pb2.ToolCallDelta]]:
        content, calls = parse(text, self.fmt)
        if final and not calls:
            content = text
        new_content = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                if call.name is None:
                    break  # its name is not complete yet: the call starts in a later delta
                self.ids.append(call.id or self.fmt.new_id())
                self.sent_args.append(0)
                deltas.append(generation_pb2.ToolCallDelta(index=i, id=self.ids[i], name=call.name))
            fragment = call.arguments[self.sent_args[i] :]
            if fragment:
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments = fragment
                else:
                    deltas.append(generation_pb2.ToolCallDelta(index=i, arguments=fragment))
                self.sent_args[i] = len(call.arguments)
        return new_content, deltas

    def complete_calls(self, text: str) -> list[content_pb2.ToolCall]:
        _, calls = parse(text, self.fmt)
        return [
            content_pb2.ToolCall(id=self.ids[i], name=c.name or "", arguments=c.arguments)
            for i, c in enumerate(calls)
            if c.complete and i < len(self.ids)
        ]
