"""CSM through the SpeechService over real gRPC (`omnivox serve --model DIR` of a transformers CSM folder): greedy
audio == transformers' generate + Mimi decode, frame for frame; speakers as voices; every encoding; the streaming
RPC; bad input; nothing left behind."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from support.csm_checkpoints import TINY_CSM_SHAPES, save_tiny_csm
from support.service_harness import ServerThread
from transformers import CsmForConditionalGeneration

from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, sampling_pb2, speech_pb2, speech_pb2_grpc

ENC = content_pb2.AudioEncoding
FRAMES = 5  # the audio budget below, in frames (24 samples each at 24 kHz for the tiny codecs)


@pytest.fixture(scope="module", params=sorted(TINY_CSM_SHAPES))
def server(request, tmp_path_factory):
    path = save_tiny_csm(tmp_path_factory.mktemp(request.param) / request.param, request.param, seed=2)
    with ServerThread([ModelSpec(path=path, name="csm")], EngineOptions(kv_cache_gib=0.02)) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = FRAMES * 24 / 24000  # random weights never end on their own
        servicer.limits.audio_seconds_per_char = 0.0
        srv.path, srv.shape = path, request.param
        yield srv


def synthesize(server, text="Hello there.", encoding=ENC.AUDIO_ENCODING_LINEAR16, rate=0, **fields):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    request = speech_pb2.SynthesizeSpeechRequest(
        model="csm", text=text, audio_config=speech_pb2.AudioConfig(encoding=encoding, sample_rate_hertz=rate), **fields
    )
    responses = list(stub.SynthesizeSpeech(request, timeout=120))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "format" and kinds[-1] == "summary" and set(kinds[1:-1]) <= {"audio"}
    return responses[0].format, b"".join(r.audio.data for r in responses[1:-1]), responses[-1].summary


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


GREEDY = sampling_pb2.SamplingConfig(temperature=0.0)


def test_greedy_audio_equals_transformers_generate_and_decode(server):
    """The served audio is transformers' CsmForConditionalGeneration.generate (greedy backbone and depth decoder)
    decoded by its Mimi, frame for frame (LINEAR16 at the codec rate: within the 16-bit rounding)."""
    part = server.registry.lookup("csm").bundle.speech
    text = "Hello there, how are you?"
    _, data, summary = synthesize(server, text, sampling=GREEDY, voice=speech_pb2.VoiceSelection(name="1"))
    reference = CsmForConditionalGeneration.from_pretrained(server.path).eval()
    prompt = part.layout.build_prompt(part.text_tokenizer, text, "1")
    with torch.no_grad():
        codes = reference.generate(
            torch.tensor([prompt]), do_sample=False, depth_decoder_do_sample=False, max_new_tokens=FRAMES
        )[0]  # (FRAMES x N)
        codes = codes.masked_fill(codes >= part.codec.codebook_size, 0)  # random weights' special codes, as served
        expected = reference.codec_model.decode(codes.T[None]).audio_values[0, 0].numpy()
    got = pcm16(data)
    assert summary.audio_tokens == FRAMES and len(got) == len(expected) == FRAMES * part.codec.frame_samples
    assert summary.audio_seconds == pytest.approx(len(expected) / 24000)
    inside = np.abs(expected) < 0.999  # 16-bit clipping aside
    np.testing.assert_allclose(got[inside], expected[inside], atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.05


def test_speakers_are_voices_and_seeds_reproduce(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    voices = stub.ListVoices(speech_pb2.ListVoicesRequest(model="csm")).voices
    assert [v.name for v in voices] == [str(i) for i in range(10)] and {v.model for v in voices} == {"csm"}
    seeded = sampling_pb2.SamplingConfig(seed=7)
    runs = [synthesize(server, voice=speech_pb2.VoiceSelection(name=v), sampling=seeded)[1] for v in ("0", "0", "3")]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with ThreadPoolExecutor(4) as pool:  # the same seed alongside three other streams: the same audio
        batch = list(
            pool.map(lambda s: synthesize(server, sampling=sampling_pb2.SamplingConfig(seed=s))[1], (7, 1, 2, 3))
        )
    assert batch[0] == runs[0]


@pytest.mark.parametrize("encoding", [ENC.AUDIO_ENCODING_WAV, ENC.AUDIO_ENCODING_FLAC, ENC.AUDIO_ENCODING_OGG_OPUS,
                                      ENC.AUDIO_ENCODING_MULAW, ENC.AUDIO_ENCODING_LINEAR16])  # fmt: skip
def test_every_encoding(server, encoding):
    if server.shape != "csm-a":
        pytest.skip("the encoders are the codec's, whatever the model shape: checked once")
    rate = 16000
    fmt, data, summary = synthesize(server, encoding=encoding, rate=rate, sampling=GREEDY)
    assert (fmt.encoding, fmt.sample_rate_hertz, fmt.channels) == (encoding, rate, 1)
    if encoding == ENC.AUDIO_ENCODING_LINEAR16:
        audio = pcm16(data)
    elif encoding == ENC.AUDIO_ENCODING_MULAW:
        audio = sf.read(io.BytesIO(data), format="RAW", subtype="ULAW", samplerate=rate, channels=1)[0]
    else:
        audio = sf.read(io.BytesIO(data))[0]
    assert len(audio) > 0 and np.abs(audio).max() > 0
    assert summary.time_to_first_audio.ToNanoseconds() > 0 and summary.real_time_factor > 0
    assert summary.model == "csm" and summary.finish_reason


def test_streaming_synthesis_speaks_each_clause(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())

    def requests():
        config = speech_pb2.StreamingSpeechConfig(
            model="csm", audio_config=speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16), sampling=GREEDY
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
        for chunk in ("Hello there. ", "A second clause, ", "and the end."):
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=chunk)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    responses = list(stub.StreamingSynthesizeSpeech(requests(), timeout=120))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "format" and kinds[-1] == "summary"
    audio = b"".join(r.audio.data for r in responses if r.WhichOneof("response") == "audio")
    assert len(audio) // 2 >= 2 * FRAMES * 24 and responses[-1].summary.audio_seconds > 0


def test_bad_input(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())

    def call(**fields):
        request = speech_pb2.SynthesizeSpeechRequest(model="csm", **fields)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.SynthesizeSpeech(request, timeout=60))
        return err.value

    err = call(text="Hi", voice=speech_pb2.VoiceSelection(name="alice"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "alice" in err.details()
    err = call(text="x" * 5001)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = [v.field for d in status_details(err) if d.DESCRIPTOR.name == "BadRequest" for v in d.field_violations]
    assert fields == ["text"]
    err = call(text="Hi", sampling=sampling_pb2.SamplingConfig(temperature=-1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    create = speech_pb2.CreateVoiceRequest(model="csm", name="me")
    with pytest.raises(grpc.RpcError) as raised:
        stub.CreateVoice(create, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # CreateVoice is served (test_speech_csm_voices)
    fields = [
        v.field for d in status_details(raised.value) if d.DESCRIPTOR.name == "BadRequest" for v in d.field_violations
    ]
    assert "transcript" in fields and any(f.startswith("reference_audio") for f in fields)
    synthesize(server, sampling=GREEDY)  # still serving


def test_nothing_left_behind(server):
    synthesize(server, sampling=GREEDY)
    bundle = server.registry.lookup("csm").bundle
    assert bundle.speech.worker.decoder.open_states == 0 and bundle.speech.worker.open_streams == 0
    usage = bundle.engine.kv_usage()
    assert usage.free_blocks == usage.total_blocks
    bundle.engine.check_integrity()
