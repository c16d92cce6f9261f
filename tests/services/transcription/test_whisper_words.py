"""Word grouping of a kept Whisper window (services/output/whisper_words.py) on a real byte-level BPE tokenizer (the
test Whisper's: SmolLM2's plus Whisper's specials), where a CJK character's UTF-8 bytes span several tokens."""

from __future__ import annotations

import numpy as np
from support.whisper_checkpoints import whisper_tokenizer

from omnivox.services.output.whisper_words import words_by_segment
from omnivox.services.processing.whisper_rules import WhisperVocab


class _Part:  # the two things words_by_segment reads of a WhisperPart
    def __init__(self, tokenizer, vocab: WhisperVocab) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab


def _words(text: str, language: str, tmp_path) -> list:
    tok = whisper_tokenizer()
    part = _Part(tok, WhisperVocab.from_folder(tmp_path, tok, len(tok)))
    tokens = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in tokens)  # characters cut across tokens: the partial path runs
    times = np.linspace(0.0, 2.0, len(tokens) + 1)
    (words,) = words_by_segment(part, tokens, times, [-0.1] * len(tokens), offset=1.0, end=10.0, language=language)
    return words


def test_chinese_splits_per_character_with_punctuation_kept(tmp_path) -> None:
    """zh (no spaces between words): one word per character, punctuation on the character before it, as openai-whisper
    splits it (red before: the whole sentence was one word)."""
    words = _words("你好，世界。", "zh", tmp_path)
    assert [w.word for w in words] == ["你", "好，", "世", "界。"]
    for before, word in zip(words, words[1:], strict=False):
        assert before.start <= before.end == word.start <= word.end  # monotonic, each ends where the next starts
    assert words[0].start >= 1.0 and words[-1].end <= 3.0  # offset by the window's start, inside the tokens' span


def test_english_still_splits_at_spaces(tmp_path) -> None:
    words = _words("Tokyo 東京 is big.", "en", tmp_path)
    assert [w.word for w in words] == ["Tokyo", "東京", "is", "big."]
