"""Session audio in and out: the wire formats (pcm16 24 kHz, G.711 mu-law / A-law 8 kHz, base64 in JSON) <-> float32.

In: `InputAudio.feed(b64)` -> float32 mono at 16 kHz (what the detector and Whisper read), through the streaming
decoder of StreamingTranscribe (codecs/audio_stream_input.py). Out: `OutputAudio.encode(pcm)` takes the voice's
float32 at its own rate (hibari: 24 kHz) -> the session's output format bytes, resampled as it streams.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from omnivox.codecs.audio_format import AudioEncoding, AudioStreamEncoder
from omnivox.codecs.audio_stream_input import StreamingAudioDecoder
from omnivox.codecs.g711_alaw import alaw_to_int16, int16_to_alaw
from omnivox.services.openai_api.realtime.protocol import RealtimeError

WHISPER_RATE = 16000
RATES = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}


def decode_base64(text: object, param: str) -> bytes:
    if not isinstance(text, str):
        raise RealtimeError(f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{param} is not valid base64", param) from None


class InputAudio:
    """One format's bytes -> 16 kHz float32, chunk by chunk (a dangling odd pcm16 byte waits for the next chunk)."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        encoding = AudioEncoding.MULAW if fmt == "audio/pcmu" else AudioEncoding.LINEAR16
        self.decoder = StreamingAudioDecoder(encoding, RATES[fmt], WHISPER_RATE)

    def feed(self, data: bytes) -> np.ndarray:
        if self.format == "audio/pcma":
            data = alaw_to_int16(np.frombuffer(data, np.uint8)).tobytes()
        return self.decoder.feed(data)

    def bytes_per_second(self) -> int:
        return RATES[self.format] * (2 if self.format == "audio/pcm" else 1)


class OutputAudio:
    """The voice's float32 at `source_rate` -> the output format's bytes; `ms` counts what was encoded."""

    def __init__(self, fmt: str, source_rate: int) -> None:
        self.format = fmt
        encoding = AudioEncoding.MULAW if fmt == "audio/pcmu" else AudioEncoding.LINEAR16
        self.encoder = AudioStreamEncoder(encoding, RATES[fmt], source_rate=source_rate)

    def _wire(self, data: bytes) -> bytes:
        if self.format == "audio/pcma" and data:
            return int16_to_alaw(np.frombuffer(data, "<i2")).tobytes()
        return data

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._wire(self.encoder.encode(pcm))

    def finish(self) -> bytes:
        return self._wire(self.encoder.finish())

    def close(self) -> None:
        self.encoder.close()

    @property
    def ms(self) -> float:
        return self.encoder.samples_out * 1000 / RATES[self.format]
