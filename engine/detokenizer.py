"""Incremental detokenizer with stop strings.

Text is released only when it is final: never half of a multi-byte character (a byte-level token sequence can end
inside an emoji or a CJK character; the tokenizer then renders U+FFFD, and we wait for the next token), and never the
start of what may still become a stop string: only the longest tail of the text that some stop string starts with
is held back (at most len(longest stop) - 1 characters), so with stop=["\n\n"] a delta still ends where its token
does unless that token ended in a newline.

Each token costs a bounded amount of work whatever the model emits (one decode call, two when text comes out, each
of at most 2 x _MAX_PENDING tokens): skipped special tokens never enter the window, and a window with no new complete
character for _MAX_PENDING tokens is moved on.
"""

from __future__ import annotations

# Tokens decoded before the read offset give the tokenizer the context it needs for spacing (sentencepiece merges
# a leading space into the first token, so decoding a token alone can differ from decoding it in context).
_CONTEXT_TOKENS = 5
# A window that has gone this many tokens without a complete new character is moved on anyway, keeping its last
# _KEEP_TOKENS (they hold any character still incomplete: at most 3 bytes, so at most 3 tokens), so the tokens each
# `add` decodes stay bounded whatever the model emits. Valid text waits that long only with byte-level BPE tokens
# that each end inside a character (a tiny tokenizer's CJK run waited 8); the text they release then is exact, since
# a byte-level decode renders only its last, unfinished character differently once more bytes come (invalid bytes
# are U+FFFD either way). SentencePiece's byte fallback renders a whole run of byte tokens as U+FFFD once any of
# them is invalid (a one-shot decode can turn an earlier character into U+FFFD); no stream can follow that, only
# invalid bytes get there. Before the window was bounded, a run of skipped special tokens held it open: quadratic.
_MAX_PENDING = 8
_KEEP_TOKENS = 4


def skipped_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens marked special, which is what the
    `tokenizers` decoder checks (SmolLM2 marks 17; its `all_special_ids` names 3); else the ids the tokenizer names."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


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
        # Skipped tokens never enter the window: decoding drops them anyway, and a run of them (a model emitting
        # special tokens) would otherwise hold the window open, re-decoding all of it at every token.
        self._skipped = skipped_token_ids(tokenizer) if skip_special_tokens and tokenizer is not None else frozenset()
        # The window: ids[:read_offset] is context already released, ids[read_offset:] awaits a complete character;
        # the first `done` characters of the window's text are already released (the context's text).
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)
        self.done = len(self._decode(self.ids)) if tokenizer is not None else 0
        self.text = ""  # all decoded output text (possibly ending in a held-back stop prefix)
        self.released = 0  # characters of self.text already handed out

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string has appeared (the text is then cut at it)."""
        if self.tokenizer is None or token_id in self._skipped:
            return False
        self.ids.append(token_id)
        full = self._decode(self.ids)
        if len(full) > self.done and not full.endswith("\ufffd"):
            new = full[self.done :]
            del self.ids[: self.read_offset]  # the tokens just released become the next window's context
        elif len(self.ids) - self.read_offset >= _MAX_PENDING:
            # Forced on: all but an unfinished last character is final (see _MAX_PENDING).
            new = full[self.done : len(full) - full.endswith("\ufffd")]
            del self.ids[:-_KEEP_TOKENS]
        else:
            return False  # no complete character yet
        self.read_offset = len(self.ids)
        window = self._decode(self.ids)
        self.done = len(window) - (window.endswith("\ufffd") and full.endswith("\ufffd"))
        search_from = max(0, len(self.text) - self.hold)
        self.text += new
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if hits:
            at, s = min(hits)
            self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
            return True
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

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
