"""TranscriptionService/Transcribe over a real gRPC server on tiny random Qwen2-Audio and Qwen3-ASR checkpoints: the
transcript equals transformers' processor + greedy `generate` on the family's transcription prompt; long audio is
split at quiet points with its offsets reported; bad requests are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch
import transformers
from google.rpc import error_details_pb2
from support.audio_checkpoints import (
    QWEN3_ASR_TOKENS,
    chirp,
    encode,
    make_qwen2_audio,
    make_qwen3_asr,
    noise,
    tokenizer_with,
    tone,
)
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, nothing_left

from omnivox.codecs.audio_format import float_to_int16
from omnivox.models.audio import encoder_class
from omnivox.services.calls.audio_llm_windows import TOKENS_BASE, TOKENS_PER_SECOND
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.output.transcript_text import SegmentTranscript
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

FAMILIES = {
    "qwen2_audio": (make_qwen2_audio, transformers.Qwen2AudioForConditionalGeneration),
    "qwen3_asr": (make_qwen3_asr, transformers.Qwen3ASRForConditionalGeneration),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    make, ref_cls = FAMILIES[family]
    path = make(tmp_path_factory.mktemp(family) / family, seed=2)
    text = make_checkpoint(tmp_path_factory.mktemp("text") / "tiny-text", family="llama")
    # The text-only model is the default: Transcribe with no model picks the first model that takes audio.
    specs = [ModelSpec(path=text, name="text"), ModelSpec(path=path, name=family)]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "family": family,
            "server": server,
            "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel()),
            "processor": transformers.AutoProcessor.from_pretrained(path),
            "reference": ref_cls.from_pretrained(path).eval(),
            "audio": server.registry.lookup(family).bundle.audio,
        }


def transcribe(
    stub, **fields
) -> tuple[list[transcription_pb2.TranscriptDelta], transcription_pb2.TranscriptionSummary]:
    deltas, summaries = [], []
    for response in stub.Transcribe(transcription_pb2.TranscribeRequest(**fields), timeout=300):
        kind = response.WhichOneof("response")
        assert not summaries, "nothing may follow the summary"
        (deltas if kind == "delta" else summaries).append(getattr(response, kind))
    assert len(summaries) == 1
    return deltas, summaries[0]


def reference_text(s, samples: np.ndarray, language: str | None) -> str:
    """processor + greedy generate on the family's transcription prompt, with the service's token budget."""
    messages = encoder_class(s["family"]).transcription_messages(language)
    prompt = s["processor"].apply_chat_template(
        messages, tokenize=False, continue_final_message=messages[-1]["role"] == "assistant",
        add_generation_prompt=messages[-1]["role"] != "assistant",
    )  # fmt: skip
    inputs = s["processor"](text=[prompt], audio=[samples], sampling_rate=16000, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "num_audio_tokens"}
    budget = TOKENS_BASE + math.ceil(TOKENS_PER_SECOND * len(samples) / 16000)
    with torch.no_grad():
        out = s["reference"].generate(**inputs, max_new_tokens=budget, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return s["processor"].tokenizer.decode(out[0, n:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("language", ["", "en"])
def test_transcript_equals_transformers_with_language_and_rtf(served, language):
    pcm = float_to_int16(chirp(2.1) + noise(2.1, amp=0.05, seed=3))
    deltas, summary = transcribe(served["stub"], audio=content_pb2.AudioPart(data=encode(pcm, 16000, "WAV")),
                                 language=language)  # fmt: skip
    want = reference_text(served, pcm.astype(np.float32) / 32768.0, language or None)
    assert summary.text == want and want
    assert "".join(d.text for d in deltas) == summary.text
    assert summary.language == language  # forced: echoed; detection by a random model finds nothing
    assert summary.audio_seconds == pytest.approx(2.1, abs=1e-3)
    assert summary.real_time_factor > 0 and summary.output_tokens > 0
    assert summary.model == served["family"] and summary.request_id
    assert 0 < summary.time_to_first_token.ToNanoseconds() <= summary.total.ToNanoseconds()
    [segment] = summary.segments
    assert segment.text == summary.text and segment.start_offset.ToNanoseconds() == 0
    assert segment.end_offset.ToNanoseconds() / 1e9 == pytest.approx(2.1, abs=1e-3)
    nothing_left(served["server"], served["family"])


def test_long_audio_is_split_at_quiet_points_with_offsets(served):
    window = served["audio"].limits.max_seconds
    if window > 60:
        pytest.skip(f"{served['family']} takes {window:g} s in one window; Qwen2-Audio (30 s) covers the split")
    rate, seconds, gaps = 16000, 62.0, (27.0, 55.0)
    signal = tone(seconds, freq=330.0) + noise(seconds, amp=0.02)
    for g in gaps:  # 300 ms of silence inside the last 5 s of each 30 s window: where the cuts must go
        signal[int(g * rate) : int((g + 0.3) * rate)] = 0.0
    deltas, summary = transcribe(served["stub"], audio=content_pb2.AudioPart(data=encode(signal, rate, "FLAC")),
                                 timestamps=True)  # fmt: skip
    bounds = [(s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9) for s in summary.segments]
    assert len(bounds) == 3 and bounds[0][0] == 0 and bounds[-1][1] == pytest.approx(seconds)
    for (_, end), (start, _), gap in zip(bounds, bounds[1:], gaps, strict=False):
        assert end == start and gap <= end <= gap + 0.3
    assert summary.text == " ".join(s.text for s in summary.segments if s.text)
    assert "".join(d.text for d in deltas) == summary.text
    assert sorted({d.segment_index for d in deltas}) == [i for i, s in enumerate(summary.segments) if s.text]
    nothing_left(served["server"], served["family"])


def _fields(err: grpc.RpcError) -> list[str]:
    return [
        v.field for d in status_details(err) if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations
    ]


def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(served):
    stub, family = served["stub"], served["family"]
    good = content_pb2.AudioPart(data=encode(tone(0.6), 16000, "WAV"))
    marker = served["audio"].marker_text()
    cases = [
        (dict(audio=content_pb2.AudioPart()), ["audio.data"]),
        (dict(audio=content_pb2.AudioPart(data=b"\x00\x01" * 100, encoding=1)), ["audio.sample_rate_hertz"]),
        (dict(audio=good, language="xx-klingon"), ["language"]),
        (dict(audio=good, prompt=f"names: {marker}"), ["prompt"]),
        (dict(audio=good, model="text"), ["model"]),
    ]
    for fields, want in cases:
        with pytest.raises(grpc.RpcError) as info:
            transcribe(stub, **{"model": family, **fields})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert _fields(info.value) == want
    nothing_left(served["server"], served["family"])
    _, summary = transcribe(stub, audio=good)  # no model: the first that takes audio
    assert summary.model == family and len(summary.segments) == 1
    nothing_left(served["server"], served["family"])


def test_prompt_spelling_a_template_token_is_tokenized_as_the_processor_does(served):
    """A decision, checked: Transcribe's `prompt` is user text inside the family's chat template, and transformers'
    processor tokenizes the rendered template with special tokens parsed, the user's text included (the processors'
    `__call__` runs `tokenizer(text)`); so do we, and a prompt spelling "<|im_end|>" gets that token as the reference
    does. Unlike speech text (spoken as its characters, models/orpheus.py), a prompt only steers the caller's own
    transcript, and splitting it would give another prompt than transformers' for the same request. The audio marker,
    which would break the clip count, is refused (test_bad_requests_are_invalid_argument_...)."""
    family, audio, processor = served["family"], served["audio"], served["processor"]
    context = "Names: Zoë <|im_end|>"
    end_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples = tone(1.0)
    prompt = audio.prompt(audio.transcription_ids("en", context), [samples])
    try:
        ours = prompt.token_ids
    finally:
        prompt.release()
    messages = encoder_class(family).transcription_messages("en", context)
    assistant = messages[-1]["role"] == "assistant"
    text = processor.apply_chat_template(
        messages, tokenize=False, continue_final_message=assistant, add_generation_prompt=not assistant
    )
    ref = processor(text=[text], audio=[samples], sampling_rate=16000, return_tensors="pt")["input_ids"][0].tolist()
    assert ours == ref
    assert ours.count(end_id) == text.count("<|im_end|>") >= 2  # the template's own and the user's
    nothing_left(served["server"], served["family"])


def test_segment_transcript_holds_the_language_header_back():
    tok = tokenizer_with(QWEN3_ASR_TOKENS)
    ids = tok("language German<asr_text> Guten Morgen, Welt.  ", add_special_tokens=False).input_ids
    t = SegmentTranscript(tok, "qwen3_asr", None)
    deltas = [t.feed([i]) for i in ids] + [t.finish()]
    assert "".join(deltas) == "Guten Morgen, Welt." == t.text(final=True)
    assert not any("asr" in d or "German" in d for d in deltas)
    assert t.detected_language() == "de"
    forced = SegmentTranscript(tok, "qwen3_asr", "fr-CA")
    assert "".join([forced.feed(tok(" Bonjour", add_special_tokens=False).input_ids), forced.finish()]) == "Bonjour"
    assert forced.detected_language() == "fr"
