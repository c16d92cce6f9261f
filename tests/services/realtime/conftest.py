"""The realtime tests' server: the embedded defaults (SmolLM2-135M, hibari, whisper-base) with the HTTP front, one per
test module; and the question spoken by hibari (pcm16 24 kHz)."""

from __future__ import annotations

import pytest
from support.realtime_support import QUESTION
from support.service_harness import ServerThread

from omnivox.benchmarks.realtime_sessions import synthesize_pcm16
from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME, ensure_default_voice, ensure_default_whisper
from omnivox.services.parts.model_spec import EngineOptions, ModelSpec


@pytest.fixture(scope="module")
def server(default_gguf):
    try:
        ensure_default_voice()
        ensure_default_whisper(progress=False)
    except RuntimeError as exc:
        pytest.skip(f"the embedded voice or whisper-base cannot be fetched: {exc}")
    specs = [ModelSpec(path=default_gguf, name=DEFAULT_MODEL_NAME), ModelSpec(path=None, voice=True),
             ModelSpec(path=None, asr=True)]  # fmt: skip
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.1, device="cpu"), http_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def question_pcm(server) -> bytes:
    return synthesize_pcm16(server.channel(), QUESTION)
