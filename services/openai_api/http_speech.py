"""The HTTP front's speech routes: POST /v1/audio/speech and GET /v1/audio/voices, over the same speech processing as
gRPC's SpeechService (services/calls/speech_call.py `SpeechCalls`: the same models, limits, metrics and created voices).

/v1/audio/speech streams the audio as it is synthesised: the body is the encoded file (wav, flac, Ogg Opus, raw pcm),
or with `"stream_format": "sse"` OpenAI's `speech.audio.delta` events (base64 chunks of that file) and one
`speech.audio.done` with the usage. A refusal (bad field, unknown voice, queue full, draining) comes before the first
byte, as an HTTP status; a client that disconnects closes the synthesis, which aborts its engine requests.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omnivox.services.calls.speech_call import SpeechCalls
from omnivox.services.errors import ServiceError
from omnivox.services.openai_api.http_front import (
    HttpFront,
    error_response,
    until_disconnect,
)
from omnivox.services.openai_api.http_streams import ClosingStreamingResponse, StreamBroken, sse_event
from omnivox.services.openai_api.openai_speech import audio_delta, audio_done, speech_body, speech_param, voice_object

log = logging.getLogger(__name__)


class SpeechRoutes:
    """The two routes on `front`'s app; their calls go through `front.call` (auth, quotas, the log line, errors)."""

    def __init__(self, front: HttpFront, calls: SpeechCalls) -> None:
        self.front, self.calls = front, calls
        front.app.post("/v1/audio/speech")(self.speech)
        front.app.get("/v1/audio/voices")(self.voices)

    async def speech(self, request: Request) -> Response:
        return await self.front.call(request, "AudioSpeech", self._speech, param_of=speech_param)

    async def voices(self, request: Request) -> Response:
        return await self.front.call(request, "AudioVoices", self._voices, param_of=speech_param)

    async def _voices(self, request: Request) -> Response:
        query = request.query_params
        voices = self.calls.list_voices(query.get("model", ""), query.get("language", ""))
        return JSONResponse({"object": "list", "data": [voice_object(v) for v in voices]})

    async def _speech(self, request: Request) -> Response:
        body = speech_body(await self.front.body(request))
        responses = self.calls.synthesize(body.request)
        try:  # the format message: every refusal comes before it, so it is an HTTP status, not a broken stream
            await until_disconnect(request, anext(responses))
        except BaseException:
            await responses.aclose()
            raise
        if body.sse:
            return ClosingStreamingResponse(_events(responses), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})  # fmt: skip
        return ClosingStreamingResponse(_audio(responses), media_type=body.response_format.media_type)


async def _audio(responses: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The audio chunks' bytes (one file). A failure after the first byte cannot change the status: it breaks the
    transfer (the chunked body never ends), so the client sees an error, not a short file that looks whole; the
    server logs one line and counts the call with the failure's code (StreamBroken: no traceback)."""
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                if response.WhichOneof("response") == "audio":
                    yield response.audio.data
        except ServiceError as err:
            log.warning("speech failed after its first byte: %s %s", err.code.name, err.message)
            raise StreamBroken(err.code) from None


async def _events(responses: AsyncIterator[Any]) -> AsyncIterator[str]:
    """`speech.audio.delta` events, then `speech.audio.done`; a failure after the first byte is one error event."""
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                kind = response.WhichOneof("response")
                if kind == "audio":
                    yield sse_event(audio_delta(response.audio.data))
                elif kind == "summary":
                    yield sse_event(audio_done(response.summary))
        except ServiceError as err:
            yield sse_event(json.loads(error_response(err, param_of=speech_param).body))
