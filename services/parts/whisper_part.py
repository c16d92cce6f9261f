"""The Whisper part of a bundle: which folders are Whisper, its special tokens, feature extractor, encoder worker and
cache, and the checks and prompt of one transcription request (services/calls/whisper.py runs them).

A CTranslate2 folder (`model.bin` + `config.json` + `tokenizer.json`, as faster-whisper uses) is converted once into
a transformers folder in the model cache (models/ct2_whisper.py `cached_ct2_whisper_folder`, under the cache's lock);
the engine loads the converted folder.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnivox.codecs.audio_input import AudioInputError, AudioLimits, DecodedAudio, content_key, decode_audio
from omnivox.codecs.mel import LogMelExtractor, MelSettings
from omnivox.engine.encoder_cache import EncoderCache, EncoderWorker
from omnivox.engine.request import EncoderInput
from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.models.audio.whisper import short_window_frames
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.output.whisper_words import heads_of
from omnivox.services.processing.audio_prompt import encoding_name
from omnivox.services.processing.prompt import MediaPromptBuilder
from omnivox.services.processing.whisper_rules import WhisperRules, WhisperVocab
from omnivox.v1 import content_pb2

SAMPLE_RATE = 16000
# One window's cross K/V: layers x 2 x d_model x 1500 frames; whisper-base in float32 is 6 x 2 x 512 x 1500 x 4 B =
# 37 MB, so 512 MiB keeps ~14 windows for reuse (StreamingTranscribe's passes, repeated requests). Entries in use are
# never evicted, whatever their size (large-v3's is 245 MB in bf16).
WHISPER_CACHE_BYTES = 512 << 20
TRANSCRIBE_MAX_SECONDS = 3600.0
# A short encoder window (issue 31) is taken only by a clip that ends this long before the window does: whisper-base
# looped on windows cut 0.3-1 s after the speech; a 10 s window kept its word error rate on 32 clips of 1.8-6.1 s
# (BENCHMARKS.md "Whisper short windows"), so a 10 s window takes clips up to 6.5 s, what was measured.
SHORT_WINDOW_MARGIN_S = 3.5
TASKS = ("transcribe", "translate")


def is_whisper_folder(folder: Path) -> bool:
    """A transformers Whisper checkpoint (config model_type "whisper") or a CTranslate2 Whisper folder."""
    from omnivox.models.ct2_whisper import is_ct2_whisper_folder

    try:
        if json.loads((folder / "config.json").read_text()).get("model_type") == "whisper":
            return True
    except (OSError, ValueError, AttributeError):
        pass
    return is_ct2_whisper_folder(folder)


def whisper_checkpoint(source: Path) -> Path:
    """`source` itself for a transformers folder; for a CTranslate2 folder, its converted copy in the model cache."""
    from omnivox.models.ct2_whisper import cached_ct2_whisper_folder, is_ct2_whisper_folder

    return cached_ct2_whisper_folder(source) if is_ct2_whisper_folder(source) else Path(source)


def whisper_kv_gib(folder: Path, max_num_seqs: int) -> float:
    """A KV cache holding `max_num_seqs` full decoder contexts (float32 bytes: an over-estimate in bf16). The engine's
    own default (1 GiB on CPU, 85 % of free memory on CUDA) is sized for LLM contexts; Whisper's is 448 tokens:
    whisper-base needs 24 KiB a token (6 layers x K,V x 512 x 4 B), 64 contexts 0.66 GiB; large-v3 4.4 GiB."""
    config = json.loads((folder / "config.json").read_text())
    per_token = config["decoder_layers"] * 2 * config["d_model"] * 4
    return max_num_seqs * config.get("max_target_positions", 448) * per_token / (1 << 30)


class WhisperPromptBuilder(MediaPromptBuilder):
    """Generate on a Whisper model: refused with a pointer (it transcribes; it does not chat)."""

    def build(self, contents: Sequence[content_pb2.Content], tools: list[dict] | None = None, cache_salt: str = ""):
        raise errors.invalid_argument(
            [FieldViolation("model", "a Whisper model transcribes: use TranscriptionService/Transcribe, or serve a text "
                                     "model with --asr-model for a spoken question (the cascade)")]
        )  # fmt: skip


# BCP-47 codes Whisper spells otherwise (its token for Javanese is <|jw|>, Norwegian <|no|>, Hebrew <|he|>, ...).
_WHISPER_CODES = {"jv": "jw", "nb": "no", "iw": "he", "in": "id", "ji": "yi", "fil": "tl"}

TRANSCRIPT_ENTRIES = 1024  # clips whose transcripts the cascade remembers (a few hundred bytes each)


class TranscriptCache:
    """Transcripts of recent clips for the cascade (services/processing/cascade.py), by a key of the clip and the request's cache
    salt, least recently used evicted first. Used on the event loop only (no lock)."""

    def __init__(self, max_entries: int = TRANSCRIPT_ENTRIES) -> None:
        self.max_entries = max_entries
        self._texts: OrderedDict[bytes, str] = OrderedDict()  # most recently used last
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._texts)

    def get(self, key: bytes) -> str | None:
        text = self._texts.get(key)
        if text is None:
            self.misses += 1
            return None
        self.hits += 1
        self._texts.move_to_end(key)
        return text

    def put(self, key: bytes, text: str) -> None:
        self._texts[key] = text
        self._texts.move_to_end(key)
        while len(self._texts) > self.max_entries:
            self._texts.popitem(last=False)


# Far more than the 223 tokens of previous text a window's prompt keeps (a token is rarely over 16 characters).
MAX_PROMPT_CHARS = 16 * 1024


@dataclass
class WhisperPart:
    """The Whisper side of a bundle: its engine, special tokens, feature extractor and encoder worker + cache."""

    engine: Any  # omnivox.engine.Engine, serving the WhisperModel
    tokenizer: Any
    vocab: WhisperVocab
    mel: LogMelExtractor
    worker: EncoderWorker
    model_key: str  # names the model in content keys
    rules: WhisperRules  # constraints + suppression bias on the engine's device
    limits: AudioLimits = field(default_factory=lambda: AudioLimits(max_seconds=TRANSCRIBE_MAX_SECONDS))
    transcripts: TranscriptCache = field(default_factory=TranscriptCache)  # the cascade's (--asr-model)
    alignment_heads: list[tuple[int, int]] = field(default_factory=list)  # (layer, head): word timestamps
    short_window_int8: bool = (
        False  # short windows encoded by the int8 encoder (EngineOptions.whisper_short_window_int8)
    )
    short_window_s: float | None = None  # Transcribe's and StreamingTranscribe's short window (None: 30 s only)

    @property
    def cache(self) -> EncoderCache:
        return self.worker.cache

    def deadline(self, num_samples: int) -> contextlib.AbstractContextManager:
        """A transcription pass of `num_samples` as an audio stream of this engine's for the step arbiter
        (engine/arbiter.py), due its audio's seconds from now (RTF 1; 0: due now, a live pass), closed on leaving;
        nothing when the engine has no arbiter (an engine outside a server)."""
        arbiter = getattr(self.engine, "arbiter", None)
        if arbiter is None:
            return contextlib.nullcontext()
        return arbiter.open(self.engine, due_in_s=num_samples / SAMPLE_RATE)

    @property
    def window_samples(self) -> int:
        """One encoder window in samples: the extractor's chunk_length (30 s; checked at load to equal the
        encoder's 2 x max_source_positions frames)."""
        return self.mel.settings.n_samples

    def decode(self, part: content_pb2.AudioPart, path: str) -> DecodedAudio:
        """Decode one AudioPart to 16 kHz mono (any length up to the limit); INVALID_ARGUMENT on `<path>.<field>`."""
        try:
            return decode_audio(
                part.data, encoding_name(part.encoding), part.sample_rate_hertz, SAMPLE_RATE,
                self.limits,
            )  # fmt: skip
        except AudioInputError as err:
            raise errors.invalid_argument([FieldViolation(f"{path}.{err.field}", err.description)]) from err

    def features(self, clip: np.ndarray, frames: int | None = None) -> torch.Tensor:
        """[N] float32 (N <= 30 s) -> [n_mels, frames] float32 CPU: the padded 30 s window's log-mel (3000 frames), or
        its first `frames` (a short encoder window, `encoder_frames`)."""
        features = self.mel.extract([torch.from_numpy(np.ascontiguousarray(clip, np.float32))]).features[0].cpu()
        return features if frames is None else features[:, :frames].contiguous()

    def window_key(self, clip: np.ndarray, frames: int | None = None) -> str:
        key = content_key(clip, SAMPLE_RATE, self.mel.settings.key(), self.model_key)
        full = self.mel.settings.max_frames
        if frames is None or frames == full:
            return key
        return f"{key}:frames={frames}" + (":int8" if self.short_window_int8 else "")  # a short window: other states

    def encoder_frames(self, num_samples: int, window_s: float | None) -> int | None:
        """The short window a clip of `num_samples` takes (mel frames), or None for the full one (`window_s` None,
        the clip too long for it, or a model whose window is already that short)."""
        if window_s is None:
            return None
        full = self.mel.settings.max_frames
        frames = short_window_frames(num_samples, window_s, SHORT_WINDOW_MARGIN_S, full, SAMPLE_RATE)
        return None if frames == full else frames

    def encoder_input(self, key: str, features: torch.Tensor, cache_salt: str = "") -> EncoderInput:
        """A new reference to the window's cross K/V (encoded when the engine first admits a request holding it),
        shared only with requests of the same `cache_salt`."""
        return EncoderInput(key, source=self.worker.handle(key, features, cache_salt))

    def language_id(self, language: str | None) -> int | None:
        """The `<|xx|>` token of a BCP-47 code (`jv` for Whisper's `jw` and the like), an English name or the token's
        own text; for none, the checkpoint's forced language (a fine-tuned model's generation_config
        forced_decoder_ids, as transformers' generate uses it) or None for "detect". TranscriptionRequestError when
        the model does not know it."""
        if not language:
            return self.vocab.default_language
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        code = language.strip().removeprefix("<|").removesuffix("|>").replace("_", "-").split("-")[0].lower()
        code = TO_LANGUAGE_CODE.get(language.strip().lower(), code)
        if code not in self.vocab.languages and _WHISPER_CODES.get(code) in self.vocab.languages:
            code = _WHISPER_CODES[code]
        if not self.vocab.multilingual:
            if code != "en":
                raise TranscriptionRequestError("language", f"{language!r}: this model transcribes English only")
            return None
        if code not in self.vocab.languages:
            known = ", ".join(sorted(self.vocab.languages))
            raise TranscriptionRequestError(
                "language", f"{language!r} is not a language this model knows; known: {known}"
            )
        return self.vocab.languages[code]

    def check(self, language: str | None, task: str, timestamps: bool) -> int | None:
        """Validate a request's settings (TranscriptionRequestError naming the field); the language token or None."""
        lang = self.language_id(language)
        if task not in TASKS:
            raise TranscriptionRequestError("task", f"must be one of {', '.join(TASKS)}, got {task!r}")
        if task == "translate" and (not self.vocab.multilingual or self.vocab.translate is None):
            raise TranscriptionRequestError("task", "this model cannot translate (it is English-only)")
        if timestamps and self.vocab.timestamp_begin is None:
            raise TranscriptionRequestError("timestamps", "this model has no timestamp tokens")
        return lang

    def task_prompt(self, lang: int | None, task: str, timestamps: bool) -> list[int]:
        """`<|startoftranscript|>` [language] [task] [`<|notimestamps|>`]: what follows the previous-text prompt."""
        v = self.vocab
        ids = [v.sot]
        if v.multilingual:
            assert lang is not None, "a multilingual prompt needs its language (detect first)"
            ids.append(lang)
            ids.append(v.translate if task == "translate" else v.transcribe)  # type: ignore[arg-type]
        if not timestamps and v.no_timestamps is not None:
            ids.append(v.no_timestamps)
        return ids

    def prompt_tokens(self, text: str) -> list[int]:
        """A user prompt's tokens, as openai-whisper's initial_prompt (" " + text) and transformers' get_prompt_ids.
        Only the last 223 are ever used, so only the prompt's tail is tokenised (a whole 1 MB prompt took 0.8 s on
        the event loop, every other call waiting; its tail 4 ms)."""
        text = text.strip()
        ids = list(self.tokenizer(" " + text[-MAX_PROMPT_CHARS:], add_special_tokens=False).input_ids)
        # A special token's text ("<|de|>", "<|endoftext|>") would otherwise enter the decoder's prompt as that
        # token and steer or end it; transformers' get_prompt_ids and openai-whisper's tokenizer refuse it too.
        special = next((t for t in ids if not self.vocab.is_text(t)), None)
        if special is not None:
            token = self.tokenizer.convert_ids_to_tokens(special)
            raise TranscriptionRequestError("prompt", f"contains the special token {token!r}; the prompt is text")
        return ids

    def close(self) -> None:
        self.worker.shutdown()


def load_whisper_part(
    folder: Path,
    engine: Any,
    model_key: str,
    short_window_int8: bool = False,
    short_window_s: float | None = None,
) -> WhisperPart:
    """Special tokens, feature extractor and encoder worker of the Whisper folder `engine` was loaded from;
    `short_window_int8`: short windows through an int8 copy of the encoder, where it serves (CPU kernels, float32);
    `short_window_s`: Transcribe's and StreamingTranscribe's short window (EngineOptions.whisper_short_window_s)."""
    from transformers import WhisperFeatureExtractor

    from omnivox.models.audio.whisper_int8 import int8_encoder, int8_encoder_serves

    model = engine.model
    try:
        extractor = WhisperFeatureExtractor.from_pretrained(folder)
    except Exception as exc:
        raise ValueError(f"{folder}: cannot load its feature extractor (preprocessor_config.json): {exc}") from exc
    settings = MelSettings.from_feature_extractor(extractor, "max_length")
    if settings.n_mels != model.num_mel_bins:
        raise ValueError(
            f"{folder}: the extractor gives {settings.n_mels} mel bins, the model takes {model.num_mel_bins}"
        )
    if settings.max_frames != model.num_frames:  # transformers' encoder refuses such features at every call
        raise ValueError(
            f"{folder}: the feature extractor's window (chunk_length {settings.chunk_length} s = "
            f"{settings.max_frames} frames) does not match the encoder's (max_source_positions "
            f"{model.encoder_len} = {model.num_frames} frames)"
        )
    vocab = WhisperVocab.from_folder(folder, engine.tokenizer, model.config.vocab_size)
    device, dtype = engine.device, engine.dtype
    int8 = short_window_int8 and dtype == torch.float32 and int8_encoder_serves(device)
    short_encoder = int8_encoder(model.encoder) if int8 else None

    def encode(batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # [n_mels, F] each -> cross K/V each
        out: list[torch.Tensor | None] = [None] * len(batch)
        for frames in {f.shape[-1] for f in batch}:  # a batch may mix short windows and full ones: one call per size
            idx = [i for i, f in enumerate(batch) if f.shape[-1] == frames]
            encoder = short_encoder if frames < model.num_frames else None
            for i, kv in zip(idx, model.encode_cross([batch[i].to(device, dtype) for i in idx], encoder), strict=True):
                out[i] = kv
        return out  # type: ignore[return-value]

    worker = EncoderWorker(encode, EncoderCache(WHISPER_CACHE_BYTES), name="whisper", device=device)
    rules = WhisperRules(vocab, device)
    heads = heads_of(folder, model.config.num_layers, model.config.num_heads)
    return WhisperPart(engine, engine.tokenizer, vocab, LogMelExtractor(settings), worker, model_key, rules,
                       alignment_heads=heads, short_window_int8=int8, short_window_s=short_window_s)  # fmt: skip


def whisper_part_of(model: Any) -> WhisperPart:
    """A WhisperPart, or the part of a ServedModel / ModelBundle that serves Whisper."""
    if isinstance(model, WhisperPart):
        return model
    bundle = getattr(model, "bundle", model)
    part = getattr(bundle, "whisper", None)
    if part is None:
        raise TypeError(f"{model!r} is not a Whisper model")
    return part
