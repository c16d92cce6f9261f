"""The OpenAI Realtime GA wire format: ids, the error event and the objects server events carry (the shapes of the
openai SDK's openai/types/realtime/: every server event is a JSON object with `type` and a fresh `event_id`)."""

from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `event_...`, `item_...`, `resp_...`, `sess_...`, `call_...`."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeError(Exception):
    """A client event the session refuses: becomes one `error` event (with the event_id it answers); the session
    goes on. `code` follows OpenAI's (invalid_value, unknown_parameter, ...), `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.code, self.kind = message, param, code, kind


def error_event(err: RealtimeError, event_id: str | None) -> Event:
    return {
        "type": "error",
        "error": {"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                  "event_id": event_id},
    }  # fmt: skip


def typed(obj: dict[str, Any], key: str, kinds: tuple[type, ...], what: str, param: str) -> Any:
    """obj[key] when it is one of `kinds` (None when absent); RealtimeError naming `param` otherwise."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RealtimeError(f"{param} must be {what}", param)
    return value


def an_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object", param)
    return value


def audio_format(kind: str) -> dict[str, Any]:
    """The wire form of an audio format: pcm16 is 24 kHz, G.711 8 kHz."""
    return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}


def usage(prompt: int = 0, output: int = 0, cached: int = 0) -> dict[str, Any]:
    return {
        "total_tokens": prompt + output,
        "input_tokens": prompt,
        "output_tokens": output,
        "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": cached},
        "output_token_details": {"text_tokens": output, "audio_tokens": 0},
    }
