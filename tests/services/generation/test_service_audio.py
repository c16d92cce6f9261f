"""Audio input over gRPC: GenerationService with audio parts, served by a real server on tiny random Qwen2-Audio and
Qwen3-ASR checkpoints (saved with processor + chat template), against transformers' processor + `generate`."""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest
import torch
import transformers
from support.audio_checkpoints import chirp, encode, make_qwen2_audio, make_qwen3_asr, noise, tone
from support.checkpoints import make_checkpoint
from support.grpc_errors import violated_fields
from support.service_harness import ServerThread, nothing_left

from omnivox.codecs.audio_format import float_to_int16
from omnivox.codecs.audio_input import decode_audio
from omnivox.services.parts.bundle import probe
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc, sampling_pb2

STEPS = 16
FAMILIES = {
    "qwen2_audio": (make_qwen2_audio, transformers.Qwen2AudioForConditionalGeneration),
    "qwen3_asr": (make_qwen3_asr, transformers.Qwen3ASRForConditionalGeneration),
}
WAV, FLAC, LINEAR16 = (
    content_pb2.AUDIO_ENCODING_WAV,
    content_pb2.AUDIO_ENCODING_FLAC,
    content_pb2.AUDIO_ENCODING_LINEAR16,
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    make, ref_cls = FAMILIES[family]
    path = make(tmp_path_factory.mktemp(family) / family, seed=1)
    text = make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-text", family="llama")
    specs = [ModelSpec(path=path, name=family), ModelSpec(path=text, name="text")]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as server:
        yield {
            "family": family,
            "server": server,
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "processor": transformers.AutoProcessor.from_pretrained(path),
            "reference": ref_cls.from_pretrained(path).eval(),
            "audio": server.registry.lookup(family).bundle.audio,
            "path": path,
        }


def ask(audio: content_pb2.AudioPart, question: str, model: str) -> generation_pb2.GenerateRequest:
    parts = [content_pb2.Part(audio=audio), content_pb2.Part(text=question)]
    return generation_pb2.GenerateRequest(
        model=model,
        contents=[content_pb2.Content(role="user", parts=parts)],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=STEPS,
        ignore_eos=True,
    )


def tokens(stub, request) -> tuple[list[int], generation_pb2.GenerateSummary]:
    ids, summary = [], None
    for response in stub.Generate(request, timeout=120):
        if response.HasField("delta"):
            ids.extend(response.delta.token_ids)
        else:
            summary = response.summary
    assert summary is not None
    return ids, summary


def reference(s, samples: np.ndarray, question: str) -> tuple[int, list[int]]:
    """(prompt length, greedy tokens) of transformers' processor + generate for [audio, question]."""
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]}]
    prompt = s["processor"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = s["processor"](text=[prompt], audio=[samples], sampling_rate=16000, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "num_audio_tokens"}
    with torch.no_grad():
        out = s["reference"].generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return n, out[0, n:].tolist()


def test_wav_flac_linear16_over_grpc_equal_transformers_and_share_one_cache_entry(served):
    pcm = float_to_int16(chirp(2.3) + noise(2.3, amp=0.05))
    question = "What is this sound?"
    misses = served["audio"].cache.misses
    parts = [
        content_pb2.AudioPart(data=encode(pcm, 16000, "WAV")),
        content_pb2.AudioPart(data=encode(pcm, 16000, "FLAC"), encoding=FLAC),
        content_pb2.AudioPart(data=pcm.tobytes(), encoding=LINEAR16, sample_rate_hertz=16000),
    ]
    results = [tokens(served["stub"], ask(p, question, served["family"])) for p in parts]
    prompt_len, want = reference(served, pcm.astype(np.float32) / 32768.0, question)
    for got, summary in results:
        assert got == want, f"{served['family']}: {got} != {want}"
        assert summary.usage.prompt_tokens == prompt_len
    assert served["audio"].cache.misses == misses + 1  # WAV, FLAC and LINEAR16: one encoder-cache entry
    assert results[1][1].usage.cached_prompt_tokens > 0  # the repeat hits the prefix cache (audio key in the hash)
    nothing_left(served["server"], served["family"])


def test_44k_stereo_is_resampled_and_mixed(served):
    rate = 44100
    stereo = np.stack([chirp(1.7, rate=rate), noise(1.7, rate=rate, amp=0.1, seed=9)], axis=1)
    data = encode(stereo, rate, "WAV", "FLOAT")
    got, _ = tokens(served["stub"], ask(content_pb2.AudioPart(data=data), "Describe it.", served["family"]))
    samples = decode_audio(data, target_rate=16000).samples
    assert got == reference(served, samples, "Describe it.")[1]
    nothing_left(served["server"], served["family"])


BAD = {
    "empty": (content_pb2.AudioPart(data=b""), "contents[0].parts[0].audio.data"),
    "undecodable": (
        content_pb2.AudioPart(data=b"not audio at all, just some bytes"),
        "contents[0].parts[0].audio.data",
    ),
    "raw without rate": (content_pb2.AudioPart(data=b"\0\1" * 800, encoding=LINEAR16), ".audio.sample_rate_hertz"),
    "non-finite": (
        content_pb2.AudioPart(data=encode(np.full(1600, np.nan, np.float32), 16000, "WAV", "FLOAT")),
        ".data",
    ),
}


def too_long(s) -> content_pb2.AudioPart:
    """Silence 1 s over the family's limit (Qwen2-Audio: its 30 s window; Qwen3-ASR: 300 s)."""
    seconds = s["audio"].limits.max_seconds + 1.0
    return content_pb2.AudioPart(data=encode(np.zeros(round(seconds * 16000), np.float32), 16000, "FLAC"))


def test_bad_audio_is_invalid_argument_naming_the_part_and_the_server_keeps_serving(served):
    stub = served["stub"]
    for name, (part, field) in [*BAD.items(), ("too long", (too_long(served), ".audio.data"))]:
        with pytest.raises(grpc.RpcError) as info:
            tokens(stub, ask(part, "hi", served["family"]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        fields = violated_fields(info.value)
        assert len(fields) == 1 and fields[0].startswith("contents[0].parts[0].audio") and fields[0].endswith(field), (
            name,
            fields,
        )
    # User text that spells the audio marker cannot smuggle in a placeholder.
    marker = served["audio"].marker_text()
    good = content_pb2.AudioPart(data=encode(tone(0.5), 16000, "WAV"))
    with pytest.raises(grpc.RpcError) as info:
        tokens(stub, ask(good, f"what is {marker}?", served["family"]))
    assert violated_fields(info.value) == ["contents[0].parts[1].text"]
    # Audio to a text-only model.
    with pytest.raises(grpc.RpcError) as info:
        tokens(stub, ask(good, "hi", "text"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(info.value) == ["contents[0].parts[0].audio"]
    nothing_left(served["server"], served["family"])
    got, summary = tokens(stub, ask(good, "still there?", served["family"]))  # still serving
    assert len(got) == STEPS and summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    nothing_left(served["server"], served["family"])


def test_list_models_shows_audio_input(served):
    stub = model_pb2_grpc.ModelServiceStub(served["server"].channel())
    models = {m.name: m for m in stub.ListModels(model_pb2.ListModelsRequest()).models}
    assert model_pb2.MODALITY_AUDIO in models[served["family"]].input_modalities
    assert model_pb2.MODALITY_AUDIO not in models["text"].input_modalities
    # Known before loading too (ListModels while the model loads): the manifest reads the family from config.json.
    manifest = probe(ModelSpec(path=served["path"]))
    assert "audio" in manifest.input_modalities and "audio" in manifest.parts and manifest.planned_parts == ()


def test_cancelled_audio_stream_frees_kv_and_cache_references(served):
    request = ask(content_pb2.AudioPart(data=encode(tone(1.0), 16000, "WAV")), "Go on.", served["family"])
    request.max_output_tokens = 2000
    call = served["stub"].Generate(request)
    first = next(call)
    assert first.HasField("delta")
    call.cancel()
    nothing_left(served["server"], served["family"])


def test_a_request_over_the_grpc_message_limit_is_resource_exhausted(tmp_path):
    path = make_qwen2_audio(tmp_path / "qwen2-audio", seed=5)
    spec = ModelSpec(path=path, name="small-messages")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01), max_receive_message_bytes=1 << 20) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        big = content_pb2.AudioPart(data=encode(noise(20.0, amp=0.3), 16000, "WAV", "FLOAT"))  # 1.28 MB
        with pytest.raises(grpc.RpcError) as info:
            tokens(stub, ask(big, "hi", "small-messages"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        got, _ = tokens(stub, ask(content_pb2.AudioPart(data=encode(tone(0.5), 16000, "WAV")), "hi", "small-messages"))
        assert len(got) == STEPS


def test_concurrent_audio_requests_each_equal_transformers(served):
    """Three clients at once, each with its own clip: batched in the engine (and, when admitted together, in the
    encoder), each answer as transformers gives it alone."""
    clips = [float_to_int16(chirp(0.7 + 0.5 * i, f0=150.0 * (i + 1))) for i in range(3)]
    requests = [ask(content_pb2.AudioPart(data=encode(c, 16000, "WAV")), "Which one?", served["family"]) for c in clips]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda r: tokens(served["stub"], r)[0], requests))
    wants = [reference(served, c.astype(np.float32) / 32768.0, "Which one?")[1] for c in clips]
    assert results == wants
    nothing_left(served["server"], served["family"])
