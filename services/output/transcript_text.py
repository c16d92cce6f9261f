"""One segment's transcript as it is generated: the tokens so far -> text deltas that never have to be taken back.

An audio-LLM's answer may start with a header that is not transcript: Qwen3-ASR asked to detect the language writes
`language English<asr_text>` first (the family says so: `AudioEncoder.answer_header_tag`). The header is held back
(and read for the language) until its tag is complete; the transcript is what follows, decoded without special tokens, incrementally (the engine's
detokenizer: never half a character). Deltas are emitted only while they extend what was emitted: trailing whitespace
waits for the next token and leading whitespace is dropped, so the deltas joined equal the final, stripped text.
"""

from __future__ import annotations

from typing import Any

from omnivox.engine.detokenizer import IncrementalDetokenizer
from omnivox.models.audio import encoder_class

# A header (Qwen3-ASR's "language English<asr_text>") is a handful of tokens; an answer whose first tokens hold no tag
# has no header, and all of it is transcript (the search stops here, so it never rescans a long answer).
HEADER_MAX_TOKENS = 32


class SegmentTranscript:
    def __init__(self, tokenizer: Any, family: str, language: str | None) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.language = language or None
        self.header_tag = encoder_class(family).answer_header_tag(self.language)  # None: all of it is transcript
        self.ids: list[int] = []
        self.text_start: int | None = None  # index in ids where the transcript begins, once known
        self.detok: IncrementalDetokenizer | None = None  # the transcript's text, one token at a time (O(n) overall)
        self.header = ""
        self.emitted = ""
        if self.header_tag is None:
            self._start_text(0)

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _start_text(self, k: int) -> None:
        self.text_start = k
        self.detok = IncrementalDetokenizer(self.tokenizer, self.ids[:k], None, False, skip_special_tokens=True)
        for token_id in self.ids[k:]:
            self.detok.add(token_id)

    def _find_header(self) -> None:
        tag = self.header_tag
        assert tag is not None
        if tag in self._decode(self.ids, skip_special=False):
            # The fewest tokens whose text holds the whole tag: the transcript starts right after them.
            k = next(k for k in range(1, len(self.ids) + 1) if tag in self._decode(self.ids[:k], False))
            self.header = self._decode(self.ids[:k], skip_special=False)
            self._start_text(k)
        elif len(self.ids) >= HEADER_MAX_TOKENS:
            self._start_text(0)

    def text(self, final: bool = False) -> str:
        """The transcript so far (stripped at the start); when final, decoded whole and stripped at both ends."""
        if final:
            return self._decode(self.ids[self.text_start or 0 :]).strip()
        return self.detok.text.lstrip() if self.detok is not None else ""

    def feed(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text to emit now (may be empty)."""
        if self.detok is not None:
            for token_id in token_ids:
                self.detok.add(token_id)
        self.ids.extend(token_ids)
        if self.text_start is None:
            self._find_header()
        return self._delta(self.text().rstrip())

    def finish(self) -> str:
        """The text still to emit once the segment's generation has ended."""
        return self._delta(self.text(final=True))

    def _delta(self, visible: str) -> str:
        if not visible.startswith(self.emitted):  # a decode that changed its past: hold on until the final text
            return ""
        delta, self.emitted = visible[len(self.emitted) :], visible
        return delta

    def detected_language(self) -> str | None:
        """The BCP-47 code of the forced language, else of the one the header names; None when neither."""
        if self.language is not None:
            return encoder_class(self.family).parse_transcription("", self.language)[0]
        return encoder_class(self.family).parse_transcription(self.header + "x")[0] if self.header else None
