"""A speech body that fails after its first byte (services/openai_api/http_speech.py `_audio`), served by a real
uvicorn on a real port: the transfer breaks (the client sees an incomplete body, not a short file that looks whole),
the server logs one warning line and no traceback, and the call ends with the failure's code."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from omnivox.services import errors
from omnivox.services.errors import Code
from omnivox.services.openai_api.http_speech import _audio
from omnivox.services.openai_api.http_streams import ClosingStreamingResponse
from omnivox.v1 import speech_pb2


async def _synthesis_failing_after_one_chunk():
    yield speech_pb2.SynthesizeSpeechResponse(audio=speech_pb2.AudioChunk(data=b"RIFF" + bytes(60)))
    await asyncio.sleep(0.05)  # the first chunk is on the wire before the failure
    raise errors.internal("the codec failed")


def test_a_failure_after_the_first_byte_breaks_the_transfer_without_a_traceback(caplog) -> None:
    ended: list[Code] = []
    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech() -> ClosingStreamingResponse:
        response = ClosingStreamingResponse(_audio(_synthesis_failing_after_one_chunk()), media_type="audio/wav")
        response.on_end = ended.append
        return response

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    caplog.set_level(logging.INFO)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        received = bytearray()
        url = f"http://127.0.0.1:{port}/v1/audio/speech"
        # the chunked body never ends: incomplete, not a whole file
        with pytest.raises(httpx.RemoteProtocolError), httpx.stream("POST", url, timeout=30) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                received += chunk
        assert bytes(received[:4]) == b"RIFF"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert ended == [Code.INTERNAL]  # the call's log line and status counter get the failure's code
    assert not [r for r in caplog.records if r.exc_info]  # no traceback (uvicorn's "Exception in ASGI application")
    ours = [r for r in caplog.records if "after its first byte" in r.getMessage()]
    assert len(ours) == 1 and "INTERNAL" in ours[0].getMessage()
