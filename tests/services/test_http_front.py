"""The OpenAI-compatible HTTP front (serve --http-port) driven by the official `openai` SDK and plain httpx, against
one real server (gRPC and HTTP in one process) on real ports with the embedded default model (SmolLM2-135M GGUF).

Requests stay short: the model decodes some tens of tokens per second on a shared 2-core machine.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from support.service_harness import ServerThread, user_request

from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
KEYS = "alice:key-of-alice-123\n"


@pytest.fixture(scope="module")
def server(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    spec = ModelSpec(path=default_gguf, name=DEFAULT_MODEL_NAME)
    options = EngineOptions(kv_cache_gib=0.25, device="cpu")
    with ServerThread(
        [spec], options, http_port=0, api_keys=keys, max_queue=2, max_receive_message_bytes=1 << 20
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="key-of-alice-123", max_retries=0, timeout=120)


def test_chat_says_paris_as_grpc_does(server: ServerThread, client: openai.OpenAI) -> None:
    """Greedy chat over HTTP gives the text gRPC's Generate gives for the same question (one request processing)."""
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CAPITAL, temperature=0, max_tokens=12)
    [choice] = reply.choices
    assert "Paris" in choice.message.content
    assert (
        reply.object == "chat.completion" and reply.model == DEFAULT_MODEL_NAME and choice.message.role == "assistant"
    )
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    request = user_request(CAPITAL[0]["content"], max_output_tokens=12)
    request.sampling.temperature = 0.0
    grpc_text = "".join(r.delta.text for r in stub.Generate(request, timeout=60, metadata=[("authorization", "Bearer key-of-alice-123")]) if r.WhichOneof("response") == "delta")  # fmt: skip
    assert grpc_text == choice.message.content


def test_streamed_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=CAPITAL,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished in (["stop"], ["length"])
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].choices == [] and len(content_chunks) <= chunks[-1].usage.completion_tokens <= 12


def test_tool_call_with_a_schema(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                    "required": ["city"],
                },  # fmt: skip
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo"), call


def test_json_schema_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}}, "required": ["capital"],
              "additionalProperties": False}  # fmt: skip
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=CAPITAL,
        temperature=0,
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"capital"} and isinstance(value["capital"], str) and len(value["capital"]) <= 12


def test_logprobs_stop_seed_and_completions(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=CAPITAL, max_tokens=4, logprobs=True, top_logprobs=2, seed=7
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)
    done = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert done.object == "text_completion" and done.choices[0].text and done.usage.completion_tokens <= 3
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=3, temperature=0, stream=True) if c.choices)  # fmt: skip
    assert streamed == done.choices[0].text


def test_n_choices_share_the_prompt(client: openai.OpenAI) -> None:
    """n=2 seeded: two choices (indices 0, 1), each what a single request with seed + i gives; the prompt counted once.
    The n choices hold one slot of the queue bound between them: n=3 at max_queue=2 is served (it was 429)."""
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=CAPITAL, n=2, temperature=1.0, seed=11, max_tokens=8
    )
    assert [c.index for c in reply.choices] == [0, 1]
    singles = [
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=CAPITAL, temperature=1.0, seed=11 + i, max_tokens=8
        )
        for i in range(2)
    ]
    assert [c.message.content for c in reply.choices] == [s.choices[0].message.content for s in singles]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    three = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CAPITAL, n=3, max_tokens=2)
    assert [c.index for c in three.choices] == [0, 1, 2]


def test_models_and_health(client: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL_NAME]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}  # open, as gRPC's health is


def test_error_statuses(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CAPITAL, temperature=-1, max_tokens=2)
    assert (
        bad.value.status_code == 400 and bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    )
    for n, stream in ((9, False), (0, False), (2, True)):  # 1..8 choices, and one when streamed
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CAPITAL, n=n, max_tokens=2, stream=stream)
        assert bad.value.param == "n"
    url = [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": url}], max_tokens=2
        )
    assert bad.value.param == "messages[0].content[0].image_url.url" and "data: URL" in bad.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong-key-123", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=CAPITAL, max_tokens=2)
    assert missing.value.code == "model_not_found"
    huge = httpx.post(f"{base_url}/v1/chat/completions", headers={"authorization": "Bearer key-of-alice-123"},
                      json={"messages": [{"role": "user", "content": "x" * (2 << 20)}]})  # fmt: skip
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"


def _open_stream(base_url: str, max_tokens: int) -> httpx.Response:
    http = httpx.Client(timeout=120)
    body = {"messages": CAPITAL, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    request = http.build_request("POST", f"{base_url}/v1/chat/completions", json=body,
                                 headers={"authorization": "Bearer key-of-alice-123"})  # fmt: skip
    return http.send(request, stream=True)


def test_queue_full_is_429_with_retry_after(server: ServerThread, base_url: str) -> None:
    """max_queue=2: two streams held open, the third request (n=2: one queued request) gets 429 with Retry-After;
    all KV free after."""
    held = [_open_stream(base_url, 400) for _ in range(2)]
    try:
        for response in held:
            assert response.status_code == 200
        third = httpx.post(f"{base_url}/v1/chat/completions", headers={"authorization": "Bearer key-of-alice-123"},
                           json={"messages": CAPITAL, "max_tokens": 2, "n": 2}, timeout=60)  # fmt: skip
        assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
        assert third.json()["error"]["type"] == "rate_limit_error"
    finally:
        for response in held:
            response.close()
    free, total = server.wait_kv_free()
    assert free == total


def test_sse_framing_and_disconnect_frees_kv(server: ServerThread, base_url: str) -> None:
    """Events are `data: {json}` lines with a blank line between, ending `data: [DONE]`; a client that goes away
    mid-stream aborts the engine request (its KV blocks are free again) and the server keeps serving."""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=60,
                      headers={"authorization": "Bearer key-of-alice-123"},
                      json={"messages": CAPITAL, "max_tokens": 4, "temperature": 0, "stream": True}) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[6:])["object"] == "chat.completion.chunk"

    response = _open_stream(base_url, 2000)
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    engine = server.engine()
    assert engine.kv_usage().free_blocks < engine.kv_usage().total_blocks  # the request holds blocks
    started = time.monotonic()
    response.close()  # the client goes away mid-stream
    free, total = server.wait_kv_free(timeout=30)
    assert free == total and time.monotonic() - started < 30
    assert not engine.has_unfinished()


def test_non_streamed_disconnect_frees_kv(server: ServerThread, base_url: str) -> None:
    errors: list[BaseException] = []

    def post() -> None:
        try:
            httpx.post(f"{base_url}/v1/chat/completions", headers={"authorization": "Bearer key-of-alice-123"},
                       json={"messages": CAPITAL, "max_tokens": 2000, "ignore_eos": True}, timeout=1.5)  # fmt: skip
        except httpx.TimeoutException as exc:
            errors.append(exc)

    thread = threading.Thread(target=post)
    thread.start()
    thread.join()
    assert errors  # the client gave up after 1.5 s, long before 2000 tokens
    free, total = server.wait_kv_free(timeout=30)
    assert free == total and not server.engine().has_unfinished()
