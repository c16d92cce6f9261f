"""The HTTP front's transcription routes: POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI's
multipart form), over the same request and output processing as gRPC's Transcribe (services/calls/transcribe_call.py).

The answer is the whole transcript in the asked response_format (json, text, srt, vtt, verbose_json), or with
`stream=true` OpenAI's `transcript.text.delta` events as the text comes and one `transcript.text.done`. A refusal
(bad field, unknown model, queue full, draining) comes before the first byte, as an HTTP status; a client that
disconnects cancels the transcription, which aborts its engine requests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omnivox.services import errors
from omnivox.services.calls.transcribe_call import transcribe_responses
from omnivox.services.errors import FieldViolation, ServiceError
from omnivox.services.metrics import Metrics
from omnivox.services.openai_api.http_front import (
    HttpFront,
    error_response,
    read_capped,
    until_disconnect,
)
from omnivox.services.openai_api.http_streams import ClosingStreamingResponse, sse_event
from omnivox.services.openai_api.openai_transcription import (
    MEDIA_TYPES,
    TranscriptionForm,
    delta_event,
    done_event,
    json_body,
    text_body,
    transcription_form,
    transcription_param,
)
from omnivox.services.parts.registry import ModelRegistry


class TranscriptionRoutes:
    """The two routes on `front`'s app; their calls go through `front.call` (auth, quotas, the log line, errors)."""

    def __init__(self, front: HttpFront, registry: ModelRegistry, metrics: Metrics) -> None:
        self.front, self.registry, self.metrics = front, registry, metrics
        front.app.post("/v1/audio/transcriptions")(self.transcriptions)
        front.app.post("/v1/audio/translations")(self.translations)

    async def transcriptions(self, request: Request) -> Response:
        return await self.front.call(request, "AudioTranscriptions", self._transcribe, param_of=transcription_param)

    async def translations(self, request: Request) -> Response:
        return await self.front.call(request, "AudioTranslations", self._translate, param_of=transcription_param)

    async def _translate(self, request: Request) -> Response:
        return await self._transcribe(request, translate=True)

    async def _form(self, request: Request, translate: bool) -> TranscriptionForm:
        await read_capped(request, self.front.max_body_bytes)  # a chunked upload too: 413 past the limit
        try:
            form = await request.form()
        except Exception as exc:  # noqa: BLE001 - starlette's parser: not multipart, or a broken body
            raise errors.invalid_argument(
                [FieldViolation("file", f"the body is not multipart/form-data: {exc}")]
            ) from None
        try:
            upload: Any = form.get("file")
            audio = await upload.read() if upload is not None and not isinstance(upload, str) else None
            return transcription_form(form, audio, translate)
        finally:
            await form.close()  # the upload's spooled temporary file

    async def _transcribe(self, request: Request, translate: bool = False) -> Response:
        form = await self._form(request, translate)
        responses = transcribe_responses(form.request, self.registry, self.metrics)
        if form.stream:
            try:  # the first response: every refusal comes before it, so it is an HTTP status, not a broken stream
                first = await until_disconnect(request, anext(responses))
            except BaseException:
                await responses.aclose()
                raise
            return ClosingStreamingResponse(_events(first, responses), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})  # fmt: skip
        summary = await until_disconnect(request, _summary(responses))
        if form.response_format in ("json", "verbose_json"):
            return JSONResponse(json_body(summary, form))
        return Response(text_body(summary, form.response_format), media_type=MEDIA_TYPES[form.response_format])


async def _summary(responses: AsyncIterator[Any]) -> Any:
    async with contextlib.aclosing(responses):
        async for response in responses:
            if response.WhichOneof("response") == "summary":
                return response.summary
    raise errors.internal("the transcription ended without a summary")


async def _events(first: Any, responses: AsyncIterator[Any]) -> AsyncIterator[str]:
    """`transcript.text.delta` events, then `transcript.text.done`; a failure after the first byte is one error
    event."""
    async with contextlib.aclosing(responses):
        try:
            response = first
            while response.WhichOneof("response") != "summary":
                yield sse_event(delta_event(response.delta))
                response = await anext(responses)
            yield sse_event(done_event(response.summary))
        except ServiceError as err:
            yield sse_event(json.loads(error_response(err, param_of=transcription_param).body))
