"""openai-whisper's guards against hallucinated text, one window at a time (its `decode_with_fallback` and the
no-speech skip of `transcribe`; transformers' `_need_fallback` is the same rule):

- a decode whose text compresses too well (zlib ratio above COMPRESSION_RATIO_THRESHOLD: a repetition loop) or whose
  tokens are too unlikely (mean logprob, end-of-text counted, below LOGPROB_THRESHOLD) is decoded again, sampled at
  the next of TEMPERATURES (BEST_OF samples, the likeliest kept), until one passes or the temperatures run out (the
  last decode is kept);
- no fallback, and the window's text dropped, when `<|nospeech|>` is likely (above NO_SPEECH_THRESHOLD) and the text
  unlikely (below LOGPROB_THRESHOLD): the window is silence or noise;
- a window kept at a temperature above PROMPT_RESET_TEMPERATURE does not condition the next one (openai-whisper's
  prompt reset: its text is likely wrong, and conditioning on it repeats it).

One guard of our own: a decode is stopped early once its text is at least LOOP_CHECK_CHARS long and compresses
above LOOP_STOP_RATIO (it will need the fallback anyway: a loop's ratio only grows). On whisper-base, noise's
"1,5,5,5,..." ran to the window's 224-token limit at every temperature.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from omnivox.services.errors import FieldViolation

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
BEST_OF = 5  # samples per fallback temperature (openai-whisper's default); run as one batch in the engine
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
PROMPT_RESET_TEMPERATURE = 0.5
# 100 characters of speech compress about 1.1-1.3x with zlib; whisper-base's "1.5% 1.5% ..." over 20 s of modulated
# noise (224 tokens at every temperature before) is 6.6x at 100 characters.
LOOP_CHECK_CHARS = 100
LOOP_STOP_RATIO = 2 * COMPRESSION_RATIO_THRESHOLD


MAX_TEMPERATURE = 1.0  # a request's own temperature is in [0, MAX_TEMPERATURE] (OpenAI's transcription range)


def temperatures_of(request: Any) -> tuple[float, ...]:
    """A request's (TranscribeRequest, StreamingTranscriptionConfig) decode temperatures: its own temperature alone
    (no fallback) when set, else the fallback schedule."""
    return (float(request.temperature),) if request.HasField("temperature") else TEMPERATURES


def temperature_violation(request: Any, field: str = "temperature") -> FieldViolation | None:
    if request.HasField("temperature") and not 0.0 <= request.temperature <= MAX_TEMPERATURE:
        return FieldViolation(field, f"must be in [0, {MAX_TEMPERATURE:g}] (unset: greedy with the fallback)")
    return None


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib compression (openai-whisper's `compression_ratio`); 0 when empty."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def is_looping(text: str) -> bool:
    """The decode so far repeats itself beyond doubt: stop it (it needs the fallback whatever follows)."""
    return len(text) >= LOOP_CHECK_CHARS and compression_ratio(text) > LOOP_STOP_RATIO


@dataclass
class WindowDecode:
    """One decode of a window: its tokens (no end-of-text), their logprob sum (end-of-text's included), its text."""

    tokens: list[int]
    sum_logprob: float
    text: str
    temperature: float
    stopped_looping: bool = False  # cut short by is_looping
    token_logprobs: list[float] = field(default_factory=list)  # per token (end-of-text's last, when it came)

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)

    @property
    def compression_ratio(self) -> float:
        return compression_ratio(self.text)


@dataclass(frozen=True)
class DecodeStats:
    """How a kept window's decode scored (a segment's, as openai-whisper's verbose output reports it)."""

    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float  # 0 when the model has no <|nospeech|>
    temperature: float
    token_ids: tuple[int, ...] = ()  # the segment's text tokens (OpenAI's verbose_json segment `tokens`)

    @staticmethod
    def of(decode: WindowDecode, no_speech_prob: float | None, token_ids: list[int]) -> DecodeStats:
        return DecodeStats(decode.avg_logprob, decode.compression_ratio, no_speech_prob or 0.0, decode.temperature,
                           tuple(token_ids))  # fmt: skip


def is_silence(decode: WindowDecode, no_speech_prob: float | None) -> bool:
    """`<|nospeech|>` likely and the text unlikely: the window holds no speech and its text is dropped."""
    return (
        no_speech_prob is not None and no_speech_prob > NO_SPEECH_THRESHOLD and decode.avg_logprob < LOGPROB_THRESHOLD
    )


def needs_fallback(decode: WindowDecode, no_speech_prob: float | None) -> bool:
    """The decode is a loop or unlikely, and not silence (silence is dropped, not decoded again)."""
    if is_silence(decode, no_speech_prob):
        return False
    too_repetitive = decode.stopped_looping or decode.compression_ratio > COMPRESSION_RATIO_THRESHOLD
    return too_repetitive or decode.avg_logprob < LOGPROB_THRESHOLD


def kept_as_decoded(temperatures: tuple[float, ...], timestamps: bool, no_speech_prob: float | None) -> bool:
    """A window's decode is kept whatever its tokens turn out to be, so its text may be streamed as they come: no
    fallback (one temperature asked), no no-speech skip possible (`<|nospeech|>` unlikely), no timestamps (there the
    text after the window's last timestamp pair is cut and heard again). Otherwise the keep decision reads the whole
    decode (its mean logprob, end-of-text's included, and its text's compression ratio): its text waits for it, as a
    streamed delta cannot be taken back."""
    return len(temperatures) == 1 and not timestamps and (no_speech_prob or 0.0) <= NO_SPEECH_THRESHOLD
