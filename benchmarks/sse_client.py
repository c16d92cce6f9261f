"""A lean HTTP/1.1 client for streamed (SSE) POSTs on asyncio streams, for benchmarks/http_vs_grpc.py: keep-alive
connections in a pool, the request written in one call, the chunked body's SSE events handed over as they arrive.

Why not httpx: at concurrency 1 on the quiet machine, the same streamed chat's first token came 4-5 ms later through
httpx (its request building, connection pool and h11 parsing, in Python) than through this client, while the server's
own TTFT did not differ between the fronts (benchmarks/results/http-vs-grpc-cpu-*.json, BENCHMARKS.md); gRPC's
client is C-core. This one does about what grpc.aio's does for a call, so the two fronts are compared, not the two
clients' libraries. http_vs_grpc runs httpx beside it, as what a Python SDK user sees.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


class SseClient:
    """POSTs of JSON to one `host:port`, each answered by an SSE stream; at most `connections` open at once."""

    def __init__(self, host: str, port: int, connections: int) -> None:
        self.host, self.port = host, port
        self.idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.slots = asyncio.Semaphore(connections)

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, str]]:
        """(status, each event's data) as the events arrive; one connection held for the stream's length."""
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"accept: text/event-stream\r\ncontent-length: {len(payload)}\r\n\r\n").encode()  # fmt: skip
        async with self.slots:
            reader, writer = await self._connection()
            writer.write(head + payload)
            try:
                status_line = await reader.readline()
                if not status_line:  # the server closed an idle keep-alive connection (uvicorn: after 5 s): again
                    writer.close()
                    reader, writer = await self._open()
                    writer.write(head + payload)
                    status_line = await reader.readline()
                status = int(status_line.split()[1])
                chunked = await _headers(reader)
                async for data in _sse_data(reader, chunked):
                    yield status, data
            except BaseException:
                writer.close()
                raise
            self.idle.put_nowait((reader, writer))

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return self.idle.get_nowait() if not self.idle.empty() else await self._open()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait()[1].close()


async def _headers(reader: asyncio.StreamReader) -> bool:
    """Reads the response's headers; True when the body is chunked (else it is read to its Content-Length)."""
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    return chunked


async def _sse_data(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[str]:
    """The `data:` of each event of the body (an error body, not chunked, comes as one item)."""
    if not chunked:
        yield (await reader.read(1 << 20)).decode()
        return
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        pending += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        *events, pending = pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()
    await reader.readexactly(2)  # the last chunk's CRLF
