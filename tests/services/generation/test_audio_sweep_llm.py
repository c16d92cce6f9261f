"""Audio-LLM configs users bring, over a real gRPC server, against transformers' processor + `generate`:
- Qwen2-Audio with tie_word_embeddings true, GQA 4:1, a 3-layer 2-head encoder of width 48 and a wider text model:
  transformers' Qwen2AudioForConditionalGeneration never ties (its lm_head is its own weight), and we tied it;
- several audio parts in one turn, audio then text then audio (equal before; kept as regression cases), on Qwen3-ASR
  too, whose processor refuses more than one audio per text: there against its model fed the processor's per-clip
  features and expanded prompt directly;
- audio a few samples over the window is refused with a length that says so (it read "30.00 s ... at most 30 s").
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
import transformers
from support.audio_checkpoints import (
    QWEN2_AUDIO_TOKENS,
    _save,
    chirp,
    encode,
    make_qwen3_asr,
    noise,
    tokenizer_with,
    tone,
)
from support.service_harness import ServerThread

from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

STEPS = 8


def make_tied_qwen2_audio(out, seed: int = 1):
    tok = tokenizer_with(QWEN2_AUDIO_TOKENS)
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(
            num_mel_bins=128, encoder_layers=3, encoder_attention_heads=2, encoder_ffn_dim=96, d_model=48,
            max_source_positions=1500,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        audio_token_id=tok.convert_tokens_to_ids(QWEN2_AUDIO_TOKENS["audio_token"]),
        tie_word_embeddings=True,
    )  # fmt: skip
    processor = transformers.Qwen2AudioProcessor(feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
                                                 tokenizer=tok)  # fmt: skip
    return _save(transformers.Qwen2AudioForConditionalGeneration, config, processor, out, seed)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tied_qwen2_audio(tmp_path_factory.mktemp("tied") / "qwen2-audio-tied")
    with ServerThread([ModelSpec(path=path, name="tied")], EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "processor": transformers.AutoProcessor.from_pretrained(path),
            "reference": transformers.Qwen2AudioForConditionalGeneration.from_pretrained(path).eval(),
            "server": server,
        }


def ours(s, parts: list) -> list[int]:
    content = [
        content_pb2.Part(audio=content_pb2.AudioPart(data=encode(p, 16000, "WAV", "FLOAT")))
        if isinstance(p, np.ndarray) else content_pb2.Part(text=p)
        for p in parts
    ]  # fmt: skip
    request = generation_pb2.GenerateRequest(
        model="tied", contents=[content_pb2.Content(role="user", parts=content)],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0), max_output_tokens=STEPS, ignore_eos=True,
    )  # fmt: skip
    return [t for r in s["stub"].Generate(request, timeout=120) if r.HasField("delta") for t in r.delta.token_ids]


def theirs(s, parts: list) -> list[int]:
    content = [{"type": "audio"} if isinstance(p, np.ndarray) else {"type": "text", "text": p} for p in parts]
    messages = [{"role": "user", "content": content}]
    prompt = s["processor"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    audio = [p for p in parts if isinstance(p, np.ndarray)]
    inputs = s["processor"](text=[prompt], audio=audio, sampling_rate=16000, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "num_audio_tokens"}
    with torch.no_grad():
        out = s["reference"].generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    "case",
    ["one audio", "two audios", "audio text audio"],
)
def test_tied_gqa_qwen2_audio_equals_transformers(served, case):
    parts = {
        "one audio": [chirp(2.0), "What is this?"],
        "two audios": [chirp(1.0), noise(1.5, seed=2), "Which is louder?"],
        "audio text audio": [chirp(1.2), "and then", tone(0.8), "compare them"],
    }[case]
    assert ours(served, parts) == theirs(served, parts)


def test_a_few_samples_over_the_window_says_so(served):
    clip = noise(30.0 + 1 / 16000, amp=0.05)
    with pytest.raises(grpc.RpcError) as info:
        ours(served, [clip, "What?"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "30.000062 s" in info.value.details() and "audio.data" in info.value.details()
    assert ours(served, [clip[:-1], "What?"]) == theirs(served, [clip[:-1], "What?"])  # exactly 30 s is served


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_qwen3_asr(tmp_path_factory.mktemp("qwen3") / "qwen3-asr", seed=1)
    with ServerThread([ModelSpec(path=path, name="qwen3")], EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "stub": generation_pb2_grpc.GenerationServiceStub(server.channel()),
            "processor": transformers.AutoProcessor.from_pretrained(path),
            "reference": transformers.Qwen3ASRForConditionalGeneration.from_pretrained(path).eval(),
        }


def qwen3_reference(s, parts: list) -> list[int]:
    """Qwen3ASRForConditionalGeneration.generate on the processor's own per-clip features and placeholder counts."""
    proc = s["processor"]
    content = [{"type": "audio"} if isinstance(p, np.ndarray) else {"type": "text", "text": p} for p in parts]
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    clips = [proc._process_audio([p], sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
             for p in parts if isinstance(p, np.ndarray)]  # fmt: skip
    pieces = prompt.split(proc.audio_token)
    text = pieces[0] + "".join(markers[0] + piece for (_, markers), piece in zip(clips, pieces[1:], strict=True))
    ids = proc.tokenizer([text], return_tensors="pt")
    frames = max(f["input_features"].shape[-1] for f, _ in clips)
    features = torch.zeros(len(clips), clips[0][0]["input_features"].shape[1], frames)
    mask = torch.zeros(len(clips), frames, dtype=torch.long)
    for i, (f, _) in enumerate(clips):
        features[i, :, : f["input_features"].shape[-1]] = f["input_features"][0]
        mask[i, : f["input_features"].shape[-1]] = f["input_features_mask"][0]
    with torch.no_grad():
        out = s["reference"].generate(
            input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], input_features=features,
            input_features_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
        )  # fmt: skip
    return out[0, ids["input_ids"].shape[1] :].tolist()


def test_qwen3_asr_several_audio_parts_equal_its_model(qwen3):
    cases = [[chirp(1.0), noise(1.5, seed=2), "Which is louder?"], [chirp(1.2), "and then", tone(0.8), "compare"]]
    for parts in cases:
        request_parts = [
            content_pb2.Part(audio=content_pb2.AudioPart(data=encode(p, 16000, "WAV", "FLOAT")))
            if isinstance(p, np.ndarray) else content_pb2.Part(text=p)
            for p in parts
        ]  # fmt: skip
        request = generation_pb2.GenerateRequest(
            model="qwen3", contents=[content_pb2.Content(role="user", parts=request_parts)],
            sampling=sampling_pb2.SamplingConfig(temperature=0.0), max_output_tokens=STEPS, ignore_eos=True,
        )  # fmt: skip
        got = [
            t for r in qwen3["stub"].Generate(request, timeout=120) if r.HasField("delta") for t in r.delta.token_ids
        ]
        assert got == qwen3_reference(qwen3, parts)
