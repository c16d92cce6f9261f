"""Voxtral served end to end: a tiny random checkpoint as the hub ships one (config + safetensors + tekken.json +
processor, tests/support/voxtral_checkpoint.py) behind a real gRPC server. Generate with audio parts and Transcribe equal
transformers' VoxtralProcessor (its `apply_chat_template` / `apply_transcription_request`, written by mistral_common)
+ VoxtralForConditionalGeneration.generate, greedy."""

from __future__ import annotations

import base64
import io
import math
import re

import grpc
import numpy as np
import pytest
import soundfile
import torch
import transformers
from google.rpc import error_details_pb2
from support.audio_checkpoints import chirp, encode, noise, tone
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, nothing_left
from support.voxtral_checkpoint import AUDIO_SECTION, make_voxtral_bundle, write_tekken

from omnivox.codecs.audio_format import float_to_int16
from omnivox.services.calls.audio_llm_windows import TOKENS_BASE, TOKENS_PER_SECOND
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.processing.audio_prompt import load_audio_part
from omnivox.v1 import (
    content_pb2,
    generation_pb2,
    generation_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    sampling_pb2,
    transcription_pb2,
    transcription_pb2_grpc,
)

STEPS = 12
NAME = "voxtral"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_voxtral_bundle(tmp_path_factory.mktemp("voxtral") / "voxtral", seed=1)
    with ServerThread([ModelSpec(path=path, name=NAME)], EngineOptions(kv_cache_gib=0.02)) as server:
        channel = server.channel()
        yield {
            "server": server,
            "path": path,
            "generate": generation_pb2_grpc.GenerationServiceStub(channel),
            "transcribe": transcription_pb2_grpc.TranscriptionServiceStub(channel),
            "processor": transformers.AutoProcessor.from_pretrained(path),
            "reference": transformers.VoxtralForConditionalGeneration.from_pretrained(path).eval(),
            "audio": server.registry.lookup(NAME).bundle.audio,
        }


def pcm_clip(seconds: float, seed: int = 0) -> np.ndarray:
    """A clip as 16-bit PCM holds it (the reference re-reads the WAV we send; both then see the same samples)."""
    return float_to_int16(chirp(seconds) + noise(seconds, amp=0.05, seed=seed)).astype(np.float32) / 32768.0


def wav(samples: np.ndarray) -> bytes:
    return encode(samples, 16000, "WAV")


def generate(s, contents: list[content_pb2.Content], steps: int = STEPS):
    request = generation_pb2.GenerateRequest(
        model=NAME,
        contents=contents,
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=steps,
        ignore_eos=True,
    )
    ids, text, summary = [], "", None
    for response in s["generate"].Generate(request, timeout=120):
        if response.HasField("delta"):
            ids.extend(response.delta.token_ids)
            text += response.delta.text
        else:
            summary = response.summary
    # The text deltas are the Tekken tokenizer's text of the tokens (detokenized through mistral_common); invalid
    # bytes still unfinished when the stream ends (a random model's) are held back (engine/detokenizer.py).
    full = s["processor"].tokenizer.decode(ids, skip_special_tokens=True)
    assert text and full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}
    return ids, summary


def reference_generate(s, conversation: list[dict]) -> tuple[int, list[int]]:
    """(prompt length, greedy tokens) of VoxtralProcessor.apply_chat_template + generate."""
    inputs = s["processor"].apply_chat_template(conversation)
    with torch.no_grad():
        out = s["reference"].generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return n, out[0, n:].tolist()


def _audio_ref(samples: np.ndarray) -> dict:
    return {"type": "audio", "base64": base64.b64encode(wav(samples)).decode()}


def test_generate_audio_and_question_equals_transformers(served):
    short, other = pcm_clip(2.3), pcm_clip(2.3, seed=5) * 0.2 + 0.3 * tone(2.3)
    for clip in (short, other):
        question = "What is the sound?"
        parts = [content_pb2.Part(audio=content_pb2.AudioPart(data=wav(clip))), content_pb2.Part(text=question)]
        got, summary = generate(served, [content_pb2.Content(role="user", parts=parts)])
        n, want = reference_generate(served, [{"role": "user", "content": [_audio_ref(clip), {"type": "text", "text": question}]}])  # fmt: skip
        assert got == want and summary.usage.prompt_tokens == n
    # Two clips, one over 30 s (two chunks: 750 placeholders); then an answered turn and a follow-up question (an
    # assistant turn closed with </s>).
    long_clip = pcm_clip(31.0, seed=2)
    contents = [
        content_pb2.Content(role="user", parts=[
            content_pb2.Part(audio=content_pb2.AudioPart(data=wav(short))),
            content_pb2.Part(text="and"),
            content_pb2.Part(audio=content_pb2.AudioPart(data=encode(long_clip, 16000, "FLAC"),
                                                         encoding=content_pb2.AUDIO_ENCODING_FLAC)),
        ]),
        content_pb2.Content(role="assistant", parts=[content_pb2.Part(text="the thing")]),
        content_pb2.Content(role="user", parts=[content_pb2.Part(text="what is it?")]),
    ]  # fmt: skip
    got, summary = generate(served, contents)
    n, want = reference_generate(served, [
        {"role": "user", "content": [_audio_ref(short), {"type": "text", "text": "and"}, _audio_ref(long_clip)]},
        {"role": "assistant", "content": [{"type": "text", "text": "the thing"}]},
        {"role": "user", "content": [{"type": "text", "text": "what is it?"}]},
    ])  # fmt: skip
    assert got == want and summary.usage.prompt_tokens == n > 375 * 3
    nothing_left(served["server"], NAME)


@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user", "content": [{"type": "text", "text": "no audio at all"}]}],
        [  # the answer is prefilled: mistral_common continues the final assistant turn
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is the"}]},
        ],
        [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}]}],
    ],
    ids=["text only", "prefilled answer", "two clips"],
)
def test_prompt_ids_equal_the_processor(served, conversation):
    """The served prompt (markers expanded to the clips' counts) is the processor's, token for token."""
    clips = iter([pcm_clip(0.4), pcm_clip(45.0, seed=7)])
    filled = [
        {**m, "content": [_audio_ref(next(clips)) if p["type"] == "audio" else p for p in m["content"]]}
        for m in conversation
    ]
    samples = [wav_samples(p["base64"]) for m in filled for p in m["content"] if p["type"] == "audio"]
    audio = served["audio"]
    prompt = audio.prompt(audio.render(conversation), samples)
    try:
        prefill = conversation[-1]["role"] == "assistant"
        want = served["processor"].tokenizer.apply_chat_template(
            filled, return_dict=False, continue_final_message=prefill
        )
        assert prompt.token_ids == list(want)
        assert [(g.start, g.num_tokens) for g in prompt.segments] == [
            (i + 1, 375 * math.ceil(len(c) / 480000)) for i, c in zip(_runs(want), samples, strict=True)
        ]
    finally:
        prompt.release()


def wav_samples(b64: str) -> np.ndarray:
    return soundfile.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")[0]


def _runs(ids: list[int]) -> list[int]:
    """Where each [BEGIN_AUDIO] (25) stands."""
    return [i for i, t in enumerate(ids) if t == 25]


def transcribe(s, **fields):
    deltas, summaries = [], []
    for response in s["transcribe"].Transcribe(transcription_pb2.TranscribeRequest(**fields), timeout=120):
        kind = response.WhichOneof("response")
        (deltas if kind == "delta" else summaries).append(getattr(response, kind))
    assert len(summaries) == 1
    return deltas, summaries[0]


@pytest.mark.parametrize("language", ["", "de-DE"])
def test_transcribe_equals_apply_transcription_request(served, language):
    clip = pcm_clip(2.1, seed=3)
    deltas, summary = transcribe(served, audio=content_pb2.AudioPart(data=wav(clip)), model=NAME, language=language)
    code = language.split("-")[0] or None
    inputs = served["processor"].apply_transcription_request(
        audio=clip, model_id=NAME, language=code, sampling_rate=16000, format="wav"
    )
    assert (code is None) == ("lang:" not in served["processor"].tokenizer.decode(inputs["input_ids"][0]))
    budget = TOKENS_BASE + math.ceil(TOKENS_PER_SECOND * len(clip) / 16000)
    with torch.no_grad():
        out = served["reference"].generate(**inputs, max_new_tokens=budget, do_sample=False)
    n = inputs["input_ids"].shape[1]
    want = served["processor"].tokenizer.decode(out[0, n:], skip_special_tokens=True).strip()
    assert summary.text == want and want
    assert "".join(d.text for d in deltas) == summary.text
    assert summary.language == (code or "") and summary.output_tokens == len(out[0]) - n
    nothing_left(served["server"], NAME)


def _fields(err: grpc.RpcError) -> list[str]:
    return [
        v.field for d in status_details(err) if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations
    ]


def test_bad_audio_and_requests_are_invalid_argument_and_the_server_keeps_serving(served):
    too_long = np.zeros(round((served["audio"].limits.max_seconds + 1) * 16000), np.float32)
    bad = {
        "undecodable": (b"not audio at all", "contents[0].parts[0].audio.data"),
        "too long": (encode(too_long, 16000, "FLAC"), "contents[0].parts[0].audio.data"),
    }
    for name, (data, field) in bad.items():
        parts = [content_pb2.Part(audio=content_pb2.AudioPart(data=data)), content_pb2.Part(text="hi")]
        with pytest.raises(grpc.RpcError) as info:
            generate(served, [content_pb2.Content(role="user", parts=parts)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _fields(info.value) == [field], name
    good = content_pb2.AudioPart(data=wav(pcm_clip(0.7)))
    # A conversation mistral_common refuses to write names the contents: a system turn next to audio (tokenizers
    # before v13; Voxtral's is v7).
    system = content_pb2.Content(role="system", parts=[content_pb2.Part(text="You listen closely.")])
    user = content_pb2.Content(role="user", parts=[content_pb2.Part(audio=good)])
    with pytest.raises(grpc.RpcError) as info:
        generate(served, [system, user])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _fields(info.value) == ["contents"]
    for fields, field in (({"language": "xx"}, "language"), ({"prompt": "names: Zoë"}, "prompt")):
        with pytest.raises(grpc.RpcError) as info:
            transcribe(served, audio=good, model=NAME, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _fields(info.value) == [field]
    nothing_left(served["server"], NAME)
    got, summary = generate(served, [content_pb2.Content(role="user", parts=[content_pb2.Part(audio=good)])])
    assert len(got) == STEPS and summary.finish_reason == generation_pb2.FINISH_REASON_LENGTH  # still serving
    nothing_left(served["server"], NAME)


def test_structured_output_over_the_tekken_vocabulary(served):
    """A grammar's token masks come from the Tekken vocabulary (llguidance cannot read a MistralCommonBackend as it
    reads fast tokenizers: INTERNAL before). The output is the grammar's, with audio in the prompt."""
    parts = [content_pb2.Part(audio=content_pb2.AudioPart(data=wav(pcm_clip(1.0)))), content_pb2.Part(text="Which?")]
    for fmt, check in (
        (generation_pb2.ResponseFormat(regex="[a-z]{3,5} the"), lambda t: re.fullmatch("[a-z]{3,5} the", t)),
        (generation_pb2.ResponseFormat(json_schema='{"enum": ["yes", "no"]}'), lambda t: t in ('"yes"', '"no"')),
    ):
        request = generation_pb2.GenerateRequest(
            model=NAME,
            contents=[content_pb2.Content(role="user", parts=parts)],
            sampling=sampling_pb2.SamplingConfig(temperature=0.0),
            max_output_tokens=STEPS,
            response_format=fmt,
        )
        responses = list(served["generate"].Generate(request, timeout=60))
        text = "".join(r.delta.text for r in responses if r.HasField("delta"))
        assert check(text), (fmt, text)
        assert responses[-1].summary.finish_reason == generation_pb2.FINISH_REASON_STOP
    nothing_left(served["server"], NAME)


def test_list_models_shows_audio_input(served):
    stub = model_pb2_grpc.ModelServiceStub(served["server"].channel())
    [model] = [m for m in stub.ListModels(model_pb2.ListModelsRequest()).models if m.name == NAME]
    assert model_pb2.MODALITY_AUDIO in model.input_modalities and model_pb2.MODALITY_TEXT in model.input_modalities


def test_tekken_audio_section_that_disagrees_with_the_encoder_is_refused_at_load(tmp_path):
    """25 embeddings a second in tekken.json against an encoder that gives 12.5: every prompt would be misaligned."""
    path = make_voxtral_bundle(tmp_path / "voxtral", audio={**AUDIO_SECTION, "frame_rate": 25.0})
    with pytest.raises(ValueError, match="750 audio tokens per chunk; the encoder gives 375"):
        load_audio_part(path, "cpu", torch.float32, model_key="v")


def test_mistral_text_folder_with_tekken_json_keeps_its_chat_template(tmp_path):
    """mistral_common (installed for Voxtral) makes transformers read tekken.json first, as a backend with no chat
    template; a Mistral text folder that ships it next to tokenizer.json (as the hub's do) then served its turns
    joined by newlines. Its HF tokenizer and template are what the prompt is built from."""
    path = make_checkpoint(tmp_path / "mistral", family="mistral")
    write_tekken(path / "tekken.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, mistral_format=False)
    messages = [{"role": "user", "content": "the thing"}]
    want = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    with ServerThread([ModelSpec(path=path, name="mistral")], EngineOptions(kv_cache_gib=0.01)) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        request = generation_pb2.GenerateRequest(
            model="mistral", contents=[content_pb2.Content(role="user", parts=[content_pb2.Part(text="the thing")])],
            max_output_tokens=1,
        )  # fmt: skip
        summary = list(stub.Generate(request, timeout=60))[-1].summary
    assert summary.usage.prompt_tokens == len(want)
