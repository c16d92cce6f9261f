"""The idle bound of the bidirectional streams (StreamingTranscribe, StreamingSynthesizeSpeech).

An open stream holds one of its model's `--max-queue` slots for as long as the client keeps it open, so a client that
opens one and then sends nothing could shut everyone else out. As Google Cloud Speech-to-Text ends a stream that
receives no audio for a while ("Audio Timeout Error", OUT_OF_RANGE), a stream whose next message does not come within
`serve --stream-idle-timeout` seconds ends with OUT_OF_RANGE, freeing its slot; 0 turns the bound off. Only a
message that carries work (audio samples, text) counts: a client sending empty chunks or finalize after finalize kept
its slot for ever while any message reset the clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from omnivox.services.errors import Code, ServiceError

T = TypeVar("T")

DEFAULT_STREAM_IDLE_S = 30.0


async def idle_bounded(
    requests: AsyncIterator[T],
    idle_s: float | None,
    waiting_for: str,
    busy: Callable[[], bool] = lambda: False,
    carries_work: Callable[[T], bool] = lambda _: True,
) -> AsyncIterator[T]:
    """`requests`' messages; OUT_OF_RANGE when none that `carries_work` comes for idle_s while the call has nothing of
    the client's in hand (`busy()` false: a client may wait, not sending, while its text is spoken or its utterance
    transcribed). Messages without work (an empty chunk, a finalize) are passed on but do not reset the clock. While
    `busy()` the bound moves idle_s on, so an idle call ends idle_s to 2 x idle_s after its work ran out. None or 0:
    no bound."""
    it = aiter(requests)
    pending: asyncio.Future | None = None
    deadline = time.monotonic() + (idle_s or 0)
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(it))
            if idle_s:  # past the deadline: timeout 0, so a stream of messages without work cannot hold it open
                done, _ = await asyncio.wait([pending], timeout=max(deadline - time.monotonic(), 0))
            else:
                done, _ = await asyncio.wait([pending])
            if not done:
                if busy():
                    deadline = time.monotonic() + idle_s
                    continue
                raise ServiceError(
                    Code.OUT_OF_RANGE,
                    f"no {waiting_for} for {idle_s:g} s: the stream is closed (send at least that often, or end the "
                    "stream; the server's --stream-idle-timeout sets the bound)",
                )
            try:
                req = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            if idle_s and carries_work(req):
                deadline = time.monotonic() + idle_s
            yield req
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        elif pending is not None and not pending.cancelled():
            # The next message (or the end of the stream) came as the call was cancelled: retrieved here, or asyncio
            # logs "Task exception was never retrieved" (StopAsyncIteration) for a cancelled stream.
            pending.exception()
