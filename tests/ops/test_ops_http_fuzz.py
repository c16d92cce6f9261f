"""Bounded fuzzing of the OpenAI-compatible HTTP front (seconds, derandomised so CI is reproducible): generated JSON
bodies built from the fields OpenAI's routes take (every value type in every place, unknown keys, wrong nesting),
malformed bodies and odd content types, sent to every route of a real server on real ports. No answer is a 5xx
other than 503, every 4xx is OpenAI's error object, and afterwards the server still answers and holds nothing (no
engine request, KV block or admission slot). The gRPC side's fuzzing: test_ops_fuzz.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, nothing_left

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec

pytestmark = pytest.mark.slow

CHAT_FIELDS = (
    "model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n",
    "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "tools",
    "tool_choice", "stream", "stream_options", "user", "reasoning_effort",
)  # fmt: skip
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "stream", "echo", "stop", "seed", "n", "logprobs")
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "stream_format", "instructions")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
PART_FIELDS = ("type", "text", "image_url", "input_audio", "url", "data", "format")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=24),
    st.sampled_from(["user", "assistant", "system", "tool", "text", "image_url", "json_schema", "auto", "wav", "tiny"]),
)


def json_values(keys: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Any JSON value, its dict keys mostly drawn from `keys` (so bodies get past the first checks)."""
    key = st.one_of(st.sampled_from(keys), st.text(max_size=8))
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(key, inner, max_size=5)),
        max_leaves=12,
    )


def plausible() -> dict[str, st.SearchStrategy[Any]]:
    """Values of the right type and near the accepted ranges, so a body gets to the checks behind the type checks."""
    name = st.text(alphabet="abcxyz_-", min_size=0, max_size=6)
    schema = st.one_of(
        st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        st.dictionaries(st.sampled_from(["type", "properties", "enum", "pattern", "items", "$ref"]), scalars),
    )
    function = st.fixed_dictionaries(
        {"name": name}, optional={"parameters": schema, "description": st.text(max_size=8)}
    )
    return {
        "temperature": st.floats(-1, 3),
        "top_p": st.floats(-0.5, 1.5),
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
        "speed": st.floats(0, 5),
        "n": st.integers(-1, 10),
        "seed": st.integers(-(2**64), 2**64),
        "top_logprobs": st.integers(-1, 30),
        "logprobs": st.one_of(st.booleans(), st.integers(-1, 8)),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6)),
        "logit_bias": st.dictionaries(
            st.one_of(st.integers(-5, 70000).map(str), st.text(max_size=3)), st.floats(-200, 200)
        ),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "response_format": st.one_of(
            st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {"type": "x"}]),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries(
                        {"name": name}, optional={"schema": schema, "strict": st.booleans()}
                    ),
                }
            ),
        ),
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": function}), max_size=3
        ),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", "x"]),
            st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}),
        ),
        "voice": st.sampled_from(["tara", "leah", "nobody", ""]),
        "response_format_speech": st.sampled_from(["wav", "flac", "opus", "pcm", "mp3", "aac", "x"]),
        "stream_format": st.sampled_from(["sse", "audio", "x"]),
        "echo": st.booleans(),
        "prompt": st.one_of(
            st.text(max_size=10),
            st.lists(st.text(max_size=6), max_size=3),
            st.lists(st.integers(-2, 70000), max_size=4),
        ),
    }


BASES = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
    "/v1/audio/speech": {"model": "speech", "input": "Hi there.", "voice": "tara"},
}


def bodies(route: str, fields: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """A valid body with one to three fields (or the first message, or its content parts) replaced by generated
    values, or a generated value on its own: most get past the first checks and reach the deeper ones."""
    nested = json_values(fields + MESSAGE_FIELDS + PART_FIELDS)
    message = st.one_of(
        nested,
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": nested}
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("user"),
                "content": st.lists(st.dictionaries(st.sampled_from(PART_FIELDS), nested), max_size=3),
            }
        ),
    )
    typed = plausible()
    if route == "/v1/audio/speech":
        typed["response_format"] = typed.pop("response_format_speech")
    value = {f: st.one_of(typed[f], typed[f], nested) if f in typed else nested for f in fields}
    overrides = st.sampled_from(fields).flatmap(lambda f: value[f].map(lambda v: {f: v}))
    overrides = st.lists(overrides, min_size=1, max_size=3).map(lambda ds: {k: v for d in ds for k, v in d.items()})
    if route == "/v1/chat/completions":
        overrides = st.one_of(overrides, st.lists(message, min_size=1, max_size=3).map(lambda m: {"messages": m}))
    mutated = overrides.map(lambda o: _short({**BASES[route], **o}))
    return st.one_of(mutated, mutated, mutated, nested)


def _short(body: dict) -> dict:
    """Fast to serve: a body the front accepts must not run for a long budget on the shared machine."""
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and body[name] > 3:
            body[name] = 3
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    if isinstance(body.get("input"), str):
        body["input"] = body["input"][:12]
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("http-fuzz")
    text = make_checkpoint(root / "tiny", family="llama")
    speech = save_random_speech_model(
        root / "speech", snac_config=dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    )
    specs = [ModelSpec(path=text, name="tiny"), ModelSpec(path=speech, name="speech")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01), http_port=0, max_receive_message_bytes=1 << 16) as srv:
        for b in srv.server.services:
            if isinstance(b.servicer, SpeechServicer):  # the random decoder speaks for its whole budget: keep it short
                b.servicer.limits.audio_seconds_base, b.servicer.limits.audio_seconds_per_char = 0.1, 0.0
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=60) as client:
        yield client


def _check(response: httpx.Response, body: Any) -> None:
    status = response.status_code
    assert status < 500 or status == 503, (status, body, response.text[:500])
    if status >= 400 and status != 404 and status != 405:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error, (body, error)


FUZZ = settings(
    max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("/v1/chat/completions", CHAT_FIELDS),
        ("/v1/completions", COMPLETION_FIELDS),
        ("/v1/audio/speech", SPEECH_FIELDS),
    ],
)
def test_generated_bodies_get_a_4xx_or_an_answer(server: ServerThread, http: httpx.Client, route, fields) -> None:
    @FUZZ
    @given(bodies(route, fields))
    def check(body: Any) -> None:
        _check(http.post(route, content=json.dumps(body), headers={"content-type": "application/json"}), body)

    check()
    for model in ("tiny", "speech"):
        nothing_left(server, model)


def test_malformed_bodies_and_content_types(server: ServerThread, http: httpx.Client) -> None:
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/audio/transcriptions"]
    blobs = [b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe\x00", b"{" * 5000 + b"}" * 5000, b'{"model": 1e999}']
    blobs.append(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]}).encode())
    for route in routes:
        for blob in blobs:
            for kind in ("application/json", "text/plain", "multipart/form-data; boundary=x"):
                _check(http.post(route, content=blob, headers={"content-type": kind}), (route, blob[:40], kind))
    for route in ("/v1/models/../../etc", "/v1/models/%00", "/v1/realtime", "/health?x=1"):
        _check(http.get(route), route)
    for model in ("tiny", "speech"):
        nothing_left(server, model)
    reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length", reply.text


def test_a_chunked_body_past_the_limit_is_413(server: ServerThread, http: httpx.Client) -> None:
    """A chunked upload has no Content-Length to refuse it by: it is cut off as it passes the server's limit (64 KiB
    here), JSON or multipart, instead of being read whole first (the transcription route checked only the header)."""
    chunk = b"x" * 4096

    def chunks(n: int):
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(n):
            yield chunk
        yield b'"}'

    for route, kind in (
        ("/v1/completions", "application/json"),
        ("/v1/audio/transcriptions", "multipart/form-data; boundary=b"),
    ):
        reply = http.post(route, content=chunks(64), headers={"content-type": kind})
        assert reply.status_code == 413, (route, reply.status_code, reply.text[:300])
        assert reply.json()["error"]["type"] == "invalid_request_error"
    small = http.post("/v1/completions", content=iter([b'{"model": "tiny", "prompt": "Hi", ', b'"max_tokens": 2}']))
    assert small.status_code == 200, small.text
