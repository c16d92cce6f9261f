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
from support.realtime_support import BRIEF, QUESTION, TEXT_ONLY, run, url
from support.service_harness import nothing_left

from omnivox.benchmarks.realtime_sessions import RawSession
from omnivox.benchmarks.transcription import word_error_rate
from omnivox.benchmarks.voices import transcribe as grpc_transcribe
from omnivox.codecs.audio_format import wav_stream_header
from omnivox.services.parts.defaults import DEFAULT_ASR_MODEL_NAME, DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="no espeak-ng")]


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
    # The turn (about 3 s) was encoded in a 10 s window (1000 mel frames -> 500 encoder positions, issue 31); the
    # answer's Transcribe above in the 30 s one (1500).
    cache = server.registry.lookup(DEFAULT_ASR_MODEL_NAME).bundle.whisper.cache
    with cache._lock:
        lengths = {
            ":frames=1000" in k: e.features.shape[-2] for k, e in cache._entries.items() if e.features is not None
        }
    assert lengths == {True: 500, False: 1500}, lengths


def test_embedded_bundle_answers_a_spoken_question_by_default(server, question_pcm, tmp_path):
    """No --asr-model: with whisper-base served beside SmolLM2, the cascade is on (`--asr-model auto`), so
    `omnivox ask --audio q.wav` gets an answer (it was INVALID_ARGUMENT: the text model reads no audio)."""
    import subprocess

    from omnivox.benchmarks.systems.omnivox_grpc import omnivox_command

    assert server.registry.asr_model == "whisper-base"
    wav = tmp_path / "q.wav"
    wav.write_bytes(wav_stream_header(24000) + question_pcm)
    run = subprocess.run([*omnivox_command(), "ask", "--server", server.address, "--audio", str(wav),
                          "--max-tokens", "16", "--temperature", "0", "Answer briefly:"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-1000:]
    assert "Paris" in run.stdout, run.stdout


def test_g711_audio_in_and_out(server, question_pcm):
    """pcmu in (8 kHz mu-law, made from the 24 kHz question), pcma out: the answer's A-law audio transcribes back."""
    import numpy as np

    from omnivox.codecs.audio_format import AudioStreamEncoder
    from omnivox.codecs.g711_alaw import alaw_to_int16

    encoder = AudioStreamEncoder("MULAW", 8000, source_rate=24000)
    ulaw = encoder.encode(np.frombuffer(question_pcm, "<i2").astype(np.float32) / 32768) + encoder.finish()

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {"type": "realtime", "temperature": 0,
                            "instructions": BRIEF, "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": None}, "output": {"format": {"type": "audio/pcma"}}}}})  # fmt: skip
        updated = await session.until("session.updated")
        for i in range(0, len(ulaw), 1600):
            await session.send({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(ulaw[i : i + 1600]).decode()})  # fmt: skip
        await session.send({"type": "input_audio_buffer.commit"})
        await session.send({"type": "response.create"})
        seen: list = []
        await session.until("response.done", timeout=240, seen=seen)
        await session.close()
        return updated, seen

    updated, seen = run(talk())
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    assert "input_audio_buffer.speech_started" not in [e["type"] for e in seen]  # turn detection off
    transcript = next(e["transcript"] for e in seen if e["type"].endswith("transcription.completed"))
    assert word_error_rate(QUESTION, transcript) < 0.3, transcript
    alaw = b"".join(base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.output_audio.delta")
    pcm = alaw_to_int16(np.frombuffer(alaw, np.uint8)).tobytes()
    heard = grpc_transcribe(server.channel(), wav_stream_header(8000) + pcm)
    answer = next(e["transcript"] for e in seen if e["type"] == "response.output_audio_transcript.done")
    assert word_error_rate(answer, heard) < 0.4, (answer, heard)


def test_function_call_round_trip(server):
    """A forced tool call comes as a function_call item with its arguments streamed; its output as a
    function_call_output item lets the next response answer in text."""
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {**TEXT_ONLY, "tools": [weather]}})
        await session.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
                },
            }
        )
        await session.send({"type": "response.create", "response": {"tool_choice": {"type": "function",
                            "name": "get_weather"}}})  # fmt: skip
        seen: list = []
        first = await session.until("response.done", seen=seen)
        call = first["response"]["output"][0]
        await session.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": '{"sky": "sunny", "celsius": 21}',
                },
            }
        )
        await session.send({"type": "response.create", "response": {"max_output_tokens": 24}})
        second = await session.until("response.done")
        await session.close()
        return seen, first, second

    seen, first, second = run(talk())
    call = first["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert "city" in json.loads(call["arguments"])
    streamed = "".join(e["delta"] for e in seen if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in seen if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call["arguments"] and streamed
    assert second["response"]["output"][0]["type"] == "message"
    assert second["response"]["status"] in ("completed", "incomplete")
    nothing_left(server, DEFAULT_MODEL_NAME)


def test_sdk_spoken_turn(server, question_pcm):
    """The openai SDK's client holds a spoken turn: appends at 20 ms, server VAD, the transcript, a spoken answer."""

    async def talk():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="-")
        async with client.realtime.connect(model=DEFAULT_MODEL_NAME) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": BRIEF,
                    "temperature": 0,
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "whisper-1"},
                        }
                    },
                }
            )
            audio = question_pcm + bytes(2 * 48000)  # then 2 s of silence: the detector ends the turn
            for i in range(0, len(audio), 960):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + 960]).decode())
            transcript, answer, chunks = "", "", 0
            async for event in conn:
                if event.type == "conversation.item.input_audio_transcription.completed":
                    transcript = event.transcript
                elif event.type == "response.output_audio.delta":
                    chunks += 1
                elif event.type == "response.output_audio_transcript.done":
                    answer = event.transcript
                elif event.type == "response.done":
                    return transcript, answer, chunks, event

    transcript, answer, chunks, done = run(talk())
    assert word_error_rate(QUESTION, transcript) < 0.3, transcript
    assert done.response.status == "completed" and answer and chunks > 0
    assert done.response.output[0].content[0].transcript == answer


def test_out_of_band_response_with_its_own_input(server):
    """response.create with conversation "none" and `input`: answered from those items, nothing added to the
    conversation; a second response.create while one runs is refused."""

    async def talk():
        session = await RawSession.open(url(server))
        await session.until("session.created")
        ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
        await session.send(
            {
                "type": "response.create",
                "response": {
                    "conversation": "none",
                    "input": [ask],
                    "output_modalities": ["text"],
                    "temperature": 0,
                    "max_output_tokens": 12,
                },
            }
        )
        await session.send({"type": "response.create", "event_id": "again"})
        seen: list = []
        done = await session.until("response.done", seen=seen)
        item_id = done["response"]["output"][0]["id"]
        await session.send({"type": "conversation.item.retrieve", "event_id": "find", "item_id": item_id})
        missing = (await session.until("error"))["error"]
        await session.close()
        return seen, done, missing

    seen, done, missing = run(talk())
    refused = next(e["error"] for e in seen if e["type"] == "error")
    assert (refused["code"], refused["event_id"]) == ("conversation_already_has_active_response", "again")
    assert (
        done["response"]["conversation_id"] is None and "Paris" in done["response"]["output"][0]["content"][0]["text"]
    )
    assert "conversation.item.added" not in [e["type"] for e in seen]
    assert (missing["code"], missing["event_id"]) == ("item_not_found", "find")
