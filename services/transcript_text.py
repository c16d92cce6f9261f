"""One segment's transcript as it is generated: the tokens so far -> text deltas that never have to be taken back.

An audio-LLM's answer may start with a header that is not transcript: Qwen3-ASR asked to detect the language writes
`language English<asr_text>` first. The header is held back (and read for the language) until its `<asr_text>` tag
is complete; the transcript is what follows, decoded without special tokens. Deltas are emitted only while they
extend what was emitted: trailing whitespace and a trailing partial character (U+FFFD) wait for the next token, and
leading whitespace is dropped, so the deltas joined equal the final, stripped text.
"""

from __future__ import annotations

from typing import Any

from omnivox.models.audio.transcription import ASR_TEXT, parse_transcription


class SegmentTranscript:
    def __init__(self, tokenizer: Any, family: str, language: str | None) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.language = language or None
        # Only a Qwen3-ASR answer without a forced language starts with a header (the prefill holds it otherwise).
        self.expect_header = family == "qwen3_asr" and self.language is None
        self.ids: list[int] = []
        self.text_start: int | None = None if self.expect_header else 0  # index in ids where the transcript begins
        self.header = ""
        self.emitted = ""

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _find_header(self) -> None:
        raw = self._decode(self.ids, skip_special=False)
        if ASR_TEXT not in raw:
            return
        # The fewest tokens whose text holds the whole tag: the transcript starts right after them.
        k = next(k for k in range(1, len(self.ids) + 1) if ASR_TEXT in self._decode(self.ids[:k], skip_special=False))
        self.text_start = k
        self.header = self._decode(self.ids[:k], skip_special=False)

    def text(self, final: bool = False) -> str:
        """The transcript so far (stripped at the start; at the end too when final)."""
        if self.text_start is None:
            if not final:
                return ""
            return self._decode(self.ids).strip()  # no header after all: all of it is the transcript
        text = self._decode(self.ids[self.text_start :]).lstrip()
        return text.strip() if final else text

    def feed(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text to emit now (may be empty)."""
        self.ids.extend(token_ids)
        if self.text_start is None:
            self._find_header()
        return self._delta(self.text().rstrip().removesuffix("\ufffd").rstrip())

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
            return parse_transcription(self.family, "", self.language)[0]
        return parse_transcription(self.family, self.header + "x")[0] if self.header else None
