"""/v1/audio/speech and /v1/audio/voices of the HTTP front, driven by the official `openai` SDK and plain httpx, against
one real server (gRPC and HTTP in one process) serving the embedded hibari voice (real speech, the default speech
model) and a tiny random Orpheus model (an engine and a SNAC codec: noise, but the engine's path), on real ports.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from support.service_harness import ServerThread, nothing_left

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.parts.defaults import DEFAULT_VOICE_MODEL_NAME, ensure_default_voice, save_random_speech_model
from omnivox.services.parts.model_spec import ModelSpec
from omnivox.v1 import speech_pb2, speech_pb2_grpc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not __import__("shutil").which("espeak-ng"), reason="espeak-ng is not installed"),
]
ORPHEUS = "orpheus-random"
SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)  # same framing, less compute
TEXT = "Hello there. This is omnivox speaking over HTTP."


def _hibari() -> None:
    try:
        ensure_default_voice()
    except RuntimeError as exc:  # no PyPI here
        pytest.skip(f"hibari-tts cannot be fetched: {exc}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    _hibari()
    orpheus = save_random_speech_model(tmp_path_factory.mktemp("speech") / ORPHEUS, snac_config=SMALL_SNAC)
    specs = [ModelSpec(path=None, voice=True), ModelSpec(path=orpheus, name=ORPHEUS)]
    with ServerThread(specs, http_port=0) as srv:
        limits = next(b.servicer.calls for b in srv.server.services if hasattr(b.servicer, "calls")).limits
        limits.audio_seconds_base, limits.audio_seconds_per_char = 0.3, 0.01  # the random decoder speaks its budget
        yield srv


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=120)


def _voiced(samples: np.ndarray) -> None:
    assert np.sqrt(np.mean(samples**2)) > 0.01 and np.abs(samples).max() <= 1.0  # speech, not silence


def test_speech_to_a_file_soundfile_reads(client: openai.OpenAI, tmp_path) -> None:
    """The default voice (hibari) through the SDK, written to a file: a 24 kHz mono WAV of about the text's length."""
    reply = client.audio.speech.create(model=DEFAULT_VOICE_MODEL_NAME, voice="heart", input=TEXT, response_format="wav")
    path = tmp_path / "hello.wav"
    reply.write_to_file(path)
    samples, rate = sf.read(path)
    assert rate == 24000 and samples.ndim == 1 and 1.5 < len(samples) / rate < 8.0
    _voiced(samples)
    assert reply.response.headers["content-type"] == "audio/wav"
    flac = client.audio.speech.create(model=DEFAULT_VOICE_MODEL_NAME, voice="heart", input="Hi there.",
                                      response_format="flac", speed=1.5)  # fmt: skip
    samples, rate = sf.read(io.BytesIO(flac.content))
    assert rate == 24000 and 0.2 < len(samples) / rate < 2.0


def test_mp3_is_the_default_and_streams(client: openai.OpenAI) -> None:
    """No response_format: MP3, as OpenAI's default (it was WAV: no encoder); streamed frame by frame, and soundfile
    reads the whole stream back (constant bitrate, codecs/audio_format.py)."""
    text = " ".join([TEXT] * 3)
    started = time.monotonic()
    with client.audio.speech.with_streaming_response.create(
        model=DEFAULT_VOICE_MODEL_NAME, voice="heart", input=text
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        chunks = [(time.monotonic() - started, chunk) for chunk in response.iter_bytes()]
    data = b"".join(c for _, c in chunks)
    samples, rate = sf.read(io.BytesIO(data))
    assert sf.info(io.BytesIO(data)).format == "MP3" and rate == 24000 and 4.0 < len(samples) / rate < 25.0
    _voiced(samples)
    assert chunks[0][0] < chunks[-1][0]  # streamed: not one write at the end


def test_streamed_pcm_arrives_before_the_end(client: openai.OpenAI) -> None:
    """with_streaming_response: the first bytes come while later sentences are still being rendered; pcm is OpenAI's
    raw 24 kHz 16-bit little-endian mono."""
    text = " ".join([TEXT] * 4)
    started = time.monotonic()
    with client.audio.speech.with_streaming_response.create(
        model=DEFAULT_VOICE_MODEL_NAME, voice="heart", input=text, response_format="pcm"
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        chunks = []
        for chunk in response.iter_bytes():
            chunks.append((time.monotonic() - started, chunk))
    data = b"".join(c for _, c in chunks)
    assert len(data) % 2 == 0
    samples = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    assert 6.0 < len(samples) / 24000 < 30.0
    _voiced(samples)
    assert chunks[0][0] < chunks[-1][0]  # streamed: not one write at the end


def test_sse_framing(base_url: str) -> None:
    """stream_format sse: `data: {json}` events, a blank line after each, speech.audio.delta (base64 of the file's
    bytes, in order) then one speech.audio.done with usage; no [DONE]."""
    body = {"model": DEFAULT_VOICE_MODEL_NAME, "input": TEXT, "response_format": "wav", "stream_format": "sse"}
    with httpx.stream("POST", f"{base_url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    parsed = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event
        parsed.append(json.loads(event[6:]))
    assert {e["type"] for e in parsed[:-1]} == {"speech.audio.delta"} and len(parsed) > 2
    done = parsed[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["input_tokens"] > 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]
    samples, rate = sf.read(io.BytesIO(b"".join(base64.b64decode(e["audio"]) for e in parsed[:-1])))
    assert rate == 24000
    _voiced(samples)


def test_orpheus_through_the_same_path(server: ServerThread, client: openai.OpenAI, base_url: str) -> None:
    """An engine speech model (Orpheus layout, random weights: noise) answers the same route: an Ogg Opus file
    soundfile reads; a speed it cannot take is refused naming `speed`; a client gone mid-stream frees its KV."""
    reply = client.audio.speech.create(model=ORPHEUS, voice="tara", input="Hello.", response_format="opus")
    samples, rate = sf.read(io.BytesIO(reply.content))
    assert rate == 24000 and len(samples) > 0 and reply.response.headers["content-type"] == "audio/ogg"
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model=ORPHEUS, voice="tara", input="Hello.", speed=1.5)
    assert bad.value.param == "speed"
    body = {"model": ORPHEUS, "input": "A long sentence to speak. " * 20, "response_format": "pcm"}
    with httpx.stream("POST", f"{base_url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_bytes())
    nothing_left(server, ORPHEUS, timeout=30)  # the disconnect aborted every segment's engine request


def test_voices_list(base_url: str) -> None:
    every = httpx.get(f"{base_url}/v1/audio/voices").json()
    assert every["object"] == "list"
    by_model = {(v["model"], v["id"]) for v in every["data"]}
    assert (DEFAULT_VOICE_MODEL_NAME, "heart") in by_model and (ORPHEUS, "tara") in by_model
    one = httpx.get(f"{base_url}/v1/audio/voices", params={"model": DEFAULT_VOICE_MODEL_NAME}).json()["data"]
    assert {v["model"] for v in one} == {DEFAULT_VOICE_MODEL_NAME} and all(v["kind"] == "built_in" for v in one)
    assert httpx.get(f"{base_url}/v1/audio/voices", params={"language": "xx"}).json()["data"] == []
    missing = httpx.get(f"{base_url}/v1/audio/voices", params={"model": "no-such-model"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"voice": "no-such-voice"}, 404, "voice"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"response_format": "aac"}, 400, "response_format"),
        ({"speed": 10}, 400, "speed"),
        ({"input": " \u200b "}, 400, "input"),
        ({"input": "x" * 6000}, 400, "input"),
        ({"instructions": "Speak like a pirate."}, 400, "instructions"),
        ({"stream_format": "websocket"}, 400, "stream_format"),
        ({"voice": 7}, 400, "voice"),
    ],
)
def test_error_statuses(client: openai.OpenAI, base_url: str, fields, status, param) -> None:
    """Each refusal before the first byte, in OpenAI's error shape, naming the parameter; the server speaks on."""
    body = {"model": DEFAULT_VOICE_MODEL_NAME, "voice": "heart", "input": "Hi.", **fields}
    reply = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert client.audio.speech.create(model=DEFAULT_VOICE_MODEL_NAME, voice="heart", input="Hi.").content


def test_draining_health_is_503_in_openai_error_shape() -> None:
    """While the server drains (a StreamingSynthesizeSpeech waiting for more text holds the drain open), /health and
    new requests answer 503 in OpenAI's error shape; when the stream ends, the drain ends."""
    _hibari()
    with ServerThread([ModelSpec(path=None, voice=True)], http_port=0) as srv:
        url = f"http://127.0.0.1:{srv.server.http_port}"
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        more_text = threading.Event()

        def requests():
            yield speech_pb2.StreamingSynthesizeSpeechRequest(config=speech_pb2.StreamingSpeechConfig())
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text="Hello there. ")
            more_text.wait(60)
            yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

        held = speech_pb2_grpc.SpeechServiceStub(srv.channel()).StreamingSynthesizeSpeech(requests(), timeout=120)
        assert next(held).HasField("format")
        try:
            stopped = srv.run_async(srv.server.stop(60.0))
            deadline = time.monotonic() + 30
            while not srv.registry.draining and time.monotonic() < deadline:
                time.sleep(0.02)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert health.json()["error"]["type"] == "service_unavailable"
            refused = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi."}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
            assert not stopped.done()  # the stream holds the drain open
        finally:
            more_text.set()
        assert list(held)[-1].HasField("summary")
        stopped.result(timeout=60)
