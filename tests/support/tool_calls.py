"""Tool-call fixtures shared by the tool, Mistral and reasoning tests: the weather / time tools and their schemas,
`feed` (the parser fed a text in chunks of any size), `run` (a Generate stream gathered into text, calls and summary)."""

from __future__ import annotations

import json

from omnivox.services.output import tool_parser
from omnivox.v1 import generation_pb2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer"}},
    "required": ["zone"],
    "additionalProperties": False,
}


TOOLS = [
    generation_pb2.Tool(
        name="get_weather", description="Weather now", parameters_json_schema=json.dumps(WEATHER), strict=True
    ),
    generation_pb2.Tool(name="get_time", description="Time now", parameters_json_schema=json.dumps(TIME), strict=True),
]


SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def feed(fmt: tool_parser.ToolFormat, text: str, chunk: int) -> tuple[str, dict[int, tuple[str, str]], list]:
    stream = tool_parser.ToolCallStream(fmt)
    content, calls = "", {}
    for end in [*range(chunk, len(text), chunk), len(text)]:
        c, deltas = stream.update(text[:end])
        content += c
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + d.name, args + d.arguments)
    c, deltas = stream.update(text, final=True)
    content += c
    for d in deltas:
        name, args = calls.get(d.index, ("", ""))
        calls[d.index] = (name + d.name, args + d.arguments)
    done = [(c.name, c.arguments) for c in stream.complete_calls(text)]
    return content, calls, done


def run(stub, request) -> tuple[str, dict[int, list[str]], generation_pb2.GenerateSummary]:
    text, calls, summary = "", {}, None
    for response in stub.Generate(request):
        if response.WhichOneof("response") == "delta":
            text += response.delta.text
            for d in response.delta.tool_calls:
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] += d.id
                entry[1] += d.name
                entry[2] += d.arguments
        else:
            summary = response.summary
    assert summary is not None
    return text, calls, summary
