"""Whisper's special tokens and decoding rules, as the engine's logit bias and token constraints.

- `WhisperVocab`: the ids of a checkpoint's special tokens, read from its generation_config.json (what transformers'
  `WhisperForConditionalGeneration.generate` reads: suppress_tokens, begin_suppress_tokens, lang_to_id, task_to_id,
  no_timestamps_token_id, max_initial_timestamp_index, forced_decoder_ids' language; without that file, the same
  keys of config.json, as older checkpoints keep them), else from the tokenizer. Timestamp tokens are the ids after
  `<|notimestamps|>`: `<|0.00|>`, `<|0.02|>`, ... (0.02 s each).
- `suppress_bias`: suppress_tokens as a logit bias of -inf at every step (transformers' SuppressTokensLogitsProcessor).
- `FirstStepBan`: begin_suppress_tokens banned at the first generated step only (SuppressTokensAtBeginLogitsProcessor).
- `TimestampRules`: transformers' WhisperTimeStampLogitsProcessor as a mask plus a logits hook:
  `<|notimestamps|>` never; the first token is a timestamp no later than max_initial_timestamp_index (1.0 s);
  timestamps come in pairs (after a lone timestamp: another timestamp or end-of-text; after a pair: text); and they
  never decrease (a closing timestamp may repeat the opening one; a new opening one must be later).
  Its last rule, "a timestamp when the timestamps' total probability beats every text token's", reads the
  distribution: `adjust_logits` (the constraint hook the sampler runs after the masks, on the device). It matters:
  whisper-base on a 32.6 s espeak-ng paragraph of 14 sentences gave 2 segments (0-30 s, 30-32.65 s) without it and
  14 sentence segments with it (word error rate 0.263 -> 0.175).
- `LanguageOnly`: the language tokens alone (language detection: one greedy step on `<|startoftranscript|>`, as
  transformers' `detect_language` takes the argmax of the first step's logits over the language tokens).
- `FirstStepProbe`: that same step read for `<|nospeech|>`'s probability too (openai-whisper reads it at the
  `<|startoftranscript|>` position, before any suppression), for the no-speech skip (services/calls/whisper.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SECONDS_PER_TIMESTAMP = 0.02  # one timestamp token step: 2 mel frames of 10 ms (the encoder's stride)


_OLD_CONFIG_KEYS = ("suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids", "decoder_start_token_id")


@dataclass(frozen=True)
class WhisperVocab:
    vocab_size: int  # the model's (logits) vocabulary, timestamps included
    eot: int  # <|endoftext|>
    sot: int  # <|startoftranscript|>
    sot_prev: int | None  # <|startofprev|>: the previous window's text follows
    transcribe: int | None
    translate: int | None
    no_timestamps: int | None
    languages: dict[str, int]  # code ("en") -> <|en|>; empty for an English-only model
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: int | None = 50  # 1.0 s, as openai-whisper and transformers
    no_speech: int | None = None  # <|nospeech|> (<|nocaptions|> in older tokenizers)
    default_language: int | None = None  # forced_decoder_ids' language (a fine-tuned model's); None: detect

    @property
    def timestamp_begin(self) -> int | None:
        """`<|0.00|>`, or None when the model has no timestamp tokens."""
        if self.no_timestamps is None or self.no_timestamps + 1 >= self.vocab_size:
            return None
        return self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)

    @classmethod
    def from_folder(cls, folder: Path, tokenizer: Any, vocab_size: int) -> WhisperVocab:
        file = folder / "generation_config.json"
        gen: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
        if not file.is_file() and (folder / "config.json").is_file():
            # Checkpoints saved before generation_config.json existed keep these in config.json, and transformers
            # reads them there (GenerationConfig.from_model_config): ignored, none of their suppression applied.
            config = json.loads((folder / "config.json").read_text())
            gen = {k: config[k] for k in _OLD_CONFIG_KEYS if config.get(k) is not None}

        def token(text: str) -> int | None:
            tid = tokenizer.convert_tokens_to_ids(text)
            if not isinstance(tid, int) or tid < 0 or (tid == tokenizer.unk_token_id and tokenizer.unk_token != text):
                return None
            return tid

        tasks = gen.get("task_to_id") or {}
        langs = gen.get("lang_to_id")
        if langs is None:  # no generation config: the tokenizer's own language tokens
            from transformers.models.whisper.tokenization_whisper import LANGUAGES

            langs = {f"<|{c}|>": token(f"<|{c}|>") for c in LANGUAGES}
            langs = {k: v for k, v in langs.items() if v is not None}
        eot = token("<|endoftext|>")
        sot = gen.get("decoder_start_token_id", token("<|startoftranscript|>"))
        if eot is None or sot is None:
            raise ValueError(f"{folder}: its tokenizer has no <|endoftext|> / <|startoftranscript|>: not Whisper's")
        suppress = tuple(int(t) for t in gen.get("suppress_tokens") or () if int(t) < vocab_size)
        languages = {k.strip("<|>"): int(v) for k, v in langs.items()} if gen.get("is_multilingual", True) else {}
        # transformers' generate: with no language asked, a forced_decoder_ids entry (1, <|xx|>) is the prompt's
        # language (fine-tuned checkpoints set it; the released ones carry (1, null): detect).
        forced = dict((int(i), t) for i, t in gen.get("forced_decoder_ids") or () if t is not None)
        default_language = forced.get(1) if forced.get(1) in languages.values() else None
        begin = gen.get("begin_suppress_tokens")
        return cls(
            vocab_size=vocab_size,
            eot=eot,
            sot=int(sot),
            sot_prev=token("<|startofprev|>"),
            transcribe=tasks.get("transcribe", token("<|transcribe|>")),
            translate=tasks.get("translate", token("<|translate|>")),
            no_timestamps=gen.get("no_timestamps_token_id", token("<|notimestamps|>")),
            languages=languages,
            suppress=suppress,
            begin_suppress=tuple(  # ids past the vocabulary dropped, as suppress_tokens (transformers ignores them)
                int(t) for t in (begin if begin is not None else [token(" "), eot]) if t is not None and t < vocab_size
            ),
            max_initial_timestamp_index=gen.get("max_initial_timestamp_index", 50),
            no_speech=token("<|nospeech|>") or token("<|nocaptions|>"),
            default_language=default_language,
        )

    def suppress_bias(self) -> dict[int, float]:
        return {t: -math.inf for t in self.suppress}

    def is_text(self, token_id: int) -> bool:
        """Transcript text: below <|startoftranscript|> (Whisper's special tokens and timestamps follow the text
        tokens), end-of-text aside."""
        return token_id < self.sot and token_id != self.eot


def _mask(vocab_size: int, device: Any, banned: Sequence[int] = (), allowed_only: Sequence[int] | None = None):
    """A bool mask over the model's vocabulary on the logits' device (True = may be sampled)."""
    if allowed_only is not None:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[list(allowed_only)] = True
    else:
        mask = torch.ones(vocab_size, dtype=torch.bool, device=device)
        mask[list(banned)] = False
    return mask


class FirstStepBan:
    """begin_suppress_tokens at the first generated token only; everything allowed after (stateless)."""

    def __init__(self, vocab: WhisperVocab, device: Any = "cpu") -> None:
        self.first = _mask(vocab.vocab_size, device, banned=vocab.begin_suppress)

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        return self.first if not output_token_ids else None


class LanguageOnly:
    """Only the language tokens (stateless)."""

    def __init__(self, vocab: WhisperVocab, device: Any = "cpu") -> None:
        self.mask = _mask(vocab.vocab_size, device, allowed_only=sorted(vocab.languages.values()))

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        return self.mask


class FirstStepProbe:
    """One request's constraint for the step after `... <|startoftranscript|>`: keeps `<|nospeech|>`'s probability
    (a device scalar, read once the request is done) and, when `languages` is given, admits only the language tokens.
    Made per request: it holds that request's result."""

    def __init__(self, vocab: WhisperVocab, languages: LanguageOnly | None) -> None:
        self.no_speech = vocab.no_speech
        self.languages = languages
        self.no_speech_prob: torch.Tensor | None = None

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        return None

    def adjust_logits(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        if self.no_speech is not None:
            self.no_speech_prob = logits.softmax(-1)[self.no_speech].clone()  # the request's bias is empty
        if self.languages is not None:
            logits.masked_fill_(~self.languages.mask, float("-inf"))


class TimestampRules:
    """WhisperTimeStampLogitsProcessor's mask rules (see the module docstring), read from the output so far.
    Stateless: every rule depends only on `output_token_ids` (the tokens after the prompt)."""

    def __init__(self, vocab: WhisperVocab, device: Any = "cpu") -> None:
        tb = vocab.timestamp_begin
        assert tb is not None and vocab.no_timestamps is not None
        self.tb, self.eot = tb, vocab.eot
        self.base = _mask(vocab.vocab_size, device, banned=[vocab.no_timestamps])
        first = self.base.clone()
        first[:tb] = False  # the first token is a timestamp
        if vocab.max_initial_timestamp_index is not None:
            first[tb + vocab.max_initial_timestamp_index + 1 :] = False
        self.first = first

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        seq, tb = output_token_ids, self.tb
        if not seq:
            return self.first
        mask = self.base.clone()
        last_ts = seq[-1] >= tb
        penultimate_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penultimate_ts:  # a pair just closed (or the opening one): text must follow
                mask[tb:] = False
            else:  # a lone timestamp: another timestamp or end-of-text (transformers bans the ids below
                mask[: self.tb] = False  # end-of-text; the special tokens between are banned here too)
                mask[self.eot] = True
        last = next((t for t in reversed(seq) if t >= tb), None)
        if last is not None:  # never decreasing; a new segment starts strictly later than the last timestamp
            mask[tb : last if last_ts and not penultimate_ts else last + 1] = False
        return mask

    def adjust_logits(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        """A timestamp, when the timestamps' total probability beats the likeliest text token (logits [V], masked)."""
        logprobs = logits.log_softmax(-1)
        force = logprobs[self.tb :].logsumexp(-1) > logprobs[: self.tb].max()  # a 0-dim bool on the device: no sync
        logits[: self.tb].masked_fill_(force, float("-inf"))


class WhisperRules:
    """One model's constraints and suppression bias, built once on the engine's device; all stateless, so every
    request shares them (`engine.params.shared`)."""

    def __init__(self, vocab: WhisperVocab, device: Any = "cpu") -> None:
        self.suppress = vocab.suppress_bias()
        self.first_step = FirstStepBan(vocab, device)
        self.languages = LanguageOnly(vocab, device) if vocab.languages else None
        self.timestamps = TimestampRules(vocab, device) if vocab.timestamp_begin is not None else None


def segment_seconds(start: int, end: int, offset: float, audio_end: float) -> tuple[float, float]:
    """A segment's (start, end) in seconds from timestamp steps (end -1: the window's end) and the window's offset.
    Timestamps past the audio (the window is padded to 30 s) are clamped to its end, so start <= end always."""
    stop = audio_end if end < 0 else min(offset + end * SECONDS_PER_TIMESTAMP, audio_end)
    return min(offset + start * SECONDS_PER_TIMESTAMP, stop), stop


def timestamp_segments(
    tokens: Sequence[int], vocab: WhisperVocab
) -> tuple[list[tuple[int, int, list[int]]], int, int | None]:
    """Split one window's output (no end-of-text) at its timestamp pairs, as openai-whisper does.

    Returns (segments as (start, end, text token ids) with start / end in timestamp steps from the window's start
    (end -1: the window's end), how many tokens were used, the timestamp step where the next window starts (None:
    after the whole window). A window that ends in a lone timestamp (or has no pair) is used whole; otherwise the
    text after the last pair is dropped and heard again from the next window, which starts at that pair's end.
    """
    tb = vocab.timestamp_begin
    assert tb is not None
    is_ts = [t >= tb for t in tokens]
    consecutive = [i for i in range(1, len(tokens)) if is_ts[i] and is_ts[i - 1]]
    single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1]
    segments: list[tuple[int, int, list[int]]] = []
    if consecutive:
        cuts = consecutive + ([len(tokens)] if single_ending else [])
        last = 0
        for cut in cuts:
            piece = tokens[last:cut]
            segments.append((piece[0] - tb, piece[-1] - tb, [t for t in piece if vocab.is_text(t)]))
            last = cut
        if single_ending:
            return segments, len(tokens), None
        return segments, last, tokens[last - 1] - tb
    stamps = [t - tb for t in tokens if t >= tb]
    text = [t for t in tokens if vocab.is_text(t)]
    segments.append((0, stamps[-1] if stamps and stamps[-1] != 0 else -1, text))  # -1: the window's end
    return segments, len(tokens), None
