"""GET /v1/realtime: voice sessions over the OpenAI Realtime GA protocol, with the embedded defaults (SmolLM2-135M,
hibari, whisper-base) in one real server (gRPC + HTTP), driven by the official `openai` SDK's realtime client and by
a raw `websockets` client (omnivox.benchmarks.realtime_sessions.RawSession).

Questions are spoken by the served voice (pcm16 24 kHz, the session's format) and sent as a microphone would, in
20 ms appends (without real-time pacing: the tests stay short; the benchmark paces them)."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil

import openai
import pytest
from support.service_harness import ServerThread, nothing_left

from omnivox.benchmarks.realtime_sessions import RawSession, synthesize_pcm16
from omnivox.benchmarks.transcription import word_error_rate
from omnivox.benchmarks.voices import transcribe as grpc_transcribe
from omnivox.codecs.audio_format import wav_stream_header
from omnivox.services.defaults import DEFAULT_MODEL_NAME, ensure_default_voice, ensure_default_whisper
from omnivox.services.model_spec import EngineOptions, ModelSpec

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="no espeak-ng")]
QUESTION = "What is the capital of France?"
BRIEF = "Answer in one short sentence."
TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "instructions": BRIEF, "temperature": 0}


@pytest.fixture(scope="module")
def server(default_gguf):
    try:
        ensure_default_voice()
        ensure_default_whisper(progress=False)
    except RuntimeError as exc:
        pytest.skip(f"the embedded voice or whisper-base cannot be fetched: {exc}")
    specs = [ModelSpec(path=default_gguf, name=DEFAULT_MODEL_NAME), ModelSpec(path=None, voice=True),
             ModelSpec(path=None, asr=True)]  # fmt: skip
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.1, device="cpu"), http_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def question_pcm(server) -> bytes:
    return synthesize_pcm16(server.channel(), QUESTION)


def url(server) -> str:
    return f"ws://127.0.0.1:{server.server.http_port}/v1/realtime?model={DEFAULT_MODEL_NAME}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def test_sdk_text_conversation_keeps_context(server):
    """The openai SDK's client: session.update, a text item, response.create; the second turn reads the first."""

    async def talk():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="-")
        async with client.realtime.connect(model=DEFAULT_MODEL_NAME) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.model == DEFAULT_MODEL_NAME
            await conn.session.update(session=TEXT_ONLY)
            answers = []
            for text in (QUESTION, "Repeat the name of that city."):
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
                )
                await conn.response.create()
                deltas, done = [], None
                async for event in conn:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                    elif event.type == "response.done":
                        done = event
                        break
                answers.append("".join(deltas))
                assert done.response.status == "completed", done
                assert done.response.output[0].content[0].text == answers[-1]
                assert done.response.usage.output_tokens > 0
            return answers, done

    answers, done = run(talk())
    assert "Paris" in answers[0] and "Paris" in answers[1], answers
    assert done.response.usage.input_token_details.cached_tokens > 0  # the first turn's prompt blocks reused
    nothing_left(server, DEFAULT_MODEL_NAME)


def test_spoken_question_answered_in_text_and_audio(server, question_pcm):
    """A spoken question (server VAD) -> transcribed, answered in text and audio; the answer's audio transcribes back
    to the answer's text (whisper-base over gRPC)."""

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {"type": "realtime", "instructions": BRIEF,
                            "temperature": 0}})  # fmt: skip
        await session.until("session.updated")
        seen: list = []
        sending = asyncio.create_task(session.stream(question_pcm, realtime=False, silence_ms=1200))
        await session.until("response.done", timeout=240, seen=seen)
        await sending
        await session.close()
        return seen

    seen = run(talk())
    kinds = [e["type"] for e in seen]
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
                 "response.created", "response.output_audio_transcript.delta", "response.output_audio.delta",
                 "response.output_audio.done", "response.output_audio_transcript.done"):  # fmt: skip
        assert kind in kinds, (kind, kinds)
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
    transcript = next(e["transcript"] for e in seen if e["type"].endswith("transcription.completed"))
    assert word_error_rate(QUESTION, transcript) < 0.3, transcript
    answer = next(e["transcript"] for e in seen if e["type"] == "response.output_audio_transcript.done")
    audio = b"".join(base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.output_audio.delta")
    heard = grpc_transcribe(server.channel(), wav_stream_header(24000) + audio)
    assert answer.strip() and word_error_rate(answer, heard) < 0.35, (answer, heard)
    assert seen[-1]["response"]["status"] == "completed"
    nothing_left(server, DEFAULT_MODEL_NAME)


def test_malformed_events_get_errors_and_the_session_goes_on(server):
    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        errors = []
        for bad in ("{not json", json.dumps({"type": "no.such.event", "event_id": "e1"}),
                    json.dumps({"type": "session.update", "event_id": "e2", "session": {"output_modalities": ["x"]}}),
                    json.dumps({"type": "input_audio_buffer.append", "event_id": "e3", "audio": "***"}),
                    json.dumps({"type": "conversation.item.truncate", "event_id": "e4", "item_id": "nope",
                                "content_index": 0, "audio_end_ms": 5})):  # fmt: skip
            await session.ws.send(bad)
            errors.append((await session.until("error"))["error"])
        await session.send({"type": "session.update", "session": TEXT_ONLY})
        await session.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": QUESTION}]}})  # fmt: skip
        await session.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        done = await session.until("response.done")
        await session.close()
        return errors, done

    errors, done = run(talk())
    assert [e["event_id"] for e in errors] == [None, "e1", "e2", "e3", "e4"]
    assert [e["param"] for e in errors[2:]] == ["session.output_modalities", "audio", "item_id"]
    assert done["response"]["status"] in ("completed", "incomplete")
    nothing_left(server, DEFAULT_MODEL_NAME)
