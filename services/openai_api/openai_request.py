"""OpenAI JSON -> the wire GenerateRequest the gRPC front takes, so both fronts share one request processing
(services/calls/generate_call.py). A value the JSON itself gets wrong raises INVALID_ARGUMENT naming the OpenAI parameter;
what generate_request's checks refuse names a GenerateRequest field, which `openai_param` maps back.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.v1 import content_pb2, generation_pb2

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_AUDIO_FORMATS = {"wav": content_pb2.AUDIO_ENCODING_WAV, "flac": content_pb2.AUDIO_ENCODING_FLAC}
_TOOL_MODES = {
    "auto": generation_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": generation_pb2.TOOL_CHOICE_MODE_NONE,
    "required": generation_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
# Sampling fields: OpenAI's, then the extra ones vLLM's server also takes (top_k, min_p, repetition_penalty).
_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")


def bad(param: str, description: str) -> errors.ServiceError:
    return errors.invalid_argument([FieldViolation(param, description)])


def _typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(key, f"must be {what}, not {json.dumps(value)[:80]}")
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    return _typed(body, key, (int, float), "a number")


def _integer(body: dict[str, Any], key: str) -> int | None:
    return _typed(body, key, (int,), "an integer")


MAX_CHOICES = 8  # n: one engine request per choice, all at once (the prompt's blocks shared by the prefix cache)


def choices(body: dict[str, Any]) -> int:
    """`n`, the number of choices: 1 to MAX_CHOICES, and 1 when streamed."""
    n = _integer(body, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"must be in [1, {MAX_CHOICES}], not {n}")
    if n > 1 and body.get("stream") is True:
        raise bad("n", "n > 1 is served without stream only: send n streamed requests instead")
    return n


def chat_request(body: dict[str, Any]) -> generation_pb2.GenerateRequest:
    """A /v1/chat/completions body as a GenerateRequest."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    request = _common(body)
    request.contents.extend(_content(m, f"messages[{i}]") for i, m in enumerate(messages))
    if (fmt := body.get("response_format")) is not None:
        _response_format(request, fmt)
    if (tools := body.get("tools")) is not None:
        _tools(request, tools)
    if (choice := body.get("tool_choice")) is not None:
        _tool_choice(request, choice)
    if (parallel := _typed(body, "parallel_tool_calls", (bool,), "true or false")) is not None:
        request.parallel_tool_calls = parallel
    if _typed(body, "logprobs", (bool,), "true or false"):
        request.logprobs = True
        if (top := _integer(body, "top_logprobs")) is not None:
            request.top_logprobs = top
    elif body.get("top_logprobs"):
        raise bad("top_logprobs", "needs logprobs: true")
    if (max_tokens := _integer(body, "max_completion_tokens")) is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None:
        request.max_output_tokens = max_tokens
    return request


def completion_request(body: dict[str, Any]) -> tuple[generation_pb2.GenerateRequest, str]:
    """A /v1/completions body as a GenerateRequest (its prompt in one user turn, for the checks) and the raw prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be one non-empty string (token-id prompts and batches of prompts are not served)")
    if _typed(body, "echo", (bool,), "true or false"):
        raise bad("echo", "echo is not served")
    request = _common(body)
    request.contents.append(content_pb2.Content(role="user", parts=[content_pb2.Part(text=prompt)]))
    if (logprobs := _integer(body, "logprobs")) is not None:
        request.logprobs = True
        request.top_logprobs = logprobs
    request.max_output_tokens = 16 if (max_tokens := _integer(body, "max_tokens")) is None else max_tokens  # OpenAI's
    return request, prompt


def _common(body: dict[str, Any]) -> generation_pb2.GenerateRequest:
    model = _typed(body, "model", (str,), "a model name")
    request = generation_pb2.GenerateRequest(model=model or "")
    choices(body)  # checked here; the HTTP front runs that many requests
    for key in _SAMPLING:
        if (value := (_integer if key == "top_k" else _number)(body, key)) is not None:
            setattr(request.sampling, key, value)
    if (seed := _integer(body, "seed")) is not None:
        request.sampling.seed = seed
    if (bias := body.get("logit_bias")) is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias", "must be an object of token id -> bias")
        for token, value in bias.items():
            if (
                not re.fullmatch(r"-?\d{1,10}", str(token))
                or isinstance(value, bool)
                or not isinstance(value, int | float)
            ):
                raise bad("logit_bias", f"{json.dumps(token)}: keys are token ids, values numbers")
            request.sampling.logit_bias[int(token)] = float(value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "must be a string or a list of strings")
        request.stop_sequences.extend(stop)
    if (min_tokens := _integer(body, "min_tokens")) is not None:
        request.min_output_tokens = min_tokens
    request.ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "true or false"))
    request.cache_salt = _typed(body, "cache_salt", (str,), "a string") or ""
    return request


def _content(message: Any, param: str) -> content_pb2.Content:
    if not isinstance(message, dict):
        raise bad(param, "must be an object with a role and a content")
    role = _ROLES.get(message.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise bad(f"{param}.role", f"must be one of {', '.join(_ROLES)}, not {json.dumps(message.get('role'))[:40]}")
    content = content_pb2.Content(role=role, tool_call_id=message.get("tool_call_id") or "")
    body = message.get("content")
    if isinstance(body, str):
        content.parts.append(content_pb2.Part(text=body))
    elif isinstance(body, list):
        content.parts.extend(_part(p, f"{param}.content[{i}]") for i, p in enumerate(body))
    elif body is not None or role != "assistant":
        raise bad(f"{param}.content", "must be a string or a list of content parts")
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{param}.tool_calls[{i}]", "must be {'id', 'type': 'function', 'function': {name, arguments}}")
        arguments = function.get("arguments", "")
        content.tool_calls.append(
            content_pb2.ToolCall(
                id=call.get("id") or "",
                name=function["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return content


def _part(part: Any, param: str) -> content_pb2.Part:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return content_pb2.Part(text=part["text"])
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise bad(f"{param}.image_url.url", "must be a data: URL")
        match = re.fullmatch(r"data:([\w./+-]+)?(;[^,]*)?,(.*)", url, flags=re.S)
        if match is None:
            raise bad(
                f"{param}.image_url.url", "only data: URLs are served (the server fetches nothing from the network)"
            )
        mime, data = match.group(1) or "", _base64(match.group(3), f"{param}.image_url.url")
        return content_pb2.Part(image=content_pb2.ImagePart(data=data, mime_type=mime))
    if kind == "input_audio":
        audio = part.get("input_audio") if isinstance(part.get("input_audio"), dict) else {}
        encoding = _AUDIO_FORMATS.get(audio.get("format"))
        if encoding is None:
            raise bad(f"{param}.input_audio.format", f"must be one of {', '.join(_AUDIO_FORMATS)}")
        data = _base64(audio.get("data"), f"{param}.input_audio.data")
        return content_pb2.Part(audio=content_pb2.AudioPart(data=data, encoding=encoding))
    raise bad(param, "must be a text, image_url or input_audio part")


def _base64(text: Any, param: str) -> bytes:
    try:
        return base64.b64decode(text if isinstance(text, str) else "", validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, "is not valid base64") from None


def _response_format(request: generation_pb2.GenerateRequest, fmt: Any) -> None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        request.response_format.json_schema = '{"type": "object"}'
        return
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema", "must be a JSON schema object")
        request.response_format.json_schema = json.dumps(schema)
        return
    raise bad("response_format", "type must be text, json_object or json_schema")


def _tools(request: generation_pb2.GenerateRequest, tools: Any) -> None:
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of {'type': 'function', 'function': {...}}")
    for i, tool in enumerate(tools):
        function = (
            tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        )
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        parameters = function.get("parameters")
        request.tools.append(
            generation_pb2.Tool(
                name=function["name"],
                description=function.get("description") or "",
                parameters_json_schema=json.dumps(parameters) if parameters is not None else "",
                strict=bool(function.get("strict")),
            )
        )


def _tool_choice(request: generation_pb2.GenerateRequest, choice: Any) -> None:
    if isinstance(choice, str) and choice in _TOOL_MODES:
        request.tool_choice.mode = _TOOL_MODES[choice]
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad("tool_choice", "must be auto, none, required or {'type': 'function', 'function': {'name': ...}}")
    request.tool_choice.function_name = function["name"]


# GenerateRequest field paths (what generate_request's checks name) -> OpenAI parameters, first match wins.
_PARAMS = (
    (r"^contents\[(\d+)\]\.parts\[(\d+)\]\.image", r"messages[\1].content[\2].image_url"),
    (r"^contents\[(\d+)\]\.parts\[(\d+)\]\.audio", r"messages[\1].content[\2].input_audio"),
    (r"^contents\[(\d+)\]\.parts\[(\d+)\]", r"messages[\1].content[\2]"),
    (r"^contents", "messages"),
    (r"^sampling\.", ""),
    (r"^max_output_tokens", "max_tokens"),
    (r"^min_output_tokens", "min_tokens"),
    (r"^stop_sequences", "stop"),
    (r"^tools\[(\d+)\]\.parameters_json_schema", r"tools[\1].function.parameters"),
    (r"^tools\[(\d+)\]\.", r"tools[\1].function."),
    (r"^tool_choice\..*", "tool_choice"),
    (r"^response_format\.json_schema", "response_format.json_schema.schema"),
)


def openai_param(field: str, completion: bool = False) -> str:
    """The OpenAI parameter a GenerateRequest field path came from."""
    if completion and field.startswith("contents"):
        return "prompt"
    for pattern, replacement in _PARAMS:
        if re.match(pattern, field):
            return re.sub(pattern, replacement, field)
    return field
