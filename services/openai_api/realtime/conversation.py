"""The conversation a session keeps: its items in the wire form (OpenAI's `realtime.item`s), and that list as the
chat messages the text model reads each turn (the same list again plus the new turn: the prefix cache keeps the
earlier turns' KV blocks, so each response prefills only what is new).

An assistant item spoken aloud keeps when each clause played (`Spoken`), so `conversation.item.truncate`
(audio_end_ms: what the client played before the user cut in) trims its transcript to the clauses heard, the clause
playing at that moment cut in proportion at a word boundary: the next turn's context holds what the user heard.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from omnivox.services.openai_api.realtime.protocol import RealtimeError, an_object, new_id, typed

Item = dict[str, Any]
_USER_PARTS = ("input_text", "input_audio")
_ASSISTANT_PARTS = ("output_text", "output_audio", "text", "audio")


@dataclass
class Spoken:
    """An assistant item's audio: (start_ms, end_ms, text) of each clause, in order."""

    clauses: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return self.clauses[-1][1] if self.clauses else 0.0

    def heard(self, audio_end_ms: float) -> str:
        out = []
        for start, end, text in self.clauses:
            if end <= audio_end_ms:
                out.append(text)
            elif start < audio_end_ms:
                cut = round(len(text) * (audio_end_ms - start) / max(end - start, 1e-9))
                space = text.rfind(" ", 0, cut + 1)
                if space > 0:
                    out.append(text[:space])
                break
        return " ".join(out)


def check_item(raw: Any) -> Item:
    """A conversation.item.create's item, checked, with an id and status; RealtimeError naming the field."""
    item = copy.deepcopy(an_object(raw, "item"))
    kind = item.get("type", "message")
    item.setdefault("id", new_id("item"))
    typed(item, "id", (str,), "a string", "item.id")
    item.update(object="realtime.item", type=kind, status="completed")
    if kind == "message":
        role = item.get("role")
        allowed = {"user": _USER_PARTS, "system": ("input_text",), "assistant": _ASSISTANT_PARTS}.get(role)
        if allowed is None:
            raise RealtimeError("item.role must be user, assistant or system", "item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise RealtimeError("item.content must be a non-empty list of content parts", "item.content")
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in allowed:
                raise RealtimeError(f"a {role} item's content parts are {', '.join(allowed)}", f"item.content[{i}]")
            if part["type"] in ("input_audio",):
                part.setdefault("transcript", None)
            elif part["type"] in ("input_text", "output_text", "text"):
                typed(part, "text", (str,), "a string", f"item.content[{i}].text")
        return item
    if kind == "function_call":
        for key in ("name", "call_id", "arguments"):
            if not isinstance(item.get(key), str):
                raise RealtimeError(f"a function_call item needs {key} (a string)", f"item.{key}")
        return item
    if kind == "function_call_output":
        for key in ("call_id", "output"):
            if not isinstance(item.get(key), str):
                raise RealtimeError(f"a function_call_output item needs {key} (a string)", f"item.{key}")
        return item
    raise RealtimeError("item.type must be message, function_call or function_call_output", "item.type")


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []
        self.spoken: dict[str, Spoken] = {}

    def find(self, item_id: Any, param: str = "item_id") -> Item:
        for item in self.items:
            if item["id"] == item_id:
                return item
        raise RealtimeError(f"no item with id {item_id!r} in the conversation", param, code="item_not_found")

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (None: at the end; "root": first); the id of the item before it."""
        if any(i["id"] == item["id"] for i in self.items):
            raise RealtimeError(f"an item with id {item['id']!r} is already in the conversation", "item.id")
        if previous_item_id is None:
            index = len(self.items)
        elif previous_item_id == "root":
            index = 0
        else:
            index = self.items.index(self.find(previous_item_id, "previous_item_id")) + 1
        self.items.insert(index, item)
        return self.items[index - 1]["id"] if index > 0 else None

    def last_id(self) -> str | None:
        return self.items[-1]["id"] if self.items else None

    def delete(self, item_id: Any) -> None:
        self.items.remove(self.find(item_id))
        self.spoken.pop(item_id, None)

    def truncate(self, item_id: Any, content_index: Any, audio_end_ms: Any) -> None:
        item = self.find(item_id)
        if item.get("role") != "assistant":
            raise RealtimeError("only an assistant message's audio can be truncated", "item_id")
        content = item["content"]
        if not isinstance(content_index, int) or not 0 <= content_index < len(content):
            raise RealtimeError("content_index names no content part of the item", "content_index")
        part = content[content_index]
        spoken = self.spoken.get(item_id)
        if part.get("type") != "output_audio" or spoken is None:
            raise RealtimeError("that content part holds no audio", "content_index")
        if not isinstance(audio_end_ms, int) or isinstance(audio_end_ms, bool) or audio_end_ms < 0:
            raise RealtimeError("audio_end_ms must be a non-negative integer", "audio_end_ms")
        if audio_end_ms > spoken.ms + 1:
            raise RealtimeError(f"audio_end_ms {audio_end_ms} is past the audio's end ({spoken.ms:.0f} ms)",
                                "audio_end_ms")  # fmt: skip
        part["transcript"] = spoken.heard(audio_end_ms)
        spoken.clauses = [c for c in spoken.clauses if c[0] < audio_end_ms]

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        """The chat messages of /v1/chat/completions (services/openai_api/openai_request.py) for the items so far."""
        out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        for item in self.items:
            kind = item["type"]
            if kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            elif (text := item_text(item)) or item["role"] != "user":
                out.append({"role": item["role"], "content": text})
        return out


def item_text(item: Item) -> str:
    """A message item's words: its text parts and audio transcripts, joined."""
    texts = [p.get("text") or p.get("transcript") or "" for p in item.get("content", ())]
    return " ".join(t.strip() for t in texts if t and t.strip())


def function_call_item(call_id: str, name: str, arguments: str) -> Item:
    return {"id": new_id("item"), "object": "realtime.item", "type": "function_call", "status": "completed",
            "call_id": call_id, "name": name, "arguments": arguments}  # fmt: skip


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
