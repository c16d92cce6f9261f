"""Speech text splitting: sentences grouped into segments that are synthesised in parallel."""

from __future__ import annotations

import re

MAX_SEGMENT_CHARS = 300

_CLOSERS = "[\"')\\]」』）]*"  # kept with the sentence they close
# A sentence ends at Latin punctuation followed by a space, at CJK punctuation (no space follows it), or at a newline.
_SENTENCE_END = re.compile(rf"[.!?;…]{_CLOSERS}(?=\s)|[。！？；]{_CLOSERS}|\n")
_SOFT_BREAKS = (", ", "，", "、", " ")  # where an over-long sentence is cut, by preference


def _sentences(text: str) -> list[str]:
    pieces, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        pieces.append(text[start : m.end()])
        start = m.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


def split_text(text: str, max_chars: int = MAX_SEGMENT_CHARS) -> list[str]:
    """Split at sentence boundaries, then group sentences into segments of at most max_chars (a longer sentence is
    split at a comma, else a space, else at max_chars)."""
    pieces: list[str] = []
    for s in _sentences(text):
        while len(s) > max_chars:
            cut = max((_end_of_last(s[:max_chars], b) for b in _SOFT_BREAKS), default=0) or max_chars
            pieces.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            pieces.append(s)
    segments: list[str] = []
    for p in pieces:
        # CJK text has no space between sentences; other text joins with one
        sep = "" if segments and (_is_cjk(segments[-1][-1]) or _is_cjk(p[0])) else " "
        if segments and len(segments[-1]) + len(sep) + len(p) <= max_chars:
            segments[-1] = f"{segments[-1]}{sep}{p}"
        else:
            segments.append(p)
    return segments


def _end_of_last(text: str, brk: str) -> int:
    """Where the text after the last `brk` in `text` starts; 0 when there is none."""
    i = text.rfind(brk)
    return i + len(brk) if i > 0 else 0


def _is_cjk(ch: str) -> bool:
    """CJK ideographs, kana, Hangul and their full-width punctuation."""
    o = ord(ch)
    return 0x3000 <= o <= 0x9FFF or 0xAC00 <= o <= 0xD7AF or 0xFF00 <= o <= 0xFFEF or 0x20000 <= o <= 0x2FFFF
