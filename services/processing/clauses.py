"""Text streamed in -> clauses to speak (request processing of StreamingSynthesizeSpeech, for both the engine's speech
models and the voices): where a clause ends, and when text that ends at clause punctuation counts as complete."""

from __future__ import annotations

import re

DEFAULT_MAX_CLAUSE_CHARS = 120

SETTLE_S = 0.25  # text ending at clause punctuation is a complete clause after this long with no more text
_CLOSER = "\"')\\]」』）"
_CLOSERS = f"[{_CLOSER}]*"
# Latin punctuation ends a clause when a space follows (so "3.5" and "e.g." stay whole); CJK punctuation when any
# character but a closing quote or bracket does (no space follows it).
_BOUNDARY = re.compile(rf"[,;:.!?…]{_CLOSERS}(?=\s)|[。！？，、；：]{_CLOSERS}(?=[^{_CLOSER}])")
_WORD = re.compile(r"\w")  # a letter or digit, any script
_ENDS_AT_BOUNDARY = re.compile(rf"[,;:.!?…。！？，、；：]{_CLOSERS}\s*$")


class ClauseCutter:
    """Text chunks in, complete clauses out (`feed`), the rest at the end (`flush`). A piece with no letter or digit
    (the '!' of a '?!' whose '?' was cut when the text paused, a lone quote or emoji) has nothing to say: dropped, not
    spoken as a clause of its own."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CLAUSE_CHARS) -> None:
        self.max_chars = max_chars
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        clauses = []
        while True:
            m = _BOUNDARY.search(self.buffer)
            if m is not None and m.end() <= self.max_chars:
                cut = m.end()
            elif len(self.buffer) > self.max_chars:
                space = self.buffer.rfind(" ", 0, self.max_chars)
                cut = space if space > 0 else self.max_chars
            else:
                break
            clause, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:].lstrip()
            if _WORD.search(clause):
                clauses.append(clause)
        return clauses

    def flush(self) -> list[str]:
        rest, self.buffer = self.buffer.strip(), ""
        return [rest] if _WORD.search(rest) else []

    def ends_at_boundary(self) -> bool:
        """The text held ends at clause punctuation: a complete clause unless more text follows (`flush` it when
        none comes)."""
        return _ENDS_AT_BOUNDARY.search(self.buffer) is not None
