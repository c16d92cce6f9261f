"""Whisper in the service: `transcribe` (a clip or long audio -> text + segments) with a bundle's WhisperPart
(services/parts/whisper_part.py; its special tokens and decoding rules: services/processing/whisper_rules.py).

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
  (on `[previous text] <|startoftranscript|>` when the language is known) gives `<|nospeech|>`'s probability.
- Each window's decode is checked as openai-whisper checks it (services/calls/whisper_fallback.py): a repetition loop or an
  unlikely text is decoded again at higher temperatures, and a window with `<|nospeech|>` above 0.6 and its text at a
  mean logprob below -1 is silence (its text dropped). So a window's text is sent once its decode is kept (as
  faster-whisper yields segments), not token by token. Measured on whisper-base before the fallback: 5 s of faint
  noise "I'm going to put the oil in the pan." (no-speech 0.80) and 40 s of silence after a sentence "you" (0.88)
  dropped; 5 s of pure silence "you" (0.93) kept, as openai-whisper keeps it (confident text).
- Long audio, timestamps off: windows cut at the quietest 100 ms near each 30 s edge (codecs/audio_split.py), one
  segment per window. Timestamps on: openai-whisper's seek: a window ending inside a segment is cut at its last
  complete timestamp pair, and the next window starts there; segments come from the timestamp pairs
  (time = (token - <|0.00|>) * 0.02 s + the window's offset).
- Prompting with the previous text as openai-whisper (`condition_on_previous_text`), and a user prompt as its
  `initial_prompt` (" " + the prompt, before the first window). Left out: word timestamps.
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
from omnivox.engine.params import shared
from omnivox.engine.request import EncoderInput
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services.calls.whisper_audio import WindowAudio
from omnivox.services.calls.whisper_fallback import (
    BEST_OF,
    PROMPT_RESET_TEMPERATURE,
    DecodeStats,
    WindowDecode,
    is_looping,
    is_silence,
    kept_as_decoded,
    needs_fallback,
)
from omnivox.services.output.whisper_words import TimedWord, token_times, words_by_segment
from omnivox.services.parts.whisper_part import SAMPLE_RATE, WhisperPart, whisper_part_of
from omnivox.services.processing.whisper_rules import (
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


OnText = Callable[[str, int], Awaitable[None]]  # (text delta, segment index)


@dataclass
class WhisperResult:
    text: str  # the segments' texts joined by one space
    language: str | None  # the requested language's code, else the detected one; "en" for an English-only model
    segments: list[tuple[float, float, str]]  # (start s, end s, text) from the start of the audio
    num_tokens: int  # tokens generated, over all windows (language detection included)
    token_ids: list[int] = field(default_factory=list)  # every window's generated tokens, in order (no end-of-text)
    no_speech_probs: list[float] = field(default_factory=list)  # per window, where the model has <|nospeech|>
    words: list[list[TimedWord]] = field(default_factory=list)  # per segment, with word_timestamps
    stats: list[DecodeStats] = field(default_factory=list)  # per segment: its window's decode


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
    temperatures: tuple[float, ...] = (0.0,),
    word_timestamps: bool = False,
    encoder_window_s: float | None = None,
) -> WhisperResult:
    """Transcribe (or translate to English) float32 mono 16 kHz `samples` with a Whisper model (a WhisperPart or a
    ServedModel / ModelBundle holding one). TranscriptionRequestError names a bad setting (language, task,
    timestamps). `on_text(delta, segment_index)` is awaited with the text as it comes: each window's (without
    timestamps) or each segment's (with them) once its window's decode is kept; the deltas joined equal `result.text`.
    `max_tokens` caps each window's output (default: 224 = max_target_positions // 2, openai-whisper's).
    `cache_salt`: the windows' encoder outputs and KV blocks are shared only with requests of the same salt
    (services/processing/cache_salt.py). `temperatures`: the decode's temperature, or the fallback schedule (TEMPERATURES,
    services/calls/whisper_fallback.py) that the service's callers pass unless a request names its own.
    `encoder_window_s`: a short encoder window (seconds) for a clip that ends well before it (WhisperPart
    `encoder_frames`; not with timestamps); None: the 30 s window, transformers' own. Cancelling aborts the engine work."""
    part = whisper_part_of(model)
    lang = part.check(language, task, timestamps)
    run = _Transcription(part, task, timestamps, on_text, max_tokens, cache_salt, temperatures)
    run.word_timestamps = word_timestamps
    run.encoder_window_s = encoder_window_s
    if prompt:
        run.prev = part.prompt_tokens(prompt)
    with part.deadline(len(samples)):  # due in its audio's seconds: other engines yield to it when it falls behind
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
        temperatures: tuple[float, ...] = (0.0,),
    ):
        self.part, self.task, self.timestamps, self.on_text = part, task, timestamps, on_text
        self.cache_salt, self.temperatures = cache_salt, temperatures
        self.word_timestamps = False
        self.encoder_window_s: float | None = None
        self.words: list[list[TimedWord]] = []
        self.stats: list[DecodeStats] = []
        n_text_ctx = part.engine.model_config.max_position_embeddings  # max_target_positions
        self.max_tokens = max_tokens or max_window_tokens(n_text_ctx)
        self.max_prev = max_prev_tokens(n_text_ctx)
        self.prev: list[int] = []
        self.segments: list[tuple[float, float, str]] = []
        self.token_ids: list[int] = []
        self.no_speech_probs: list[float] = []
        self.num_tokens = 0
        self.emitted_any = False
        self.window_sent = ""  # the open window's text already handed to on_text as its tokens came
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
        text = " ".join(t for _, _, t in self.segments if t)
        return WhisperResult(text, self._language_code(lang), self.segments, self.num_tokens, self.token_ids, self.no_speech_probs,
                             self.words, self.stats)  # fmt: skip

    async def _prepare(self, clip: np.ndarray, lang: int | None) -> tuple[WindowAudio, int | None, float | None]:
        """The window's audio, its language (detected here when not given) and its `<|nospeech|>` probability.

        One step on `[previous text] <|startoftranscript|>` (just `<|startoftranscript|>` when detecting, as
        transformers and openai-whisper detect) reads `<|nospeech|>`'s probability and, when detecting, picks the
        likeliest language token; the transcription's prompt then shares its KV blocks (prefix cache). The first
        transcription request's encoder reference is taken before it, so the window is encoded once."""
        part, v = self.part, self.part.vocab
        short = not (self.timestamps or self.word_timestamps)
        frames = part.encoder_frames(len(clip), self.encoder_window_s) if short else None
        features = await asyncio.to_thread(part.features, clip, frames)
        audio = WindowAudio(part, part.window_key(clip, frames), features, self.cache_salt)
        detect = lang is None and v.multilingual
        if not detect and v.no_speech is None:
            return audio, lang, None
        audio.held = audio.take()
        probe = FirstStepProbe(v, self.part.rules.languages if detect else None)
        prompt = [v.sot] if detect else [*self._prev_prompt(), v.sot]
        try:
            ids, _, _ = await self._generate(prompt, 1, audio.take, lambda: probe, {}, counted=detect)
        except BaseException:
            audio.release()  # never queued: ours to drop
            raise
        no_speech = float(probe.no_speech_prob) if probe.no_speech_prob is not None else None
        if no_speech is not None:
            self.no_speech_probs.append(no_speech)
        return audio, ids[0] if detect else lang, no_speech

    def _prev_prompt(self) -> list[int]:
        v = self.part.vocab
        return [v.sot_prev, *self.prev[-self.max_prev :]] if self.prev and v.sot_prev is not None else []

    def _prompt(self, lang: int | None) -> list[int]:
        return self._prev_prompt() + self.part.task_prompt(lang, self.task, self.timestamps)

    def _budget(self, prompt: list[int]) -> int:
        room = self.part.engine.model_config.max_model_len - len(prompt)
        return max(1, min(self.max_tokens, room))

    def _text(self, tokens: list[int]) -> str:
        ids = [t for t in tokens if self.part.vocab.is_text(t)]
        return self.part.tokenizer.decode(ids, skip_special_tokens=True).strip()

    async def _decode(self, prompt: list[int], audio: WindowAudio, no_speech: float | None, seed: int) -> WindowDecode:
        """The window decoded greedily, then again sampled at each higher temperature while the decode needs the
        fallback (services/calls/whisper_fallback.py); the last decode when none passes."""
        budget, bias = self._budget(prompt), self.part.rules.suppress
        decode: WindowDecode | None = None
        self.window_sent = ""
        sure = kept_as_decoded(self.temperatures, self.timestamps, no_speech)  # its text can go out as it comes
        on_tokens = self._emit_so_far if sure and self.on_text is not None else None
        try:
            for step, temperature in enumerate(self.temperatures):
                n = 1 if temperature == 0 else BEST_OF
                # A loop is stopped early only where a fallback follows (a request's own temperature runs as asked).
                stop = self._looping if len(self.temperatures) > 1 else None
                runs = [self._generate(prompt, budget, audio.take, self.constraint, bias, temperature=temperature,
                                       seed=(seed + 1000 * step + k) % 2**32, stop=stop, on_tokens=on_tokens)
                        for k in range(n)]  # fmt: skip
                candidates = [WindowDecode(t, sum(lp), self._text(t), temperature, cut, lp)
                              for t, lp, cut in await asyncio.gather(*runs)]  # fmt: skip
                # openai-whisper's MaximumLikelihoodRanker (no length penalty): the likeliest per token.
                decode = max(candidates, key=lambda d: d.sum_logprob / max(1, len(d.tokens)))
                if not needs_fallback(decode, no_speech):
                    break
        finally:
            audio.release()
        assert decode is not None
        return decode

    def _looping(self, tokens: list[int]) -> bool:
        return is_looping(self._text(tokens))

    def _keep(self, decode: WindowDecode, tokens: list[int]) -> None:
        """Condition the next window on `tokens`, unless the decode was sampled hot (openai-whisper's prompt reset)."""
        self.prev = [] if decode.temperature > PROMPT_RESET_TEMPERATURE else self.prev + tokens
        self.token_ids += tokens

    async def _window(self, clip: np.ndarray, start: int, end: int, lang: int | None) -> int | None:
        audio, lang, no_speech = await self._prepare(clip, lang)
        decode = await self._decode(self._prompt(lang), audio, no_speech, start)
        index = len(self.segments)
        self.stats.append(DecodeStats.of(decode, no_speech, decode.tokens))
        if is_silence(decode, no_speech):
            self.segments.append((start / SAMPLE_RATE, end / SAMPLE_RATE, ""))
            self.words += [[]] if self.word_timestamps else []
            return lang
        await self._emit(decode.text, index)
        self.segments.append((start / SAMPLE_RATE, end / SAMPLE_RATE, decode.text))
        if self.word_timestamps:
            groups = await self._words(audio, lang, decode, len(decode.tokens), start, end)
            self.words.append([w for g in groups for w in g])
        self._keep(decode, decode.tokens)
        return lang

    async def _window_timestamps(
        self, clip: np.ndarray, seek: int, end: int, lang: int | None
    ) -> tuple[int, int | None]:
        audio, lang, no_speech = await self._prepare(clip, lang)
        decode = await self._decode(self._prompt(lang), audio, no_speech, seek)
        if is_silence(decode, no_speech):
            return end, lang  # the whole window skipped
        tokens = decode.tokens
        pieces, used, next_step = timestamp_segments(tokens, self.part.vocab)
        offset = seek / SAMPLE_RATE
        groups = await self._words(audio, lang, decode, used, seek, end) if self.word_timestamps else []
        for a, b, ids in pieces:
            text = self.part.tokenizer.decode(ids, skip_special_tokens=True).strip()
            self.segments.append((*segment_seconds(a, b, offset, end / SAMPLE_RATE), text))
            self.stats.append(DecodeStats.of(decode, no_speech, ids))
            if self.word_timestamps:
                self.words.append(groups.pop(0) if text and groups else [])
            await self._emit(text, len(self.segments) - 1)
        advance = end - seek
        # Cut at the last pair's end (the rest is heard again); a cut at 0 would never advance: the whole window then.
        if next_step is not None and next_step > 0:
            advance = min(advance, round(next_step * SECONDS_PER_TIMESTAMP * SAMPLE_RATE))
        self._keep(decode, tokens[:used])
        return seek + advance, lang

    async def _words(
        self, audio: WindowAudio, lang: int | None, decode: WindowDecode, used: int, start: int, end: int
    ) -> list[list[TimedWord]]:
        """The kept decode's first `used` tokens as timed words, per segment (a worker thread: the cross K/V from
        the encoder cache, encoded again if it was evicted; one dense decoder pass)."""
        handle, prompt = self.part.worker.handle(audio.key, audio.features, audio.salt), self._prompt(lang)

        def align() -> np.ndarray:
            try:
                return token_times(self.part, handle.result(), prompt, decode.tokens, end - start)
            finally:
                handle.release()

        times = await asyncio.to_thread(align)
        s, code = SAMPLE_RATE, self._language_code(lang)
        return words_by_segment(self.part, decode.tokens[:used], times, decode.token_logprobs, start / s, end / s, code)

    def _language_code(self, lang: int | None) -> str | None:
        v = self.part.vocab  # an English-only model's language is English (openai-whisper reports "en")
        return next((c for c, t in v.languages.items() if t == lang), None) if v.multilingual else "en"

    async def _emit(self, text: str, index: int) -> None:
        """Hand `on_text` a kept segment's text (segments' texts are joined by one space), less what of it went out
        as its tokens came."""
        sent, self.window_sent = self.window_sent, ""
        await self._emit_piece(text[len(sent) :] if text.startswith(sent) else "", index, first=not sent)

    async def _emit_so_far(self, tokens: list[int]) -> None:
        """The new end of a sure-to-be-kept decode's text (a character cut between tokens waits for its bytes)."""
        text = self._text(tokens).rstrip("\ufffd")
        if len(text) > len(self.window_sent) and text.startswith(self.window_sent):
            piece, first = text[len(self.window_sent) :], not self.window_sent
            self.window_sent = text
            await self._emit_piece(piece, len(self.segments), first)

    async def _emit_piece(self, piece: str, index: int, first: bool) -> None:
        if self.on_text is None or not piece:
            return
        delta = " " + piece if first and self.emitted_any else piece
        self.emitted_any = True
        await self.on_text(delta, index)

    async def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        take: Callable[[], EncoderInput],
        constraint: Any,
        bias: dict[int, float],
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Callable[[list[int]], bool] | None = None,
        counted: bool = True,
        on_tokens: Callable[[list[int]], Awaitable[None]] | None = None,
    ) -> tuple[list[int], list[float], bool]:
        """One engine request (greedy, or sampled with its own seed): its generated tokens without end-of-text, their
        logprobs (end-of-text's last, when it came), and whether `stop(tokens so far)` cut it short. `take()`: the
        encoder reference, taken as this starts (a gathered run cancelled before its first step leaked one taken
        earlier), the engine's once queued; `counted`: its tokens count; `on_tokens(tokens so far)` per new token."""
        engine, enc = self.part.engine, take()
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logit_bias=bias or None)
        params.seed = seed if temperature > 0 else None
        params.logprobs = 0
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
        logprobs: list[float] = []
        finished = cut = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                new = [t for t in out.new_token_ids if t != self.part.vocab.eot]
                tokens += new
                logprobs += [lp.logprob for lp in out.new_logprobs or ()]
                self.num_tokens += len(out.new_token_ids) if counted else 0
                if on_tokens is not None and new:
                    await on_tokens(tokens)
                if not finished and new and stop is not None and stop(tokens):
                    cut = True
                    break
        finally:
            if not finished:
                engine.abort(rid)
        if finished and out.finish_reason == "error":
            raise RuntimeError("the engine failed while computing this transcription; see the server log")
        return tokens, logprobs, cut
