"""The config-first bidirectional streams (StreamingSynthesizeSpeech, StreamingTranscribe): the one handshake that
reads their config, and the one way their writers wait for the next item while their tasks run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from omnivox.services import errors
from omnivox.services.errors import FieldViolation


async def first_config(requests: AsyncIterator[Any]) -> Any:
    """The stream's first message's `config`; INVALID_ARGUMENT on `config` when the stream ends first or begins with
    another message."""
    try:
        first = await anext(aiter(requests))
    except StopAsyncIteration:
        raise errors.invalid_argument(
            [FieldViolation("config", "the stream ended before the config message")]
        ) from None
    if first.WhichOneof("request") != "config":
        raise errors.invalid_argument([FieldViolation("config", "the first message must be the config")])
    return first.config


async def next_item(queue: asyncio.Queue, tasks: list[asyncio.Task]):
    """The queue's next item; a failed task (a reader, a producer, a pass) ends the call with its error (both
    bidirectional streams: StreamingTranscribe and StreamingSynthesizeSpeech)."""
    getter = asyncio.ensure_future(queue.get())
    try:
        while True:
            pending = [t for t in tasks if not t.done()]
            await asyncio.wait([getter, *pending], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if getter.done():
                return getter.result()
    finally:
        if not getter.done():
            getter.cancel()
