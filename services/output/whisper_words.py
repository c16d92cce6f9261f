"""Word timestamps of a kept Whisper window (TranscribeRequest.word_timestamps): the window's tokens re-read by the
decoder against its cross K/V, the checkpoint's alignment heads' attention warped onto the audio's frames
(models/audio/whisper_alignment.py, transformers' and openai-whisper's method), then the tokens grouped into words.

A token's time is the row that predicts it (openai-whisper's `find_alignment`: the prompt's last token predicts the
first text token, end-of-text's row ends the last word). A word starts at its first token's time and ends where the
next word (or, for the last word of a segment, the next token: a timestamp or end-of-text) starts; its probability
is the mean of its tokens' (the decode's own, of the processed logits). A token with a leading space opens a word;
one of punctuation alone joins the word before it. Languages written without spaces (openai-whisper's
`split_tokens_on_unicode` set: zh, ja, th, lo, my, yue) have no leading spaces to go by: there each run of tokens that
decodes to whole characters is a word (mostly one character), as openai-whisper splits them. Checkpoints that name no `alignment_heads` use every head of the
decoder's second half (openai-whisper's default).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnivox.models.audio.whisper_alignment import alignment_heads, cross_attention_weights, row_times

HOP = 160  # samples per mel frame (10 ms at 16 kHz)
_PUNCTUATION = set(string.punctuation) | set("。，！？：”、¿“")
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # openai-whisper's split_tokens_on_unicode set


@dataclass(frozen=True)
class TimedWord:
    word: str
    start: float  # seconds from the start of the audio
    end: float
    probability: float


def heads_of(folder: Path, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """The checkpoint's alignment heads (generation_config.json), else the second half of the decoder's heads."""
    try:
        named = alignment_heads(json.loads((Path(folder) / "generation_config.json").read_text()))
    except (OSError, ValueError):
        named = []
    return named or [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


def token_times(part: Any, cross: Any, prompt: list[int], tokens: list[int], num_samples: int) -> np.ndarray:
    """Seconds (from the window's start) at which each of `tokens` is said, plus one for end-of-text: len + 1."""
    weights = cross_attention_weights(part.engine.model, prompt + tokens, cross, part.alignment_heads)
    return row_times(weights, len(prompt) - 1, max(2, math.ceil(num_samples / HOP)))


def words_by_segment(
    part: Any, tokens: Sequence[int], times: np.ndarray, logprobs: Sequence[float], offset: float, end: float,
    language: str | None = None,
) -> list[list[TimedWord]]:  # fmt: skip
    """The text tokens of a window as words, one list per segment (a run of text between timestamp tokens; the whole
    window without timestamps). `times` [len(tokens) + 1], `logprobs` [len(tokens)]; `language` (a code) in
    NO_SPACE_LANGUAGES splits at character boundaries instead of spaces."""
    vocab, tokenizer = part.vocab, part.tokenizer
    groups: list[list[TimedWord]] = []
    current: list[list[int]] = []  # token positions per word of the open segment
    by_character = language in NO_SPACE_LANGUAGES
    partial: list[int] = []  # by_character: positions of tokens whose bytes end inside a character

    def close(next_position: int) -> None:
        if not current:
            return
        words = []
        for w, positions in enumerate(current):
            # decoded whole: a character's bytes may span its tokens (decoded alone, each is U+FFFD)
            text = tokenizer.decode([tokens[p] for p in positions], skip_special_tokens=True)
            stop = current[w + 1][0] if w + 1 < len(current) else next_position
            start_s = min(end, offset + float(times[positions[0]]))
            end_s = min(end, max(start_s, offset + float(times[stop])))
            probability = float(np.mean([math.exp(logprobs[p]) for p in positions]))
            words.append(TimedWord(text.strip(), start_s, end_s, probability))
        groups.append(words)
        current.clear()

    for position, token in enumerate(tokens):
        if not vocab.is_text(token):
            partial.clear()  # bytes of a character cut by a timestamp: dropped as the decoded text drops them
            close(position)
            continue
        if by_character:
            positions = [*partial, position]
            text = tokenizer.decode([tokens[p] for p in positions], skip_special_tokens=True)
            if "\ufffd" in text:  # the character's bytes go on in the next token
                partial.append(position)
                continue
            partial.clear()
            opens = bool(text.strip()) and text.strip() not in _PUNCTUATION
        else:
            positions, text = [position], tokenizer.decode([token], skip_special_tokens=True)
            opens = text.startswith(" ") and bool(text.strip()) and text.strip() not in _PUNCTUATION
        if current and not opens:
            current[-1] += positions
        else:
            current.append(positions)
    close(len(tokens))
    return groups
