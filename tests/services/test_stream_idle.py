"""`serve --stream-idle-timeout`: a bidirectional stream whose client sends nothing (and has nothing left in hand)
ends OUT_OF_RANGE and frees its `--max-queue` slot; one whose text is still being spoken is not cut."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from support.service_harness import ServerThread
from support.whisper_checkpoints import make_whisper

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc, transcription_pb2, transcription_pb2_grpc

IDLE_S = 1.0
SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("idle")
    specs = [
        ModelSpec(path=make_whisper(root / "whisper", seed=3), name="whisper"),
        ModelSpec(path=save_random_speech_model(root / "speech", snac_config=SMALL_SNAC), name="speech"),
    ]
    options = EngineOptions(kv_cache_gib=0.02)
    with ServerThread(specs, options, max_queue=1, stream_idle_timeout_s=IDLE_S, data_dir=root / "data") as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.3  # the random decoder speaks its whole budget
        servicer.limits.audio_seconds_per_char = 0.01
        yield srv


def test_an_idle_transcription_stream_ends_and_frees_its_slot(server):
    release = threading.Event()

    def config_then_silence():
        config = transcription_pb2.StreamingTranscriptionConfig(
            model="whisper", sample_rate_hertz=16000, temperature=0.0
        )
        yield transcription_pb2.StreamingTranscribeRequest(config=config)
        release.wait(60)

    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamingTranscribe(config_then_silence(), timeout=60))
    waited = time.monotonic() - start
    release.set()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, err.value
    assert "no audio for 1 s" in err.value.details() and "--stream-idle-timeout" in err.value.details()
    assert IDLE_S <= waited < 30, waited  # not the client's deadline, not the generator's 60 s
    # The one --max-queue slot is free again: a Transcribe is admitted (it was RESOURCE_EXHAUSTED while held).
    tone = (3000 * np.sin(np.arange(8000) / 5)).astype("<i2").tobytes()
    audio = content_pb2.AudioPart(data=tone, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=16000)
    stub.Transcribe(transcription_pb2.TranscribeRequest(model="whisper", audio=audio, temperature=0.0), timeout=60)
    free, total = server.wait_kv_free("whisper", timeout=5.0)
    assert free == total


def test_a_speech_stream_is_not_cut_while_speaking_then_ends_idle(server):
    release = threading.Event()

    def text_then_wait():
        audio_config = speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(
            config=speech_pb2.StreamingSpeechConfig(model="speech", audio_config=audio_config)
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(text="Hello there, this is one clause.")
        release.wait(60)  # a client waiting for its audio before it sends more (or ends)

    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    audio, last_audio = b"", None
    with pytest.raises(grpc.RpcError) as err:
        for response in stub.StreamingSynthesizeSpeech(text_then_wait(), timeout=120):
            if response.WhichOneof("response") == "audio" and response.audio.data:
                audio, last_audio = audio + response.audio.data, time.monotonic()
    ended = time.monotonic()
    release.set()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, err.value
    assert "no text for 1 s" in err.value.details()
    # Spoken while the client sent nothing, and ended only once nothing had gone either way for the bound: the idle
    # clock counts from the last audio out, not from the client's last message.
    assert audio and last_audio is not None
    assert ended - last_audio >= IDLE_S * 0.9, (ended - last_audio, len(audio))
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total


def _until(release: threading.Event, message, every_s: float = 0.1):
    """`message()` every `every_s` until released (at most 20 s): a client that keeps the stream busy with nothing."""
    deadline = time.monotonic() + 20
    i = 0
    while not release.wait(every_s) and time.monotonic() < deadline:
        yield message(i)
        i += 1


def test_empty_chunks_and_repeated_finalize_do_not_hold_a_transcription_stream(server):
    """Only audio resets the idle clock: empty chunks and finalize after finalize, sent every 0.1 s, held the slot
    for as long as the client kept sending them."""
    release = threading.Event()

    def config_then_nothing():
        config = transcription_pb2.StreamingTranscriptionConfig(
            model="whisper", sample_rate_hertz=16000, temperature=0.0
        )
        yield transcription_pb2.StreamingTranscribeRequest(config=config)
        yield transcription_pb2.StreamingTranscribeRequest(audio=b"\0\0" * 1600)  # 0.1 s of audio: work
        yield from _until(release, lambda i: transcription_pb2.StreamingTranscribeRequest(
            **({"audio": b""} if i % 2 else {"finalize": True})
        ))  # fmt: skip

    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamingTranscribe(config_then_nothing(), timeout=60))
    waited = time.monotonic() - start
    release.set()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, err.value
    assert IDLE_S <= waited < 2 * IDLE_S + 2, waited
    free, total = server.wait_kv_free("whisper", timeout=5.0)
    assert free == total


def test_empty_text_does_not_hold_a_speech_stream(server):
    release = threading.Event()

    def config_then_nothing():
        audio_config = speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(
            config=speech_pb2.StreamingSpeechConfig(model="speech", audio_config=audio_config)
        )
        yield from _until(release, lambda i: speech_pb2.StreamingSynthesizeSpeechRequest(text=" " * (i % 2)))

    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamingSynthesizeSpeech(config_then_nothing(), timeout=60))
    waited = time.monotonic() - start
    release.set()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, err.value
    assert "no text for 1 s" in err.value.details()
    assert IDLE_S <= waited < 2 * IDLE_S + 2, waited
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total
