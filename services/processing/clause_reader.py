"""StreamingSynthesizeSpeech's text side, for both the engine's speech models (services/output/clause_synthesis.py) and the
voices (services/calls/voice_speech.py): the client's messages after the config -> complete clauses on a queue.

Text is cut by services/processing/clauses.py `ClauseCutter`; text ending at clause punctuation is a complete clause once no more
text came for `settle_s` (SETTLE_S). The queue gets `(clause, when its text was complete)` items, then None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.processing.clauses import ClauseCutter
from omnivox.services.processing.stream_idle import idle_bounded

ClauseQueue = asyncio.Queue  # of tuple[str, float] | None


async def read_clauses(
    requests: AsyncIterator[Any],
    cutter: ClauseCutter,
    clauses: ClauseQueue,
    max_text_chars: int,
    settle_s: float,
    stream_idle_s: float | None,
    busy: Callable[[], bool],
) -> float:
    """Read text messages until `end` or the end of the stream (bounded by `stream_idle_s` while not `busy()`), queue
    each complete clause, then the rest and None; returns when the end of the text was read (time.monotonic())."""
    total, loop = 0, asyncio.get_running_loop()
    settle: asyncio.TimerHandle | None = None

    def settled(arrived: float) -> None:  # no text came after the clause punctuation: the clause is complete
        for clause in cutter.flush():
            clauses.put_nowait((clause, arrived))

    try:
        async for req in idle_bounded(requests, stream_idle_s, "text", busy, lambda r: bool(r.text.strip())):
            kind = req.WhichOneof("request")
            if kind == "end":
                break
            if kind == "config":
                raise errors.invalid_argument([FieldViolation("config", "only the first message may be a config")])
            if kind != "text":
                raise errors.invalid_argument(
                    [FieldViolation("request", "a message after the config sets none of text, end")]
                )
            total += len(req.text)
            if total > max_text_chars:
                raise errors.invalid_argument([FieldViolation("text", f"more than {max_text_chars} characters in all")])
            now = time.monotonic()
            for clause in cutter.feed(req.text):
                clauses.put_nowait((clause, now))
            if settle is not None:
                settle.cancel()
            settle = loop.call_later(settle_s, settled, now) if cutter.ends_at_boundary() else None
    finally:
        if settle is not None:
            settle.cancel()
    text_end = time.monotonic()
    for clause in cutter.flush():
        clauses.put_nowait((clause, text_end))
    clauses.put_nowait(None)
    return text_end
