"""`omnivox ask --audio` and `omnivox transcribe`, run as a user runs them (child processes) against a real server on a
tiny random Qwen2-Audio checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.audio_checkpoints import chirp, encode, make_qwen2_audio, noise
from support.service_harness import ServerThread

from omnivox.codecs.audio_format import float_to_int16
from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.v1 import (
    content_pb2,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    transcription_pb2,
    transcription_pb2_grpc,
)

OMNIVOX = [sys.executable, "-m", "omnivox.services.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_qwen2_audio(tmp_path_factory.mktemp("ckpt") / "qwen2-audio", seed=3)
    with ServerThread([ModelSpec(path=path, name="listener")], EngineOptions(kv_cache_gib=0.02)) as srv:
        yield srv


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, Path, bytes]:
    pcm = float_to_int16(chirp(1.4) + noise(1.4, amp=0.05, seed=4))
    folder = tmp_path_factory.mktemp("audio")
    wav, raw = folder / "question.wav", folder / "question.raw"
    wav.write_bytes(encode(pcm, 16000, "WAV"))
    raw.write_bytes(pcm.tobytes())
    return wav, raw, wav.read_bytes()


def omnivox(server: ServerThread, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNIVOX, *args, "--server", server.address], capture_output=True, text=True, timeout=120)


def test_ask_streams_the_same_text_as_the_api(server, clip):
    wav, raw, data = clip
    request = generation_pb2.GenerateRequest(
        contents=[content_pb2.Content(role="user", parts=[
            content_pb2.Part(audio=content_pb2.AudioPart(data=data)), content_pb2.Part(text="What is it?")])],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0), max_output_tokens=8,
    )  # fmt: skip
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    want = "".join(r.delta.text for r in stub.Generate(request) if r.HasField("delta"))
    for audio in (wav, raw):
        rate = ["--sample-rate", "16000"] if audio.suffix == ".raw" else []
        result = omnivox(server, "ask", "--audio", str(audio), *rate, "What is it?", "--temperature", "0",
                         "--max-tokens", "8")  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout == want + "\n"
    bad = omnivox(server, "ask", "--audio", str(raw), "What is it?")
    assert bad.returncode == 1 and "--sample-rate" in bad.stderr and "Traceback" not in bad.stderr


def test_transcribe_text_srt_vtt_json(server, clip, tmp_path):
    wav, _, data = clip
    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    *_, last = stub.Transcribe(transcription_pb2.TranscribeRequest(audio=content_pb2.AudioPart(data=data)))
    want = last.summary.text
    text = omnivox(server, "transcribe", str(wav))
    assert text.returncode == 0, text.stderr
    assert text.stdout == want + "\n" and "real-time factor" in text.stderr
    srt = omnivox(server, "transcribe", str(wav), "--format", "srt", "-q")
    assert srt.stdout == f"1\n00:00:00,000 --> 00:00:01,400\n{want}\n\n" and not srt.stderr
    vtt = omnivox(server, "transcribe", str(wav), "--format", "vtt", "-q")
    assert vtt.stdout == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.400\n{want}\n\n"
    out = tmp_path / "t.json"
    assert omnivox(server, "transcribe", str(wav), "--format", "json", "-o", str(out), "-q").returncode == 0
    doc = json.loads(out.read_text())
    assert doc["text"] == want and doc["segments"] == [{"start": 0.0, "end": 1.4, "text": want}]
    bad = omnivox(server, "transcribe", str(wav), "--language", "klingon")
    assert bad.returncode == 1 and re.search(r"INVALID_ARGUMENT: language: 'klingon'", bad.stderr), bad.stderr
