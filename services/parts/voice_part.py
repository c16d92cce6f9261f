"""The speech side of a non-autoregressive voice model (models/voice/: hibari, Piper): no engine, no codec; the
voice's phonemizer and ONNX runs happen in this part's worker threads, off the event loop.

A bundle with a VoicePart has no engine (services/parts/bundle.py); services/calls/voice_speech.py serves its SpeechService
RPCs. Threads: WORKER_THREADS runs at once, each with one onnxruntime thread, so the runs of concurrent requests
share the cores without oversubscribing them (8 concurrent hibari requests on 2 cores: see benchmarks/voices.py).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from omnivox.models.voice import VoiceModel

T = TypeVar("T")

WORKER_THREADS = max(1, min(4, os.cpu_count() or 1))


def is_voice_path(path: Path | None) -> bool:
    """A Piper voice (folder or .onnx next to its .onnx.json) or an unpacked hibari-tts wheel."""
    from omnivox.models.voice.loading import voice_family

    return path is not None and voice_family(path) is not None


@dataclass
class VoicePart:
    voice: VoiceModel
    threads: int = WORKER_THREADS
    executor: ThreadPoolExecutor = field(init=False)

    running: int = field(init=False, default=0)  # calls in flight (the step arbiter reads it from engine threads)

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix=f"voice-{self.voice.family}")

    def has_unfinished(self) -> bool:
        """Work in flight: a stream of this voice behind its deadline makes the engines wait (engine/arbiter.py)."""
        return self.running > 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a worker thread. A cancelled caller stops waiting at once; the run in progress (one
        utterance, tens of ms) finishes on its own and its result is dropped."""
        loop = asyncio.get_running_loop()
        self.running += 1  # on the event loop's thread only
        try:
            return await loop.run_in_executor(self.executor, functools.partial(fn, *args))
        finally:
            self.running -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def check_voice_path(path: Path) -> None:
    """At start-up, before anything loads: ModelLoadError (one line) when the voice cannot run here (a Piper voice
    that phonemizes with espeak-ng on a machine without it, a config missing a key)."""
    from omnivox.models.voice.espeak import EspeakMissing, find_espeak
    from omnivox.models.voice.piper_config import PiperConfig, find_piper_voice
    from omnivox.services.errors import ModelLoadError

    found = find_piper_voice(path)
    if found is None:
        return
    try:
        if PiperConfig.load(found[1]).phoneme_type == "espeak":
            find_espeak()
    except (EspeakMissing, ValueError) as exc:
        raise ModelLoadError(f"cannot serve {path}: {exc}") from None


def load_voice_part(path: Path) -> VoicePart:
    """The voice at `path` in its worker (blocking). ValueError / RuntimeError with a one-line reason."""
    import numpy as np

    from omnivox.models.voice.loading import load_voice
    from omnivox.models.voice.voice_model import VoiceSettings

    voice = load_voice(path)
    # One run now: a session's first run is the slowest (hibari, one sentence: 0.24 s, then 0.17 and 0.14 s, on 2
    # busy cores), which the first request's time to first audio would otherwise pay.
    for utterance in voice.utterances("Warm up.")[:1]:
        voice.render(utterance, VoiceSettings(voice.default_voice), np.random.default_rng(0))
    return VoicePart(voice)
