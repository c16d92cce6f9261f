"""Incremental detokenizer with stop strings.

Text is released only when it is final: never half of a multi-byte character (a byte-level token sequence can end
inside an emoji or a CJK character; the tokenizer then renders U+FFFD, and we wait for the next token), and never the
start of what may still become a stop string: only the longest tail of the text that some stop string starts with
is held back (at most len(longest stop) - 1 characters), so with stop=["\n\n"] a delta still ends where its token
does unless that token ended in a newline.
"""

from __future__ import annotations

# Tokens decoded before the read offset give the tokenizer the context it needs for spacing (sentencepiece merges
# a leading space into the first token, so decoding a token alone can differ from decoding it in context).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None,
        include_stop: bool,
        skip_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._firsts = {s[0] for s in self.stop if s}  # a held tail starts with one of these
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (possibly ending in a held-back stop prefix)
        self.released = 0  # characters of self.text already handed out

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string has appeared (the text is then cut at it)."""
        if self.tokenizer is None:
            return False
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # no complete character yet
        search_from = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if hits:
            at, s = min(hits)
            self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text that became final since the last call (all of it once the request has finished)."""
        end = len(self.text) if final or not self.stop else max(self.released, len(self.text) - self._held())
        delta = self.text[self.released : end]
        self.released = end
        return delta

    def _held(self) -> int:
        """Characters at the end of the text that a stop string starts with (they may still become one)."""
        text, firsts = self.text, self._firsts
        for n in range(min(self.hold, len(text) - self.released), 0, -1):
            if text[-n] in firsts and any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0

    @property
    def released_text(self) -> str:
        return self.text[: self.released]
