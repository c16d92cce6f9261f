"""Speech text splitting: sentences grouped into segments that are synthesised in parallel."""

from __future__ import annotations

import re

MAX_SEGMENT_CHARS = 300

_SENTENCE_END = re.compile(r"(?<=[.!?;…。！？])[\"')\]]*\s+|\n+")


def split_text(text: str, max_chars: int = MAX_SEGMENT_CHARS) -> list[str]:
    """Split at sentence boundaries, then group sentences into segments of at most max_chars (a longer sentence is
    split at commas or spaces)."""
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]
    pieces: list[str] = []
    for s in sentences:
        while len(s) > max_chars:
            cut = max(s.rfind(", ", 0, max_chars), s.rfind(" ", 0, max_chars))
            cut = cut + 1 if cut > 0 else max_chars
            pieces.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            pieces.append(s)
    segments: list[str] = []
    for p in pieces:
        if segments and len(segments[-1]) + 1 + len(p) <= max_chars:
            segments[-1] = f"{segments[-1]} {p}"
        else:
            segments.append(p)
    return segments
