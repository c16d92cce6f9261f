"""The HTTP front's streamed bodies: a StreamingResponse that closes its iterator however the response ends (so the
engine request aborts at once) and reports the code it ended with, and the SSE framing every streamed route uses."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import StreamingResponse

from omnivox.services.errors import Code


class StreamBroken(Exception):
    """Raised by a body iterator whose call failed after the first byte (already logged in one line): the response
    ends there without its last chunk, so the client sees a broken transfer, not a short file that looks whole, and
    no traceback is logged; `code` is what the call's log line and status counter get."""

    def __init__(self, code: Code) -> None:
        super().__init__(code.name)
        self.code = code


class ClosingStreamingResponse(StreamingResponse):
    """A streamed body whose iterator is closed however the response ends (Starlette cancels the sending task on a
    client disconnect but leaves the iterator to the garbage collector): the engine request aborts at once."""

    on_end: Any = None  # called with the gRPC code the stream ended with (the call's log line, quota)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        code = Code.OK
        try:
            await super().__call__(scope, receive, send)
        except StreamBroken as broken:  # uvicorn closes the connection of a response left incomplete
            code = broken.code
        except BaseException:
            code = Code.CANCELLED
            raise
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self.on_end is not None:
                self.on_end(code)


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
