"""Whisper in the service: `transcribe` (a clip or long audio -> text + segments) with a bundle's WhisperPart
(services/whisper_part.py; its special tokens and decoding rules: services/whisper_rules.py).

One transcription, window by window (sequential: each window's prompt holds the previous window's text):
  window samples (<= 30 s) -> log-mel [n_mels, 3000] (codecs/mel.py, Whisper's feature extractor) -> an
  EncoderInput whose source is the bundle's EncoderWorker handle (keyed by the samples + mel settings + model: the
  encoder runs once per window, when the engine admits its request, and the cross K/V is shared through the encoder
  cache) -> one engine request, greedy:
    [<|startofprev|> + previous text (last 223 tokens)] <|startoftranscript|> <|lang|> <|transcribe|/|translate|>
    [<|notimestamps|> unless timestamps]
  suppress_tokens as a -inf logit bias; begin_suppress_tokens (or the timestamp rules) as a token constraint.
- Language detection (language empty, multilingual model): a 1-token request on `[<|startoftranscript|>]` whose
  only candidates are the language tokens, with the first window's EncoderInput: the audio is encoded once (the
  transcription request takes a second reference to the same cache entry before detection starts). The same step
  (on `[previous text] <|startoftranscript|>` when the language is known) gives `<|nospeech|>`'s probability for
  openai-whisper's no-speech skip: above 0.6, with the window's text at a mean logprob below -1, the window is silence
  and its text is dropped (such a window's text is held back until that is known). Measured on whisper-base: 5 s of
  faint noise "I'm going to put the oil in the pan." (no-speech 0.80) and 40 s of silence after a sentence "you"
  (0.88) are dropped; 5 s of pure silence "you" (0.93) is kept, as openai-whisper keeps it (confident text).
- Long audio, timestamps off: windows cut at the quietest 100 ms near each 30 s edge (codecs/audio_split.py), one
  segment per window. Timestamps on: openai-whisper's seek: a window ending inside a segment is cut at its last
  complete timestamp pair, and the next window starts there; segments come from the timestamp pairs
  (time = (token - <|0.00|>) * 0.02 s + the window's offset).
- Prompting with the previous text as openai-whisper (`condition_on_previous_text`), and a user prompt as its
  `initial_prompt` (" " + the prompt, before the first window). Left out: the temperature fallback (a window whose
  text compresses too well or scores too low is decoded again, sampled) and word timestamps.
Cancelling the coroutine aborts its engine request (KV blocks and cross K/V freed at once) and releases every
encoder-cache reference it still holds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnivox.codecs.audio_split import split_at_quiet
from omnivox.engine import InvalidRequest, SamplingParams
from omnivox.engine.detokenizer import IncrementalDetokenizer
from omnivox.engine.params import shared
from omnivox.engine.request import EncoderInput
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services.whisper_part import SAMPLE_RATE, WhisperPart, whisper_part_of
from omnivox.services.whisper_rules import (
    SECONDS_PER_TIMESTAMP,
    FirstStepProbe,
    segment_seconds,
    timestamp_segments,
)

__all__ = ["WhisperPart", "WhisperResult", "transcribe"]


# openai-whisper's shares of the decoder's context (n_text_ctx = max_target_positions, 448 in every release): the
# previous text (and a user prompt) keeps its last n_text_ctx // 2 - 1 tokens (223), a window writes at most
# n_text_ctx // 2 (224, its sample_len). Fixed at 223 / 224, a tiny config's 64-token context could not hold the
# prompt: long audio and any long prompt were refused (transformers cuts the previous text the same way).
def max_prev_tokens(n_text_ctx: int) -> int:
    return n_text_ctx // 2 - 1


def max_window_tokens(n_text_ctx: int) -> int:
    return n_text_ctx // 2


# openai-whisper's no-speech skip: a window whose <|nospeech|> probability (at <|startoftranscript|>) is above
# NO_SPEECH_THRESHOLD and whose tokens' mean logprob is below LOGPROB_THRESHOLD is silence, and its text is dropped
# (Whisper writes "Thank you." and the like over silence and noise).
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0

OnText = Callable[[str, int], Awaitable[None]]  # (text delta, segment index)


@dataclass
class WhisperResult:
    text: str  # the segments' texts joined by one space
    language: str | None  # the requested language's code, else the detected one; "en" for an English-only model
    segments: list[tuple[float, float, str]]  # (start s, end s, text) from the start of the audio
    num_tokens: int  # tokens generated, over all windows (language detection included)
    token_ids: list[int] = field(default_factory=list)  # every window's generated tokens, in order (no end-of-text)
    no_speech_probs: list[float] = field(default_factory=list)  # per window, where the model has <|nospeech|>


async def transcribe(
    model: Any,
    samples: np.ndarray,
    *,
    language: str | None,
    task: str = "transcribe",
    timestamps: bool = False,
    prompt: str | None = None,
    on_text: OnText | None = None,
    max_tokens: int | None = None,
    cache_salt: str = "",
) -> WhisperResult:
    """Transcribe (or translate to English) float32 mono 16 kHz `samples` with a Whisper model (a WhisperPart or a
    ServedModel / ModelBundle holding one). TranscriptionRequestError names a bad setting (language, task,
    timestamps). `on_text(delta, segment_index)` is awaited with the text as it comes: token by token without
    timestamps, segment by segment (at each window's end) with them; the deltas joined equal `result.text`.
    `max_tokens` caps each window's output (default: 224 = max_target_positions // 2, openai-whisper's).
    `cache_salt`: the windows' encoder outputs and KV blocks are shared only with requests of the same salt
    (services/cache_salt.py). Cancelling aborts the engine work."""
    part = whisper_part_of(model)
    lang = part.check(language, task, timestamps)
    run = _Transcription(part, task, timestamps, on_text, max_tokens, cache_salt)
    if prompt:
        run.prev = part.prompt_tokens(prompt)
    return await run.run(np.ascontiguousarray(samples, np.float32), lang)


class _Transcription:
    def __init__(
        self,
        part: WhisperPart,
        task: str,
        timestamps: bool,
        on_text: OnText | None,
        max_tokens: int | None,
        cache_salt: str = "",
    ):
        self.part, self.task, self.timestamps, self.on_text = part, task, timestamps, on_text
        self.cache_salt = cache_salt
        n_text_ctx = part.engine.model_config.max_position_embeddings  # max_target_positions
        self.max_tokens = max_tokens or max_window_tokens(n_text_ctx)
        self.max_prev = max_prev_tokens(n_text_ctx)
        self.prev: list[int] = []
        self.segments: list[tuple[float, float, str]] = []
        self.token_ids: list[int] = []
        self.no_speech_probs: list[float] = []
        self.num_tokens = 0
        self.emitted_any = False
        rules = part.rules
        self.constraint = shared(rules.timestamps if timestamps else rules.first_step)  # type: ignore[arg-type]

    async def run(self, samples: np.ndarray, lang: int | None) -> WhisperResult:
        n = len(samples)
        window = self.part.window_samples  # 30 s for every released Whisper; a tiny config's may be shorter
        if not self.timestamps:
            bounds = split_at_quiet(samples, SAMPLE_RATE, window / SAMPLE_RATE) if n > window else [(0, n)]
            for start, end in bounds:
                lang = await self._window(samples[start:end], start, end, lang)
        else:
            seek = 0
            while seek < n:
                end = min(seek + window, n)
                seek, lang = await self._window_timestamps(samples[seek:end], seek, end, lang)
        v = self.part.vocab  # an English-only model's language is English (openai-whisper reports "en")
        code = next((c for c, t in v.languages.items() if t == lang), None) if v.multilingual else "en"
        text = " ".join(t for _, _, t in self.segments if t)
        return WhisperResult(text, code, self.segments, self.num_tokens, self.token_ids, self.no_speech_probs)

    async def _inputs(self, clip: np.ndarray, detect: bool) -> tuple[EncoderInput, EncoderInput | None]:
        part = self.part
        features = await asyncio.to_thread(part.features, clip)
        key = part.window_key(clip)
        main = part.encoder_input(key, features, self.cache_salt)
        return main, part.encoder_input(key, features, self.cache_salt) if detect else None

    async def _prepare(self, clip: np.ndarray, lang: int | None) -> tuple[EncoderInput, int | None, bool]:
        """The window's EncoderInput, its language (detected here when not given) and whether it may be silence.

        One step on `[previous text] <|startoftranscript|>` (just `<|startoftranscript|>` when detecting, as
        transformers and openai-whisper detect) reads `<|nospeech|>`'s probability and, when detecting, picks the
        likeliest language token; the transcription's prompt then shares its KV blocks (prefix cache)."""
        v = self.part.vocab
        detect = lang is None and v.multilingual
        main, second = await self._inputs(clip, detect or v.no_speech is not None)
        if second is None:
            return main, lang, False
        probe = FirstStepProbe(v, self.part.rules.languages if detect else None)
        prompt = [v.sot] if detect else [*self._prev_prompt(), v.sot]
        try:
            ids, _ = await self._generate(prompt, 1, second, lambda: probe, {}, counted=detect)
        except BaseException:
            main.release()  # never queued: ours to drop
            raise
        if probe.no_speech_prob is not None:
            self.no_speech_probs.append(float(probe.no_speech_prob))
        silent = probe.no_speech_prob is not None and self.no_speech_probs[-1] > NO_SPEECH_THRESHOLD
        return main, ids[0] if detect else lang, silent

    def _prev_prompt(self) -> list[int]:
        v = self.part.vocab
        return [v.sot_prev, *self.prev[-self.max_prev :]] if self.prev and v.sot_prev is not None else []

    def _prompt(self, lang: int | None) -> list[int]:
        return self._prev_prompt() + self.part.task_prompt(lang, self.task, self.timestamps)

    @staticmethod
    def _is_silence(maybe: bool, tokens: list[int], logprob_sum: float) -> bool:
        """openai-whisper's rule: no speech likely and the text unlikely (mean logprob, end-of-text included)."""
        return maybe and logprob_sum / (len(tokens) + 1) < LOGPROB_THRESHOLD

    def _budget(self, prompt: list[int]) -> int:
        room = self.part.engine.model_config.max_model_len - len(prompt)
        return max(1, min(self.max_tokens, room))

    async def _window(self, clip: np.ndarray, start: int, end: int, lang: int | None) -> int | None:
        enc, lang, maybe_silent = await self._prepare(clip, lang)
        prompt = self._prompt(lang)
        index = len(self.segments)
        detok = IncrementalDetokenizer(self.part.tokenizer, [], None, False, skip_special_tokens=True)
        state = {"emitted": ""}

        async def stream(new: list[int]) -> None:
            for t in new:
                if self.part.vocab.is_text(t):
                    detok.add(t)
            await self._emit(detok.text.strip(), state, index, final=False)

        bias = self.part.rules.suppress
        budget = self._budget(prompt)  # a window that may be silence streams nothing until it is known not to be
        tokens, logprob = await self._generate(prompt, budget, enc, self.constraint, bias,
                                               None if maybe_silent else stream, logprobs=maybe_silent)  # fmt: skip
        if self._is_silence(maybe_silent, tokens, logprob):
            self.segments.append((start / SAMPLE_RATE, end / SAMPLE_RATE, ""))
            return lang
        text_ids = [t for t in tokens if self.part.vocab.is_text(t)]
        text = self.part.tokenizer.decode(text_ids, skip_special_tokens=True).strip()
        await self._emit(text, state, index, final=True)
        self.segments.append((start / SAMPLE_RATE, end / SAMPLE_RATE, text))
        self.prev += tokens
        self.token_ids += tokens
        return lang

    async def _window_timestamps(
        self, clip: np.ndarray, seek: int, end: int, lang: int | None
    ) -> tuple[int, int | None]:
        enc, lang, maybe_silent = await self._prepare(clip, lang)
        prompt = self._prompt(lang)
        bias = self.part.rules.suppress
        budget = self._budget(prompt)
        tokens, logprob = await self._generate(prompt, budget, enc, self.constraint, bias, logprobs=maybe_silent)
        if self._is_silence(maybe_silent, tokens, logprob):
            return end, lang  # the whole window skipped
        pieces, used, next_step = timestamp_segments(tokens, self.part.vocab)
        offset = seek / SAMPLE_RATE
        for a, b, ids in pieces:
            text = self.part.tokenizer.decode(ids, skip_special_tokens=True).strip()
            self.segments.append((*segment_seconds(a, b, offset, end / SAMPLE_RATE), text))
            await self._emit(text, {"emitted": ""}, len(self.segments) - 1, final=True)
        advance = end - seek
        # Cut at the last pair's end (the rest is heard again); a cut at 0 would never advance: the whole window then.
        if next_step is not None and next_step > 0:
            advance = min(advance, round(next_step * SECONDS_PER_TIMESTAMP * SAMPLE_RATE))
        self.prev += tokens[:used]
        self.token_ids += tokens[:used]
        return seek + advance, lang

    async def _emit(self, visible: str, state: dict[str, str], index: int, final: bool) -> None:
        """Hand `on_text` what extends the text emitted so far (a decode that changed its past waits for the final)."""
        if self.on_text is None or not visible.startswith(state["emitted"]):
            return
        if not final:
            visible = visible.rstrip()
        delta, state["emitted"] = visible[len(state["emitted"]) :], visible
        if not delta:
            return
        if not state.get("started"):
            state["started"] = "1"
            if self.emitted_any:
                delta = " " + delta  # segments' texts are joined by one space
        self.emitted_any = True
        await self.on_text(delta, index)

    async def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        enc: EncoderInput,
        constraint: Any,
        bias: dict[int, float],
        on_tokens: Callable[[list[int]], Awaitable[None]] | None = None,
        logprobs: bool = False,
        counted: bool = True,
    ) -> tuple[list[int], float]:
        """One greedy engine request: its generated tokens without end-of-text, and the sum of their logprobs (with
        end-of-text's; 0.0 unless `logprobs`). `enc` belongs to the engine once queued (released on finish / abort /
        error); refused before that, it is released here. `counted`: its tokens count in num_tokens."""
        engine = self.part.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=bias or None)
        params.logprobs = 0 if logprobs else None
        params.constraint_factory = constraint
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            engine.start()
            rid = engine.add_request(
                prompt, params, uuid.uuid4().hex,
                on_output=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), encoder_input=enc,
                cache_salt=self.cache_salt,
            )  # fmt: skip
        except InvalidRequest as err:
            enc.release()
            raise TranscriptionRequestError("audio", err.description) from err
        except BaseException:
            enc.release()
            raise
        tokens: list[int] = []
        logprob = 0.0
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                new = [t for t in out.new_token_ids if t != self.part.vocab.eot]
                tokens += new
                logprob += sum(lp.logprob for lp in out.new_logprobs or ())
                self.num_tokens += len(out.new_token_ids) if counted else 0
                if new and on_tokens is not None:
                    await on_tokens(new)
        finally:
            if not finished:
                engine.abort(rid)
        if out.finish_reason == "error":
            raise RuntimeError("the engine failed while computing this transcription; see the server log")
        return tokens, logprob
