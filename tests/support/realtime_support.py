"""Shared by the realtime test modules: a realtime session's URL on a ServerThread, running a client coroutine, the
engines left idle, the server's metric values."""

from __future__ import annotations

import asyncio

from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME
from support.service_harness import nothing_left

QUESTION = "What is the capital of France?"
BRIEF = "Answer in one short sentence."
TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "instructions": BRIEF, "temperature": 0}
STORY = {"type": "message", "role": "user", "content": [{"type": "input_text", "text":
         "Tell me a long story about a dragon who learns to bake bread, with many details."}]}  # fmt: skip


def url(server) -> str:
    return f"ws://127.0.0.1:{server.server.http_port}/v1/realtime?model={DEFAULT_MODEL_NAME}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def engine_idle(server) -> None:
    """No engine request or KV block of any model held (text model and Whisper)."""
    for name in (DEFAULT_MODEL_NAME, "whisper-base"):
        nothing_left(server, name)


def metric_values(server) -> dict[str, float]:
    """The server's Prometheus exposition (what /metrics serves), as {series: value}."""
    from prometheus_client import generate_latest

    text = generate_latest(server.server.metrics.registry).decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
