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

import contextlib
import weakref
from typing import Any

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


# tokenizer -> (its vocabulary size with added tokens, skipped ids): reading the added tokens took ~75 us a request
# with 300 of them; a size check (~3 us) notices tokens added since.
_SKIPPED: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]] = weakref.WeakKeyDictionary()


def skipped_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens marked special, which is what the
    `tokenizers` decoder checks (SmolLM2 marks 17; its `all_special_ids` names 3); else the ids the tokenizer names.
    Cached per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return frozenset(getattr(tokenizer, "all_special_ids", ()))
    size = backend.get_vocab_size(with_added_tokens=True)
    try:
        cached = _SKIPPED.get(tokenizer)
    except TypeError:  # neither hashable nor weakly referenceable: not cached
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    with contextlib.suppress(TypeError):
        _SKIPPED[tokenizer] = (size, ids)
    return ids


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
        # The decoded output text (possibly ending in a held-back stop prefix) is kept in parts, so that a token costs
        # O(its text), not O(the text so far): `text` joins them when read. `_tail` is the text's last `hold`
        # characters (where a stop string may have begun), `_pending` its characters not handed out yet.
        self._parts: list[str] = []
        self._length = 0
        self._tail = ""
        self._pending: list[str] = []
        self.released = 0  # characters of the text already handed out

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
        if not new:
            return False
        region = self._tail + new  # a stop string appearing now starts at most `hold` characters back
        start = self._length - len(self._tail)  # region's first character in the text
        self._parts.append(new)
        self._pending.append(new)
        self._length += len(new)
        self._tail = region[-self.hold :] if self.hold else ""
        hits = [(at, s) for s in self.stop if (at := region.find(s)) >= 0]
        if hits:
            at, s = min(hits)
            self._cut(start + at + (len(s) if self.include_stop else 0))
            return True
        return False

    def _cut(self, length: int) -> None:
        """Drop the text past `length` characters (a stop string was found; it never starts in released text)."""
        assert length >= self.released, "a stop string in text already released"
        text = "".join(self._parts)[:length]
        self._parts, self._length = [text], length
        self._pending = [text[self.released :]]
        self._tail = text[-self.hold :] if self.hold else ""

    @property
    def text(self) -> str:
        """All decoded output text (possibly ending in a held-back stop prefix); O(length) to read."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def take(self, final: bool) -> str:
        """The text that became final since the last call (all of it once the request has finished)."""
        if not self._pending:
            return ""
        held = 0 if final or not self.stop else self._held()
        pending = "".join(self._pending)
        delta = pending[: len(pending) - held]
        self._pending = [pending[len(delta) :]] if held else []
        self.released += len(delta)
        return delta

    def _held(self) -> int:
        """Characters at the end of the text that a stop string starts with (they may still become one)."""
        tail, firsts = self._tail, self._firsts
        for n in range(min(self.hold, self._length - self.released, len(tail)), 0, -1):
            if tail[-n] in firsts and any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    @property
    def released_text(self) -> str:
        return self.text[: self.released]
