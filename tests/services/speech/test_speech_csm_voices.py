"""CSM voices created from reference audio, over real gRPC: the reference encoded by our Mimi encoder (== transformers'
MimiModel.encode) and its transcript become an earlier turn; greedy audio in that voice == transformers'
CsmForConditionalGeneration.generate given the same conversation through its CsmProcessor, frame for frame; the
reference turn is prefix-cached; listed, deleted, bad input, nothing left behind."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file
from support.csm_checkpoints import TINY_CSM_SHAPES, save_tiny_csm
from support.service_harness import ServerThread, nothing_left
from transformers import CsmForConditionalGeneration, CsmProcessor

from omnivox.codecs.audio_input import decode_audio
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.parts.voices import VoiceLimits
from omnivox.v1 import content_pb2, sampling_pb2, speech_pb2, speech_pb2_grpc

ENC = content_pb2.AudioEncoding
FRAMES = 5  # the audio budget, in frames (24 samples each at 24 kHz for the tiny codecs)
REFERENCE_SAMPLES = 700  # 29.2 ms at 24 kHz = 30 frames of the tiny codecs (1000 frames/s)
TRANSCRIPT = "A short reference line."
GREEDY = sampling_pb2.SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module", params=sorted(TINY_CSM_SHAPES))
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = save_tiny_csm(root / request.param, request.param, seed=3)
    with ServerThread(
        [ModelSpec(path=path, name="csm")], EngineOptions(kv_cache_gib=0.02), data_dir=root / "data"
    ) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = FRAMES * 24 / 24000  # random weights never end on their own
        servicer.limits.audio_seconds_per_char = 0.0
        servicer.voices.limits = VoiceLimits(min_reference_seconds=0.01)  # the tiny codecs: 1000 frames/s
        srv.path = path
        yield srv


def wav(samples: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def reference_audio(n: int = REFERENCE_SAMPLES, seed: int = 0) -> np.ndarray:
    t = np.arange(n) / 24000
    noise = np.random.default_rng(seed).normal(0, 0.1, n)
    return (0.4 * np.sin(2 * np.pi * 220 * t) + noise).astype(np.float32)


def create(stub, name: str, data: bytes, transcript: str = TRANSCRIPT, **audio) -> speech_pb2.Voice:
    request = speech_pb2.CreateVoiceRequest(
        model="csm", name=name, transcript=transcript, reference_audio=content_pb2.AudioPart(data=data, **audio)
    )
    return stub.CreateVoice(request, timeout=60).voice


def synthesize(stub, voice: str, text: str = "Hello there.", sampling=GREEDY):
    request = speech_pb2.SynthesizeSpeechRequest(
        model="csm",
        text=text,
        voice=speech_pb2.VoiceSelection(name=voice),
        audio_config=speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16),
        sampling=sampling,
    )
    responses = list(stub.SynthesizeSpeech(request, timeout=120))
    assert responses[-1].WhichOneof("response") == "summary"
    data = b"".join(r.audio.data for r in responses[1:-1])
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, responses[-1].summary


def reference_generate(path, reference: np.ndarray, text: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """transformers' side: the conversation (the reference turn with its audio, then the text) through the folder's
    CsmProcessor, greedy generate, Mimi decode -> (reference codes (N x T), generated codes (FRAMES x N), audio)."""
    model = CsmForConditionalGeneration.from_pretrained(path).eval()
    processor = CsmProcessor.from_pretrained(path)
    conversation = [
        {"role": "0", "content": [{"type": "text", "text": TRANSCRIPT}, {"type": "audio"}]},
        {"role": "0", "content": [{"type": "text", "text": text}]},
    ]
    prompt = processor.apply_chat_template(conversation, tokenize=False)
    # The processor counts the audio's frames from Mimi's conv layers; its defaults are the 12.5 Hz Mimi's, so the
    # tiny codec's own layers are given (transformers' MimiEncoder lists them in `_conv1d_layer_names`), as dilated
    # kernels' spans: CsmProcessor._get_encoded_length pads by `kernel - stride` where MimiConv1d pads by the span
    # (28 frames instead of 30 for csm-b's dilation-2 residual convs).
    seanet = model.codec_model.encoder.encoder_seanet
    convs = [seanet.get_submodule(n).conv for n in seanet._conv1d_layer_names] + [
        model.codec_model.encoder.downsample.conv
    ]
    lengths = dict(
        kernel_sizes=[(c.kernel_size[0] - 1) * c.dilation[0] + 1 for c in convs], strides=[c.stride[0] for c in convs],
        dilations=[1] * len(convs), use_causal_conv=True,
    )  # fmt: skip
    inputs = processor(text=prompt, audio=[reference], encoded_length_kwargs=lengths, sampling_rate=24000)
    with torch.no_grad():
        ref_codes = model.codec_model.encode(torch.from_numpy(reference)[None, None]).audio_codes[0]
        codes = model.generate(**inputs, do_sample=False, depth_decoder_do_sample=False, max_new_tokens=FRAMES)[0]
        codes = codes.masked_fill(codes >= model.config.codec_config.codebook_size, 0)  # random weights' specials
        audio = model.codec_model.decode(codes.T[None]).audio_values[0, 0].numpy()
    return ref_codes, codes, audio


def test_created_voice_speaks_as_transformers_with_the_reference_turn(server):
    """The voice's stored frames are transformers' Mimi encode of the reference; greedy audio in that voice is
    transformers' generate given the reference turn through the processor, decoded by its Mimi; the second request
    in the voice finds the reference turn in the prefix cache."""
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    data = wav(reference_audio())
    voice = create(stub, "ref", data)
    assert voice.kind == speech_pb2.VOICE_KIND_CREATED and voice.reference_seconds == pytest.approx(
        700 / 24000, abs=1e-3
    )
    listed = {v.name: v.kind for v in stub.ListVoices(speech_pb2.ListVoicesRequest(model="csm"), timeout=30).voices}
    assert listed["ref"] == speech_pb2.VOICE_KIND_CREATED and listed["0"] == speech_pb2.VOICE_KIND_BUILT_IN

    served = decode_audio(data, "WAV", target_rate=24000).samples  # the 16-bit reference as the server read it
    ref_codes, codes, expected = reference_generate(server.path, served, "Hello there.")
    stored = stored_frames(server, "ref")
    assert torch.equal(torch.tensor(stored).T, ref_codes)  # (N x 30): the encoder == MimiModel.encode

    got, first = synthesize(stub, "ref")
    assert first.audio_tokens == FRAMES and len(got) == len(expected) == FRAMES * 24
    inside = np.abs(expected) < 0.999  # 16-bit clipping aside
    np.testing.assert_allclose(got[inside], expected[inside], atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.05
    without, _ = synthesize(stub, "0")  # the same speaker with no reference turn: other audio
    assert not np.allclose(without, got, atol=1e-3)

    _, second = synthesize(stub, "ref", "Something else entirely.")
    reference_turn = len(ref_codes[0]) + 1  # its frames and the end frame, after the transcript's tokens
    assert first.cached_prompt_tokens < reference_turn <= second.cached_prompt_tokens, (first, second)
    again, third = synthesize(stub, "ref")  # the reference turn from the cache, not embedded again: the same audio
    assert third.cached_prompt_tokens >= second.cached_prompt_tokens
    np.testing.assert_allclose(again, got, atol=1e-4, rtol=0)
    all_released(server)


def stored_frames(server, name: str):
    servicer = next(b.servicer for b in server.server.services if isinstance(b.servicer, SpeechServicer))
    return servicer.voices.get("csm", name).frames


def all_released(server) -> None:
    """No engine request or KV block held (services harness), no codec stream or decode state open."""
    nothing_left(server, "csm")
    worker = server.registry.lookup("csm").bundle.speech.worker
    assert worker.decoder.open_states == 0 and worker.open_streams == 0


def test_streamed_clauses_in_a_created_voice(server):
    """StreamingSynthesizeSpeech in a created voice: the first clause speaks as SynthesizeSpeech does in that voice
    (the reference turn before it), and every later clause keeps the reference turn (then the clause before, with
    its audio), which the prefix cache serves."""
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
    create(stub, "streamer", wav(reference_audio(seed=1)))
    clauses = ("Hello there. ", "A second clause, ", "and the end.")

    def requests():
        config = speech_pb2.StreamingSpeechConfig(
            model="csm",
            voice=speech_pb2.VoiceSelection(name="streamer"),
            audio_config=speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16),
            sampling=GREEDY,
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
        for chunk in clauses:
            yield speech_pb2.StreamingSynthesizeSpeechRequest(text=chunk)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    responses = list(stub.StreamingSynthesizeSpeech(requests(), timeout=120))
    data = b"".join(r.audio.data for r in responses if r.WhichOneof("response") == "audio")
    streamed = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    summary = responses[-1].summary
    assert len(streamed) == len(clauses) * FRAMES * 24
    alone, _ = synthesize(stub, "streamer", "Hello there.")
    np.testing.assert_allclose(streamed[: FRAMES * 24], alone, atol=2e-4, rtol=0)

    tokenizer = server.registry.lookup("csm").bundle.speech.text_tokenizer
    reference_turn = 2 + len(tokenizer(f"[0]{TRANSCRIPT}", add_special_tokens=False)["input_ids"]) + 30 + 1
    block = server.engine("csm").block_size
    assert summary.cached_prompt_tokens >= 2 * (reference_turn // block) * block > 0, summary
    all_released(server)


def transformers_frames(model, prompt: list[int], context: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Greedy generate from `prompt` whose audio positions take frames' summed codebook embeddings, as
    `_merge_input_ids_with_input_values` puts them (context: (start, codes (T x N)) of each audio run, end frame
    included) -> frames (FRAMES x N), random weights' special codes as served (0)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        embeds = model.embed_text_tokens(ids)
        for start, codes in context:
            embeds[0, start : start + len(codes)] = model.backbone_model.embed_tokens(codes[None])[0]
        out = model.generate(
            input_ids=ids, inputs_embeds=embeds, do_sample=False, depth_decoder_do_sample=False, max_new_tokens=FRAMES
        )[0]
    # Given embeddings, transformers 5.24's CSM generate returns the new frames, then len(prompt) rows more (with
    # input_ids only, the new frames alone: they are equal, checked on csm-a).
    assert out.shape[0] == FRAMES + len(prompt)
    out = out[:FRAMES]
    return out.masked_fill(out >= model.config.codec_config.codebook_size, 0)


def test_a_streamed_clause_speaks_after_the_clause_before_as_transformers_does(server):
    """Speaker 1, two clauses: the second clause's prompt is the first clause's turn with its frames (+ the end
    frame) as an audio turn, then its own; transformers' generate given that conversation's embeddings gives the
    same frames, and the one codec stream's audio is Mimi's decode of both clauses' frames in a row."""
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())

    def requests():
        config = speech_pb2.StreamingSpeechConfig(
            model="csm",
            voice=speech_pb2.VoiceSelection(name="1"),
            audio_config=speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16),
            sampling=GREEDY,
        )
        yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
        yield speech_pb2.StreamingSynthesizeSpeechRequest(text="Hello there. A second clause.")
        yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

    responses = list(stub.StreamingSynthesizeSpeech(requests(), timeout=120))
    data = b"".join(r.audio.data for r in responses if r.WhichOneof("response") == "audio")
    streamed = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0

    model = CsmForConditionalGeneration.from_pretrained(server.path).eval()
    tokenizer = server.registry.lookup("csm").bundle.speech.text_tokenizer
    cfg = model.config

    def turn(text: str) -> list[int]:
        ids = tokenizer(f"[1]{text}", add_special_tokens=False)["input_ids"]
        return [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]

    first = transformers_frames(model, turn("Hello there."), [])
    audio_turn = torch.cat([first, torch.full((1, cfg.num_codebooks), cfg.codebook_eos_token_id)])  # + the end frame
    head = turn("Hello there.")
    prompt = head + [cfg.audio_token_id] * FRAMES + [cfg.audio_eos_token_id] + turn("A second clause.")
    second = transformers_frames(model, prompt, [(len(head), audio_turn)])
    with torch.no_grad():
        expected = model.codec_model.decode(torch.cat([first, second]).T[None]).audio_values[0, 0].numpy()
    assert len(streamed) == len(expected) == 2 * FRAMES * 24
    inside = np.abs(expected) < 0.999
    np.testing.assert_allclose(streamed[inside], expected[inside], atol=1e-4, rtol=0)
    alone = transformers_frames(model, turn("A second clause."), [])
    assert not torch.equal(alone, second)  # the context changed what the clause says
    all_released(server)


def fields_of(err: grpc.RpcError) -> list[str]:
    return [v.field for d in status_details(err) if d.DESCRIPTOR.name == "BadRequest" for v in d.field_violations]


def test_bad_references_and_unknown_voices(server):
    stub = speech_pb2_grpc.SpeechServiceStub(server.channel())

    def refused(name, data, transcript=TRANSCRIPT, **audio) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            create(stub, name, data, transcript, **audio)
        return err.value

    # Longer than half the model's context (512 positions): refused before encoding, naming the field.
    err = refused("long", wav(reference_audio(400 * 24)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and fields_of(err) == ["reference_audio"]
    assert "256" in err.details() or any("256" in str(d) for d in status_details(err))
    err = refused("quiet", wav(reference_audio()), transcript="  ")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and fields_of(err) == ["transcript"]
    raw = (reference_audio() * 32767).astype("<i2").tobytes()
    err = refused("raw", raw, encoding=ENC.AUDIO_ENCODING_LINEAR16)  # headerless with no rate
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and fields_of(err) == ["reference_audio.sample_rate_hertz"]
    err = refused("0", wav(reference_audio()))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS  # a speaker id is a built-in voice

    # Another rate is resampled to the codec's 24 kHz: 20 ms at 16 kHz is 20 ms of frames.
    voice = create(stub, "sixteen", wav(reference_audio(320), 16000))
    assert voice.reference_seconds == pytest.approx(0.02, abs=1e-3)
    assert len(stored_frames(server, "sixteen")) == 20

    with pytest.raises(grpc.RpcError) as err:
        synthesize(stub, "nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.value.details()
    stub.DeleteVoice(speech_pb2.DeleteVoiceRequest(model="csm", name="sixteen"), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        synthesize(stub, "sixteen")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    names = [v.name for v in stub.ListVoices(speech_pb2.ListVoicesRequest(model="csm"), timeout=30).voices]
    assert "sixteen" not in names
    synthesize(stub, "0")  # still serving
    all_released(server)


def test_a_codec_without_an_encoder_cannot_create_voices(tmp_path):
    """A CSM folder whose Mimi has only its decoder (an export for speaking only) speaks, and CreateVoice is
    FAILED_PRECONDITION naming the model (it was an INTERNAL error), with nothing left behind."""
    path = save_tiny_csm(tmp_path / "csm", "csm-a", seed=3)
    tensors = load_file(str(path / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith("codec_model.encoder.")}
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    with ServerThread([ModelSpec(path=path, name="csm")], EngineOptions(kv_cache_gib=0.02), data_dir=tmp_path) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = FRAMES * 24 / 24000
        servicer.voices.limits = VoiceLimits(min_reference_seconds=0.01)
        stub = speech_pb2_grpc.SpeechServiceStub(srv.channel())
        with pytest.raises(grpc.RpcError) as err:
            create(stub, "ref", wav(reference_audio()))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'csm'" in err.value.details()
        synthesize(stub, "0")  # still serving
        all_released(srv)
