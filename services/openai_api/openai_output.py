"""GenerateResponses (services/calls/generate_call.py) -> OpenAI's JSON: chat.completion(.chunk) and text_completion objects,
finish reasons and usage as OpenAI reports them."""

from __future__ import annotations

import time
from typing import Any

from omnivox.v1 import generation_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    generation_pb2.FINISH_REASON_ABORT: "stop",
}


def usage(summary: generation_pb2.GenerateSummary) -> dict[str, Any]:
    u = summary.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(delta: generation_pb2.GenerateDelta) -> dict[str, Any] | None:
    if not delta.logprobs:
        return None
    content = [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": _token_bytes(lp.token),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)} for t in lp.top_logprobs
            ],  # fmt: skip
        }
        for lp in delta.logprobs
    ]
    return {"content": content}


def completion_logprobs(delta: generation_pb2.GenerateDelta, offset: int) -> dict[str, Any] | None:
    if not delta.logprobs:
        return None
    offsets, position = [], offset
    for lp in delta.logprobs:
        offsets.append(position)
        position += len(lp.token)
    return {
        "tokens": [lp.token for lp in delta.logprobs],
        "token_logprobs": [lp.logprob for lp in delta.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in delta.logprobs],
        "text_offset": offsets,
    }


def tool_call_deltas(delta: generation_pb2.GenerateDelta) -> list[dict[str, Any]]:
    """A call's first delta carries its id and name (then type: function), later ones more of its arguments."""
    out = []
    for call in delta.tool_calls:
        item: dict[str, Any] = {"index": call.index}
        function: dict[str, Any] = {"arguments": call.arguments}
        if call.id:
            item.update(id=call.id, type="function")
        if call.name:
            function["name"] = call.name
        item["function"] = function
        out.append(item)
    return out


class ChatOutput:
    """One chat completion's objects: `chunk(delta)` / `final_chunks(summary)` when streamed, else `add(delta)` then
    `completion(summary)`."""

    def __init__(self, request_id: str, model: str, completion: bool = False) -> None:
        self.id = ("cmpl-" if completion else "chatcmpl-") + request_id
        self.model, self.created, self.is_completion = model, int(time.time()), completion
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.completion_logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                     "text_offset": []}  # fmt: skip
        self.offset = 0
        self.role_sent = False

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, delta: generation_pb2.GenerateDelta) -> dict[str, Any] | None:
        if self.is_completion:
            logprobs = completion_logprobs(delta, self.offset)
            self.offset += len(delta.text)
            choice = {"index": 0, "text": delta.text, "logprobs": logprobs, "finish_reason": None}
            return self._object("text_completion", [choice])
        if self.role_sent and not (delta.text or delta.reasoning_text or delta.tool_calls or delta.logprobs):
            return None  # a token without text (the end token): no chunk, as OpenAI sends none
        message: dict[str, Any] = {}
        if not self.role_sent:
            message["role"], self.role_sent = "assistant", True
        if delta.text or not message:
            message["content"] = delta.text
        if delta.reasoning_text:
            message["reasoning_content"] = delta.reasoning_text
        if delta.tool_calls:
            message["tool_calls"] = tool_call_deltas(delta)
        choice = {"index": 0, "delta": message, "logprobs": chat_logprobs(delta), "finish_reason": None}
        return self._object("chat.completion.chunk", [choice])

    def final_chunks(self, summary: generation_pb2.GenerateSummary, include_usage: bool) -> list[dict[str, Any]]:
        reason = FINISH_REASONS.get(summary.finish_reason, "stop")
        if self.is_completion:
            last = self._object(
                "text_completion", [{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}]
            )
        else:
            last = self._object("chat.completion.chunk", [{"index": 0, "delta": {}, "logprobs": None,
                                                           "finish_reason": reason}])  # fmt: skip
        chunks = [last]
        if include_usage:
            kind = "text_completion" if self.is_completion else "chat.completion.chunk"
            chunks.append({**self._object(kind, []), "usage": usage(summary)})
        return chunks

    def add(self, delta: generation_pb2.GenerateDelta) -> None:
        self.text.append(delta.text)
        self.reasoning.append(delta.reasoning_text)
        if self.is_completion:
            if (lp := completion_logprobs(delta, self.offset)) is not None:
                for key, values in lp.items():
                    self.completion_logprobs[key].extend(values)
            self.offset += len(delta.text)
        elif (lp := chat_logprobs(delta)) is not None:
            self.logprobs.extend(lp["content"])

    def completion(self, summary: generation_pb2.GenerateSummary, logprobs: bool) -> dict[str, Any]:
        reason = FINISH_REASONS.get(summary.finish_reason, "stop")
        text = "".join(self.text)
        if self.is_completion:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs if logprobs else None,
                      "finish_reason": reason}  # fmt: skip
            return {**self._object("text_completion", [choice]), "usage": usage(summary)}
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not summary.tool_calls else None}
        if reasoning := "".join(self.reasoning):
            message["reasoning_content"] = reasoning
        if summary.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in summary.tool_calls
            ]
        choice = {"index": 0, "message": message, "logprobs": {"content": self.logprobs} if logprobs else None,
                  "finish_reason": reason}  # fmt: skip
        return {**self._object("chat.completion", [choice]), "usage": usage(summary)}
