"""`omnivox ask --audio` and `omnivox transcribe`, run as a user runs them (child processes) against a real server on a
tiny random Qwen2-Audio checkpoint."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from support.audio_checkpoints import chirp, encode, make_qwen2_audio, noise
from support.service_harness import ServerThread

from omnivox.codecs.audio_format import float_to_int16
from omnivox.services.cli.transcribe_stream import _to_linear16, _wav_header, audio_source
from omnivox.services.parts.loading import EngineOptions, ModelSpec
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


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE", "PCM_24", "PCM_U8", "PCM_16"])
def test_transcribe_stream_sends_a_float_wav_as_its_samples(tmp_path, subtype):
    """`omnivox transcribe --stream take.wav` of a 32-bit float WAV (Audacity's and most DAWs' export) streamed
    silence: libsndfile reads float samples as int16 unscaled, so 0.84 became 0. The utterance was never heard."""
    t = np.arange(8000) / 16000
    x = (0.8 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    path = tmp_path / "take.wav"
    sf.write(path, np.stack([x, x], axis=1), 16000, subtype=subtype)  # stereo: mixed to mono by the CLI
    encoding, rate, chunks, paced = audio_source(path, 0)
    pcm = np.frombuffer(b"".join(chunks), "<i2")
    assert (encoding, rate, paced, len(pcm)) == ("LINEAR16", 16000, True, 8000)
    tolerance = {"PCM_U8": 256, "PCM_16": 1}.get(subtype, 1)
    assert np.abs(pcm.astype(np.int32) - np.round(x * 32768)).max() <= tolerance  # was max |pcm| = 0 for FLOAT


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
def test_transcribe_stream_reads_any_pcm_or_float_wav_on_stdin(subtype, fmt):
    """`sox talk.flac -t wav - | omnivox transcribe --stream -` (the README's line) keeps the FLAC's bit depth: a
    24-bit FLAC arrived as 24-bit PCM and was refused ("16-bit PCM only"), as were float, 8- and 32-bit WAVs."""
    t = np.arange(2400) / 48000
    x = np.stack([0.7 * np.sin(2 * np.pi * 300 * t), -0.2 * np.sin(2 * np.pi * 300 * t)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, 48000, format=fmt, subtype=subtype)
    buf.seek(0)
    rate, channels, layout = _wav_header(buf)
    assert (rate, channels) == (48000, 2)
    got = np.frombuffer(_to_linear16(buf.read(), channels, layout), "<i2").astype(np.int32)
    want = np.round(sf.read(io.BytesIO(buf.getvalue()), dtype="float64")[0].mean(axis=1) * 32768)
    assert len(got) == 2400 and np.abs(got - want).max() <= 1
