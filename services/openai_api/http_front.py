"""The OpenAI-compatible HTTP front (`omnivox serve --http-port PORT`): FastAPI on uvicorn, in the gRPC server's
process and event loop, over the same registry, engines, auth (Bearer keys and quotas), metrics and logs.

Requests become GenerateRequests (services/openai_api/openai_request.py) and go through the same request and output processing
as gRPC's Generate (services/calls/generate_call.py); responses become OpenAI's JSON (services/openai_api/openai_output.py). Errors
are OpenAI's {"error": {message, type, param, code}} with the HTTP status of the gRPC code. A client that disconnects
cancels its request, which aborts the engine request and frees its KV blocks, as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from google.rpc import error_details_pb2

from omnivox.engine.params import MAX_SEED
from omnivox.services import call_record, errors
from omnivox.services.calls.generate_call import generate_responses
from omnivox.services.errors import Code, ServiceError
from omnivox.services.grpc_api.auth import AuthInterceptor
from omnivox.services.metrics import Metrics
from omnivox.services.openai_api.http_call_gate import CallGate
from omnivox.services.openai_api.http_streams import ClosingStreamingResponse, sse_event
from omnivox.services.openai_api.openai_output import ChatOutput
from omnivox.services.openai_api.openai_request import chat_request, choices, completion_request, openai_param
from omnivox.services.openai_api.realtime.limits import RealtimeLimits
from omnivox.services.openai_api.realtime.route import RealtimeRoute
from omnivox.services.parts.registry import ModelRegistry, ModelState

log = logging.getLogger(__name__)

_STATUS = {  # gRPC code -> (HTTP status, OpenAI error type)
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.OUT_OF_RANGE: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNAVAILABLE: (503, "service_unavailable"),
    Code.DEADLINE_EXCEEDED: (504, "timeout"),
    Code.UNIMPLEMENTED: (501, "not_implemented"),
}


def error_response(
    err: ServiceError, completion: bool = False, param_of: Callable[[str], str] | None = None
) -> JSONResponse:
    """OpenAI's error JSON with the HTTP status of the gRPC code; `param_of` maps a violation's wire field to the
    OpenAI parameter (default: the chat or completion request's)."""
    status, kind = _STATUS.get(err.code, (500, "server_error"))
    if isinstance(err, BodyTooLarge):
        status, kind = err.http_status, "invalid_request_error"
    violations = err.field_violations
    message, param, code = err.message, None, err.code.name.lower()
    if violations:
        named = [(param_of(v.field) if param_of else openai_param(v.field, completion), v.description)
                 for v in violations]  # fmt: skip
        message = "; ".join(f"{p}: {d}" for p, d in named)
        param = named[0][0]
    headers = {}
    for detail in err.details:
        if isinstance(detail, error_details_pb2.RetryInfo):
            headers["Retry-After"] = str(max(1, math.ceil(detail.retry_delay.ToNanoseconds() / 1e9)))
        if isinstance(detail, error_details_pb2.ResourceInfo) and detail.resource_type in ("model", "voice"):
            code, param = f"{detail.resource_type}_not_found", detail.resource_type
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class HttpFront:
    """The FastAPI app and its uvicorn server; `start()` listens, `stop()` closes (after the gRPC drain)."""

    def __init__(
        self, registry: ModelRegistry, metrics: Metrics, auth: AuthInterceptor | None, max_body_bytes: int,
        realtime_limits: RealtimeLimits | None = None,
    ) -> None:  # fmt: skip
        self.registry, self.metrics, self.max_body_bytes = registry, metrics, max_body_bytes
        self.gate = CallGate(auth, metrics)  # keys, quotas, status counter and log line of every route
        self.app = FastAPI(title="omnivox", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.post("/v1/completions")(self.completions)
        self.app.get("/v1/models")(self.models)
        self.app.get("/v1/models/{model_id:path}")(self.model)
        self.app.get("/health")(self.health)
        # GET /v1/realtime: voice sessions (services/openai_api/realtime/)
        self.realtime = RealtimeRoute(self, error_response, realtime_limits)

        @self.app.websocket("/v1/realtime")
        async def realtime(websocket: WebSocket) -> None:
            await self.realtime(websocket)

        self.server: uvicorn.Server | None = None
        self.port: int | None = None
        self._main: asyncio.Task | None = None

    @property
    def auth(self) -> AuthInterceptor | None:
        """The keys and quotas every route's CallGate checks (the gRPC chain's)."""
        return self.gate.auth

    @auth.setter
    def auth(self, auth: AuthInterceptor | None) -> None:
        self.gate.auth = auth

    async def start(self, host: str, port: int, ssl: dict[str, Any] | None = None) -> int:
        config = uvicorn.Config(self.app, host=host, port=port, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=1, **(ssl or {}))  # fmt: skip
        config.load()
        self.server = uvicorn.Server(config)
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup()
        if not self.server.started:
            raise OSError(f"cannot serve HTTP on {host}:{port}")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self._main = asyncio.create_task(self.server.main_loop())  # uvicorn's ticks (Date header, exit flag)
        return self.port

    async def stop(self) -> None:
        if self.server is None:
            return
        self.server.should_exit = True
        if self._main is not None:
            await self._main
        await self.server.shutdown()

    # Routes

    async def health(self) -> Response:
        """200 when every model is ready; 503 in OpenAI's error shape (plus `status`) while loading or draining."""
        if self.registry.draining:
            return _unready("draining", "the server is draining: it takes no new requests")
        states = {m.name: m.state for m in self.registry}
        if any(s is not ModelState.READY for s in states.values()):
            loading = {n: s.name.lower() for n, s in states.items()}
            return _unready("loading", f"not every model is ready yet: {loading}", models=loading)
        return JSONResponse({"status": "ok"})

    def _model_object(self, model: Any) -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "omnivox",
                "ready": model.state is ModelState.READY}  # fmt: skip

    async def models(self, request: Request) -> Response:
        return await self.call(request, "ListModels", self._list_models)

    async def _list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object(m) for m in self.registry]})

    async def model(self, request: Request, model_id: str) -> Response:
        async def one(request: Request) -> Response:
            return JSONResponse(self._model_object(self.registry.lookup(model_id)))

        return await self.call(request, "GetModel", one)

    async def chat_completions(self, request: Request) -> Response:
        return await self.call(request, "ChatCompletions", self._generate)

    async def completions(self, request: Request) -> Response:
        return await self.call(request, "Completions", self._generate, completion=True)

    # The call around every route: the log line and status counter, auth and quotas, the error shape

    async def call(
        self, request: Request, method: str, handler: Any, completion: bool = False,
        param_of: Callable[[str], str] | None = None,
    ) -> Response:  # fmt: skip
        """`handler(request)` as one logged, authorised call; a ServiceError becomes OpenAI's error JSON."""
        record = call_record.CallRecord(method)
        token = call_record.set_current_call(record)
        code, taken, deferred = Code.OK, None, False
        try:
            taken = self.gate.admit(request.headers.items(), record)
            response = await handler(request, completion) if handler == self._generate else await handler(request)
            if isinstance(response, ClosingStreamingResponse):  # logged (and its quota given back) when it ends
                response.on_end = lambda stream_code: self.gate.end(record, stream_code, taken)
                deferred = True
            return response
        except ServiceError as err:
            code = err.code
            return error_response(err, completion, param_of)
        except asyncio.CancelledError:
            code = Code.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one line, the server keeps serving
            log.exception("%s failed", method)
            code = Code.INTERNAL
            return error_response(errors.internal(f"{type(exc).__name__}: {exc}"), completion)
        finally:
            if not deferred:
                self.gate.end(record, code, taken)
            call_record.reset_current_call(token)

    async def body(self, request: Request) -> dict[str, Any]:
        raw = await read_capped(request, self.max_body_bytes)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise errors.invalid_argument([errors.FieldViolation("body", f"is not JSON: {exc}")]) from None
        if not isinstance(body, dict):
            raise errors.invalid_argument([errors.FieldViolation("body", "must be a JSON object")])
        return body

    async def _generate(self, request: Request, completion: bool) -> Response:
        body = await self.body(request)
        raw_prompt = None
        if completion:
            message, raw_prompt = completion_request(body)
        else:
            message = chat_request(body)
        stream = body.get("stream") is True
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        include_usage = bool(options.get("include_usage"))
        message.request_id = uuid.uuid4().hex  # the chunks' id, known before the summary names it
        model_name = self.registry.lookup(message.model).name
        responses = generate_responses(message, self.registry, self.metrics, raw_prompt)
        output = ChatOutput(message.request_id, model_name, completion)
        if not stream:
            if (n := choices(body)) > 1:
                await responses.aclose()
                job = _choices(message, n, self.registry, self.metrics, raw_prompt, model_name, completion)
                return JSONResponse(await until_disconnect(request, job))
            return JSONResponse(await until_disconnect(request, _collect(responses, output, bool(message.logprobs))))
        # The first response read here: a refusal (checks, queue full, draining) is an HTTP status, not a stream
        try:
            first = await until_disconnect(request, anext(responses))
        except BaseException:
            await responses.aclose()
            raise
        events = _sse(first, responses, output, include_usage)
        return ClosingStreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _unready(status: str, message: str, **extra: Any) -> JSONResponse:
    body = json.loads(error_response(errors.unavailable(message)).body)
    return JSONResponse({**body, "status": status, **extra}, status_code=503)


class BodyTooLarge(ServiceError):
    """413: the body is over the limit gRPC has for a message (--max-receive-message-bytes)."""

    http_status = 413


async def read_capped(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it passes `limit`: by its Content-Length before reading, and for a
    chunked upload (no length) while reading, so a client cannot make the server hold an unbounded body. Later reads
    (`request.form()`) see the bytes read here."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    request._body = bytes(body)  # starlette's Request.stream() / form() replay it
    return request._body


def _too_large(size: int, limit: int) -> ServiceError:
    return BodyTooLarge(Code.RESOURCE_EXHAUSTED, f"the request body is {size} bytes (the limit is {limit})")


async def until_disconnect(request: Request, work: Any) -> Any:
    """`work` (a coroutine) cancelled when the client disconnects first: its engine request aborts."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise asyncio.CancelledError("the client disconnected")
        return task.result()
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(responses: AsyncIterator[Any], output: ChatOutput, logprobs: bool) -> dict[str, Any]:
    async with contextlib.aclosing(responses):
        async for response in responses:
            if response.WhichOneof("response") == "summary":
                return output.completion(response.summary, logprobs)
            output.add(response.delta)
    raise errors.internal("the request ended without a summary")


async def _choices(
    message: Any, n: int, registry: ModelRegistry, metrics: Metrics, raw_prompt: str | None, model: str,
    completion: bool,
) -> dict[str, Any]:  # fmt: skip
    """`n` choices: n engine requests at once (the prompt computed once, its blocks shared by the prefix cache once
    the first has them), seeds `seed + i` when seeded; one object with choices 0..n-1 and their usage summed. They
    hold one slot of the queue bound (--max-queue) between them: one API request, as vLLM counts it."""

    async def one(i: int) -> dict[str, Any]:
        copy = type(message)()
        copy.CopyFrom(message)
        copy.request_id = f"{message.request_id}-{i}"
        if copy.sampling.HasField("seed"):
            copy.sampling.seed = (copy.sampling.seed + i) % (MAX_SEED + 1)
        output = ChatOutput(message.request_id, model, completion)
        responses = generate_responses(copy, registry, metrics, raw_prompt, admitted=True)
        return await _collect(responses, output, bool(message.logprobs))

    with registry.lookup(message.model).admit():
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one refused or failed, or the client left: the others abort
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    merged = results[0]
    merged["choices"] = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
    usage = merged["usage"]  # the prompt once, as OpenAI counts it; every choice's completion tokens
    usage["completion_tokens"] = sum(r["usage"]["completion_tokens"] for r in results)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"]["cached_tokens"] = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"]
                                                          for r in results)  # fmt: skip
    usage["completion_tokens_details"]["reasoning_tokens"] = sum(
        r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in results
    )
    return merged


async def _sse(
    first: Any, responses: AsyncIterator[Any], output: ChatOutput, include_usage: bool
) -> AsyncIterator[str]:
    """`data: {chunk}` events, then `data: [DONE]`; a failure after the first byte is one error event."""
    async with contextlib.aclosing(responses):
        try:
            response = first
            while response.WhichOneof("response") != "summary":
                if (chunk := output.chunk(response.delta)) is not None:
                    yield sse_event(chunk)
                response = await anext(responses)
            for chunk in output.final_chunks(response.summary, include_usage):
                yield sse_event(chunk)
        except ServiceError as err:
            yield sse_event(json.loads(error_response(err, output.is_completion).body))
    yield "data: [DONE]\n\n"
