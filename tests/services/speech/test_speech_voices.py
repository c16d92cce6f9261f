"""Voices created from reference audio over real gRPC: create, list, synthesise (reference turn cached), survive a
restart, delete; and the error codes."""

from __future__ import annotations

import io
import shutil
import subprocess

import grpc
import numpy as np
import pytest
import soundfile as sf
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.models.orpheus import ORPHEUS_LAYOUT
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
ENC = content_pb2.AudioEncoding
TRANSCRIPT = "Hello, this is my voice."


def reference_wav(tmp_path) -> bytes:
    """espeak-ng speech where installed, else a second of generated tones and noise."""
    if shutil.which("espeak-ng"):
        out = tmp_path / "ref.wav"
        subprocess.run(["espeak-ng", "-w", str(out), TRANSCRIPT], check=True, timeout=30)
        audio, rate = sf.read(out)
        audio = audio[: int(1.5 * rate)]  # keep the prompt short
    else:
        rate = 24000
        t = np.arange(rate) / rate
        audio = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * np.random.default_rng(0).standard_normal(rate)
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_random_speech_model(tmp_path_factory.mktemp("voices") / "orpheus-random", snac_config=SMALL_SNAC)


def start(model_path, data_dir) -> ServerThread:
    srv = ServerThread([ModelSpec(path=model_path, name="speech")], EngineOptions(kv_cache_gib=0.02), data_dir=data_dir)
    srv.__enter__()
    servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
    servicer.limits.audio_seconds_base = 0.3  # the random decoder speaks its whole budget
    servicer.limits.audio_seconds_per_char = 0.01
    return srv


def synthesize(stub, voice: str, text: str = "Good morning.") -> speech_pb2.SpeechSummary:
    request = speech_pb2.SynthesizeSpeechRequest(
        text=text,
        voice=speech_pb2.VoiceSelection(name=voice),
        audio_config=speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16),
    )
    responses = list(stub.SynthesizeSpeech(request, timeout=120))
    assert responses[-1].WhichOneof("response") == "summary"
    assert sum(len(r.audio.data) for r in responses if r.WhichOneof("response") == "audio") > 0
    return responses[-1].summary


def create_request(wav: bytes, name: str = "alice", **fields) -> speech_pb2.CreateVoiceRequest:
    fields.setdefault("transcript", TRANSCRIPT)
    return speech_pb2.CreateVoiceRequest(name=name, reference_audio=content_pb2.AudioPart(data=wav), **fields)


def code_of(call, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=60)
    return info.value.code()


def test_created_voice_is_cached_survives_restart_and_deletes(model_path, tmp_path):
    data_dir = tmp_path / "data"
    wav = reference_wav(tmp_path)
    srv = start(model_path, data_dir)
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        voice = stub.CreateVoice(create_request(wav, description="test speaker"), timeout=120).voice
        assert voice.kind == speech_pb2.VOICE_KIND_CREATED and voice.reference_seconds > 0.5
        listed = {v.name: v.kind for v in stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=30).voices}
        assert listed["alice"] == speech_pb2.VOICE_KIND_CREATED and listed["tara"] == speech_pb2.VOICE_KIND_BUILT_IN

        first = synthesize(stub, "alice")
        second = synthesize(stub, "alice", "Something else entirely.")
        reference_tokens = round(voice.reference_seconds * 24000 / 2048) * ORPHEUS_LAYOUT.frame_size
        assert second.cached_prompt_tokens >= reference_tokens > 0, (first, second)
        assert second.cached_prompt_tokens > first.cached_prompt_tokens

        # Errors: a taken name, a built-in name, a bad name, no transcript and no audio.
        assert code_of(stub.CreateVoice, create_request(wav)) == grpc.StatusCode.ALREADY_EXISTS
        assert code_of(stub.CreateVoice, create_request(wav, name="tara")) == grpc.StatusCode.ALREADY_EXISTS
        bad = speech_pb2.CreateVoiceRequest(name="../x", transcript="")
        assert code_of(stub.CreateVoice, bad) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(stub.DeleteVoice, speech_pb2.DeleteVoiceRequest(name="nobody")) == grpc.StatusCode.NOT_FOUND
        built_in = speech_pb2.DeleteVoiceRequest(name="tara")
        assert code_of(stub.DeleteVoice, built_in) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        srv.stop()

    srv = start(model_path, data_dir)  # a restart: the voice is read back from the data folder
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        names = [v.name for v in stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=30).voices]
        assert "alice" in names
        synthesize(stub, "alice")
        stub.DeleteVoice(speech_pb2.DeleteVoiceRequest(name="alice"), timeout=30)
        request = speech_pb2.SynthesizeSpeechRequest(text="Hi.", voice=speech_pb2.VoiceSelection(name="alice"))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.SynthesizeSpeech(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert not list((data_dir / "voices").rglob("*.json"))
    finally:
        srv.stop()


def test_cli_voices_and_speak_voice_from(model_path, tmp_path, capsys):
    from omnivox.services.cli import main

    ref = tmp_path / "ref.wav"
    ref.write_bytes(reference_wav(tmp_path))
    srv = start(model_path, tmp_path / "data")
    try:
        server = ["--server", srv.address]
        assert main(["voices", "create", "bob", "--audio", str(ref), "--transcript", TRANSCRIPT, *server]) == 0
        assert main(["voices", "list", *server]) == 0
        out = capsys.readouterr().out
        assert "bob\tcreated" in out and "tara\tbuilt-in" in out
        wav = tmp_path / "out.wav"
        args = ["speak", "Hi there.", "-o", str(wav), "--voice-from", str(ref), "--transcript", TRANSCRIPT, "-q"]
        assert main([*args, *server]) == 0
        assert main([*args, *server]) == 0  # the same reference again: the voice is reused
        assert sf.read(wav)[0].size > 0
        capsys.readouterr()
        assert main(["voices", "list", *server]) == 0
        assert sum(line.startswith("ref-") for line in capsys.readouterr().out.splitlines()) == 1
        assert main(["voices", "delete", "bob", *server]) == 0
        assert main(["voices", "delete", "bob", *server]) != 0  # NOT_FOUND now
    finally:
        srv.stop()


def test_voices_that_cannot_be_stored_are_failed_precondition(model_path, tmp_path):
    """A data folder that cannot take files (the shipped deployment's read-only root with no --data-dir volume) was
    INTERNAL with a traceback; now FAILED_PRECONDITION saying how to serve, and the server keeps serving."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "voices").write_text("a file where the voices folder should be")  # root ignores chmod: block mkdir
    srv = start(model_path, data_dir)
    try:
        stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateVoice(create_request(reference_wav(tmp_path)), timeout=120)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--data-dir" in info.value.details(), info.value.details()
        names = [v.name for v in stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=30).voices]
        assert "alice" not in names
        synthesize(stub, "tara")
    finally:
        srv.stop()
