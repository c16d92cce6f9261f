"""Whisper in the service, over a real gRPC server, on a tiny random Whisper saved with its tokenizer and feature
extractor (tests/support/whisper_checkpoints.py): Transcribe equals transformers' `generate` on the same prompt (greedy, alone
and batched), language detection equals transformers' `detect_language` and encodes the audio once, long audio is
conditioned on the previous window's text, timestamps give ordered segments, cancelling frees the KV blocks and the
cross-attention state, bad requests are INVALID_ARGUMENT naming the field, and the cascade (`--asr-model`) answers a
spoken question with a text model."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from support.audio_checkpoints import chirp, encode, noise, tone
from support.checkpoints import make_checkpoint
from support.grpc_errors import violated_fields
from support.service_harness import ServerThread
from support.whisper_checkpoints import make_whisper
from transformers import GenerationMixin, WhisperFeatureExtractor, WhisperForConditionalGeneration

from omnivox.codecs.audio_split import split_at_quiet
from omnivox.services.calls.whisper import transcribe
from omnivox.services.grpc_api.server import OmnivoxServer, ServerOptions
from omnivox.services.parts.bundle import probe
from omnivox.services.parts.loading import EngineOptions, ModelLoadError, ModelSpec
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper")
    path = make_whisper(root / "tiny-whisper")
    english = make_whisper(root / "tiny-whisper-en", seed=1, multilingual=False)
    text = make_checkpoint(root / "text", family="llama", max_position_embeddings=4096)
    specs = [ModelSpec(path=text, name="text"), ModelSpec(path=path, name="tiny-whisper"),
             ModelSpec(path=english, name="tiny-whisper-en")]  # fmt: skip
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02), asr_model="tiny-whisper") as server:
        channel = server.channel()
        yield {
            "server": server,
            "stub": transcription_pb2_grpc.TranscriptionServiceStub(channel),
            "generate": generation_pb2_grpc.GenerationServiceStub(channel),
            "models": model_pb2_grpc.ModelServiceStub(channel),
            "part": server.registry.lookup("tiny-whisper").bundle.whisper,
            "hf": WhisperForConditionalGeneration.from_pretrained(path).eval(),
            "fe": WhisperFeatureExtractor.from_pretrained(path),
        }


def features(served, clip: np.ndarray) -> torch.Tensor:  # [1, n_mels, 3000], transformers' own extractor
    return served["fe"](clip, sampling_rate=16000, return_tensors="pt").input_features


def hf_generate(served, clip: np.ndarray, prompt: list[int], n: int) -> list[int]:
    """transformers' generate from `prompt` (its suppress_tokens and begin_suppress_tokens from the generation
    config, greedy), cut at end-of-text."""
    hf = served["hf"]
    with torch.no_grad():
        out = GenerationMixin.generate(
            hf, input_features=features(served, clip), decoder_input_ids=torch.tensor([prompt]), max_new_tokens=n,
            do_sample=False,
        )[0, len(prompt) :].tolist()  # fmt: skip
    eot = served["part"].vocab.eot
    return out[: out.index(eot)] if eot in out else out


def prompt_for(served, language: str) -> list[int]:
    v = served["part"].vocab
    return [v.sot, v.languages[language], v.transcribe, v.no_timestamps]


def audio_part(clip: np.ndarray) -> content_pb2.AudioPart:
    return content_pb2.AudioPart(data=encode(clip, 16000, "WAV", "FLOAT"))


def run_transcribe(served, clip: np.ndarray, **fields):
    """Greedy unless told (temperature 0: no fallback), as transformers' generate decodes by default."""
    fields.setdefault("temperature", 0.0)
    request = transcription_pb2.TranscribeRequest(model="tiny-whisper", audio=audio_part(clip), **fields)
    responses = list(served["stub"].Transcribe(request, timeout=120))
    deltas = [r.delta for r in responses if r.HasField("delta")]
    assert responses[-1].HasField("summary") and sum(r.HasField("summary") for r in responses) == 1
    return deltas, responses[-1].summary


def test_transcript_equals_transformers_generate(served):
    clip = chirp(2.0)
    deltas, summary = run_transcribe(served, clip, language="en")
    part = served["part"]
    expected = hf_generate(served, clip, prompt_for(served, "en"), 224)
    text = part.tokenizer.decode([t for t in expected if part.vocab.is_text(t)], skip_special_tokens=True).strip()
    assert summary.text == text and "".join(d.text for d in deltas) == text
    # Greedy without the fallback, nospeech unlikely: the window is kept whatever it decodes, so its text goes out
    # as its tokens come (it was one delta at the window's end)
    assert len(deltas) > 1 and len(text) > 10
    assert summary.language == "en" and summary.output_tokens == len(expected) + (len(expected) < 224)
    [segment] = summary.segments
    assert segment.start_offset.ToNanoseconds() == 0 and segment.end_offset.ToNanoseconds() == 2_000_000_000


def test_tokens_equal_transformers_alone_and_batched(served):
    server, part = served["server"], served["part"]
    a, b = chirp(1.5), noise(2.5, seed=3)
    alone = server.run(transcribe(part, a, language="en", max_tokens=32))
    assert alone.token_ids == hf_generate(served, a, prompt_for(served, "en"), 32)

    async def both():
        return await asyncio.gather(
            transcribe(part, a, language="en", max_tokens=32), transcribe(part, b, language="de", max_tokens=32)
        )

    first, second = server.run(both())
    assert first.token_ids == alone.token_ids
    assert second.token_ids == hf_generate(served, b, prompt_for(served, "de"), 32)
    translated = server.run(transcribe(part, b, language="de", task="translate", max_tokens=8))
    v = part.vocab
    assert translated.token_ids == hf_generate(served, b, [v.sot, v.languages["de"], v.translate, v.no_timestamps], 8)
    prompted = server.run(transcribe(part, a, language="en", prompt="Omnivox", max_tokens=8))
    context = [v.sot_prev, *part.tokenizer(" Omnivox", add_special_tokens=False).input_ids]
    assert prompted.token_ids == hf_generate(served, a, context + prompt_for(served, "en"), 8)


def test_language_detection_equals_transformers_and_encodes_once(served):
    server, part, hf = served["server"], served["part"], served["hf"]
    by_id = {t: c for c, t in part.vocab.languages.items()}
    for seed in range(3):
        clip = noise(1.0, amp=0.3, seed=10 + seed) + tone(1.0, freq=200.0 * (seed + 1))
        encoded = part.worker.num_encoded
        detected = server.run(transcribe(part, clip, language=None, max_tokens=4))
        assert part.worker.num_encoded == encoded + 1  # detection and transcription share one encoder pass
        with torch.no_grad():
            [lang] = hf.detect_language(input_features=features(served, clip), generation_config=hf.generation_config)
        assert detected.language == by_id[int(lang)]
        assert detected.token_ids == hf_generate(served, clip, prompt_for(served, detected.language), 4)
    _, summary = run_transcribe(served, clip)  # over gRPC: the summary names it
    assert summary.language == detected.language


def test_long_audio_windows_are_conditioned_on_the_previous_text(served):
    part, v = served["part"], served["part"].vocab
    clip = np.concatenate([chirp(20.0), noise(0.5, amp=0.01), tone(19.5, freq=300.0)])
    result = served["server"].run(transcribe(part, clip, language="en", max_tokens=8))
    (s0, e0), (s1, e1) = split_at_quiet(clip, 16000, 30.0)
    first = hf_generate(served, clip[s0:e0], prompt_for(served, "en"), 8)
    second = hf_generate(served, clip[s1:e1], [v.sot_prev, *first, *prompt_for(served, "en")], 8)
    assert result.token_ids == first + second
    assert [(a, b) for a, b, _ in result.segments] == [(s0 / 16000, e0 / 16000), (s1 / 16000, e1 / 16000)]


def test_timestamps_give_ordered_segments(served):
    clip = np.concatenate([tone(1.5), noise(1.0, amp=0.05), chirp(1.5)])
    deltas, summary = run_transcribe(served, clip, language="en", timestamps=True)
    assert "".join(d.text for d in deltas) == summary.text
    spans = [(s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9) for s in summary.segments]
    assert spans and all(0 <= a <= b <= 4.0 + 1e-9 for a, b in spans)
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    result = served["server"].run(transcribe(served["part"], clip, language="en", timestamps=True, max_tokens=32))
    tb = served["part"].vocab.timestamp_begin
    ids = result.token_ids
    assert ids[0] >= tb and ids[0] - tb <= 50  # a timestamp first, within 1.0 s
    stamps = [t for t in ids if t >= tb]
    assert all(x <= y for x, y in zip(stamps, stamps[1:], strict=False))  # never decreasing


def test_cancel_frees_kv_blocks_and_cross_state(served):
    server, part = served["server"], served["part"]
    request = transcription_pb2.TranscribeRequest(model="tiny-whisper", audio=audio_part(noise(50.0, seed=7)))
    call = served["stub"].Transcribe(request, timeout=120)
    assert next(call).HasField("delta")
    call.cancel()
    free, total = server.wait_kv_free("tiny-whisper", timeout=10.0)
    assert free == total
    engine = server.engine("tiny-whisper")
    for _ in range(100):  # the abort lands at the engine's next step
        if not engine.has_unfinished() and part.cache.total_refs() == 0:
            break
        server.run(asyncio.sleep(0.05))
    assert not engine.has_unfinished() and part.cache.total_refs() == 0
    engine.core.check_integrity()


@pytest.mark.parametrize(
    ("model", "fields", "field"),
    [
        ("tiny-whisper", {"language": "xx"}, "language"),
        ("tiny-whisper", {"task": "summarize"}, "task"),
        ("tiny-whisper-en", {"task": "translate"}, "task"),
        ("tiny-whisper-en", {"timestamps": True}, "timestamps"),
        ("tiny-whisper-en", {"language": "de"}, "language"),
    ],
)
def test_bad_requests_name_the_field(served, model, fields, field):
    request = transcription_pb2.TranscribeRequest(model=model, audio=audio_part(tone(0.5)), **fields)
    with pytest.raises(grpc.RpcError) as info:
        list(served["stub"].Transcribe(request, timeout=60))
    assert set(violated_fields(info.value)) == {field}


def test_bad_audio_and_english_only_model(served):
    with pytest.raises(grpc.RpcError) as info:
        list(served["stub"].Transcribe(transcription_pb2.TranscribeRequest(model="tiny-whisper"), timeout=60))
    assert set(violated_fields(info.value)) == {"audio.data"}
    request = transcription_pb2.TranscribeRequest(model="tiny-whisper-en", audio=audio_part(tone(0.5)), temperature=0.0)
    summary = list(served["stub"].Transcribe(request, timeout=60))[-1].summary
    assert summary.language == "en" and summary.output_tokens > 0  # as openai-whisper reports an English-only model


def test_list_models_and_generate_refusal(served):
    models = {m.name: m for m in served["models"].ListModels(model_pb2.ListModelsRequest()).models}
    whisper = models["tiny-whisper"]
    assert list(whisper.input_modalities) == [model_pb2.MODALITY_AUDIO]
    assert list(whisper.output_modalities) == [model_pb2.MODALITY_TEXT]
    assert not whisper.has_untrained_components
    ask = generation_pb2.GenerateRequest(model="tiny-whisper", contents=[content_pb2.Content(parts=[content_pb2.Part(text="hi")])])  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        list(served["generate"].Generate(ask, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cascade_answers_a_spoken_question_with_a_text_model(served):
    server, clip = served["server"], chirp(1.0)
    transcript = server.run(transcribe(served["part"], clip, language=None)).text
    sampling = sampling_pb2.SamplingConfig(temperature=0.0)

    def ask(*parts):
        request = generation_pb2.GenerateRequest(model="text", contents=[content_pb2.Content(role="user", parts=parts)],
                                                 sampling=sampling, max_output_tokens=8)  # fmt: skip
        out = list(served["generate"].Generate(request, timeout=60))
        return [t for r in out if r.HasField("delta") for t in r.delta.token_ids], out[-1].summary

    question = content_pb2.Part(text="Answer the question:")
    spoken = ask(question, content_pb2.Part(audio=audio_part(clip)))
    written = ask(question, content_pb2.Part(text=transcript))
    assert spoken[0] == written[0] and spoken[1].usage.prompt_tokens == written[1].usage.prompt_tokens
    server.registry.set_asr_model(None)  # without --asr-model: the text model refuses audio, as before
    try:
        with pytest.raises(grpc.RpcError) as info:
            ask(question, content_pb2.Part(audio=audio_part(clip)))
        assert set(violated_fields(info.value)) == {"contents[0].parts[1].audio"}
    finally:
        server.registry.set_asr_model("tiny-whisper")
    with pytest.raises(ModelLoadError, match="not a served Whisper model"):
        OmnivoxServer(server.registry, ServerOptions(asr_model="text"))


def test_probe_recognises_whisper_folders(served, tmp_path):
    from omnivox.models.ctranslate2 import WHISPER_SPEC, write_ct2

    ct2 = tmp_path / "ct2"  # a CTranslate2 folder: model.bin with the Whisper spec + tokenizer.json
    ct2.mkdir()
    write_ct2(ct2 / "model.bin", WHISPER_SPEC, {"x": torch.zeros(1)})
    (ct2 / "tokenizer.json").write_text("{}")
    (ct2 / "config.json").write_text("{}")
    for spec in (ModelSpec(path=ct2), ModelSpec(path=served["server"].registry.lookup("tiny-whisper").source)):
        manifest = probe(spec)
        assert "whisper" in manifest.parts
        assert manifest.input_modalities == {"audio"} and manifest.output_modalities == {"text"}
    embedded = probe(ModelSpec(path=None, asr=True))
    assert (
        "whisper" in embedded.parts and embedded.embedded.name == "whisper-base" and not embedded.untrained_components
    )


def test_timestamp_rules_equal_transformers_processor():
    """TimestampRules (mask + adjust_logits) bans what WhisperTimeStampLogitsProcessor bans, on text, end-of-text
    and timestamp ids, along random sequences that follow the rules: with random logits (its probability rule on) and
    with logits where text always wins (the mask rules alone)."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    from omnivox.services.processing.whisper_rules import TimestampRules, WhisperVocab

    eot, notimestamps, vocab_size = 50, 59, 160  # Whisper's layout, small: text 0-49, specials 50-59, 100 timestamps
    vocab = WhisperVocab(vocab_size, eot, 51, 57, 55, 54, notimestamps, {"en": 52, "de": 53}, (), (), 50)
    rules = TimestampRules(vocab)
    config = GenerationConfig(eos_token_id=eot, no_timestamps_token_id=notimestamps, max_initial_timestamp_index=50)
    prompt = [51, 52, 55]
    reference = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))
    compared = [*range(eot + 1), *range(notimestamps + 1, vocab_size)]
    rng = np.random.default_rng(0)
    forced = 0
    for walk in range(40):
        seq: list[int] = []
        for _ in range(12):
            logits = torch.tensor(rng.normal(0, 3, vocab_size), dtype=torch.float32)
            if walk % 2:  # text always likelier than all timestamps together: the mask rules alone decide
                logits[:eot] += 20
            logits[eot + 1 : notimestamps + 1] = float("-inf")  # the specials between (a checkpoint suppresses them)
            banned = reference(torch.tensor([prompt + seq]), logits[None].clone())[0].isinf()
            ours = logits.masked_fill(~rules.allowed(seq), float("-inf"))
            rules.adjust_logits(ours, seq)
            assert torch.equal(ours.isinf()[compared], banned[compared]), seq
            forced += bool(rules.allowed(seq)[:eot].any()) and bool(ours[:eot].isinf().all())  # the rule fired
            options = [i for i in compared if not ours[i].isinf() and i != eot]
            if not options:
                break
            seq.append(int(rng.choice(options)))
    assert forced > 5


def test_timestamp_segments_split_at_pairs_and_stay_inside_the_audio():
    from omnivox.services.processing.whisper_rules import WhisperVocab, segment_seconds, timestamp_segments

    vocab = WhisperVocab(160, 50, 51, 57, 55, 54, 59, {"en": 52}, (), (), 50)
    t = lambda step: 60 + step  # noqa: E731  the timestamp token of step (0.02 s each)
    # Two pairs, then text without its closing timestamp: cut after the second pair, the next window starts there.
    pieces, used, next_step = timestamp_segments([t(0), 1, 2, t(10), t(10), 3, t(20), t(20), 4, 5], vocab)
    assert pieces == [(0, 10, [1, 2]), (10, 20, [3])] and used == 7 and next_step == 20
    # Ending on a lone timestamp: everything used, the next window after this one.
    pieces, used, next_step = timestamp_segments([t(0), 1, t(10), t(10), 2, t(30)], vocab)
    assert pieces == [(0, 10, [1]), (10, 30, [2])] and used == 6 and next_step is None
    # No pair: one segment from the window's start to the last timestamp.
    assert timestamp_segments([t(0), 1, 2], vocab) == ([(0, -1, [1, 2])], 3, None)
    assert timestamp_segments([t(5), 1, t(25)], vocab)[0] == [(0, 25, [1])]
    # A pair past the end of a 0.3 s clip (the window is padded to 30 s): clamped, start <= end.
    assert segment_seconds(40, 50, 0.0, 0.3) == (0.3, 0.3)
    assert segment_seconds(5, 10, 30.0, 60.0) == (30.1, 30.2) and segment_seconds(5, -1, 30.0, 45.0) == (30.1, 45.0)


def test_adjust_logits_hook_applies_per_request_and_a_failing_one_fails_only_its_request(tmp_path):
    from support.engines import tiny_engine

    from omnivox.engine import SamplingParams

    class Only7:
        def allowed(self, output_token_ids):
            return None

        def adjust_logits(self, logits, output_token_ids):
            logits[:7] = float("-inf")
            logits[8:] = float("-inf")

    class Broken(Only7):
        def adjust_logits(self, logits, output_token_ids):
            raise RuntimeError("broken constraint")

    engine = tiny_engine(make_checkpoint(tmp_path / "text", family="llama"))
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True) for _ in range(3)]
    params[0].constraint_factory, params[1].constraint_factory = Only7, Broken
    forced, broken, free = engine.generate([[1, 2, 3]] * 3, params)
    assert forced.token_ids == [7] * 4 and broken.finish_reason == "error" and len(free.token_ids) == 4
    engine.core.check_integrity()


def test_cancelling_the_transcribe_task_frees_everything(served):
    """What StreamingTranscribe relies on: cancelling the coroutine mid-detection or mid-window releases it all."""
    server, part = served["server"], served["part"]
    engine = server.engine("tiny-whisper")

    async def cancel_after(delay: float) -> None:
        task = asyncio.ensure_future(transcribe(part, noise(45.0, seed=9), language=None))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for delay in (0.0, 0.05, 0.5):
        server.run(cancel_after(delay))
        for _ in range(100):  # the abort lands at the engine's next step
            if not engine.has_unfinished() and part.cache.total_refs() == 0:
                break
            server.run(asyncio.sleep(0.05))
        assert not engine.has_unfinished() and part.cache.total_refs() == 0, delay
        free, total = server.wait_kv_free("tiny-whisper")
        assert free == total
    engine.core.check_integrity()


def test_no_speech_probability_equals_transformers_and_silence_is_skipped(served, monkeypatch):
    import omnivox.services.calls.whisper_fallback as whisper_module

    server, part, hf = served["server"], served["part"], served["hf"]
    clip = chirp(1.0)
    result = server.run(transcribe(part, clip, language="en", max_tokens=8))
    with torch.no_grad():  # openai-whisper reads it at <|startoftranscript|>, before any suppression
        sot = torch.tensor([[part.vocab.sot]])
        logits = hf(input_features=features(served, clip), decoder_input_ids=sot).logits[0, -1]
    assert result.no_speech_probs == pytest.approx([float(logits.softmax(-1)[part.vocab.no_speech])], abs=1e-6)
    deltas: list[str] = []

    async def on_text(delta: str, index: int) -> None:
        deltas.append(delta)

    monkeypatch.setattr(whisper_module, "NO_SPEECH_THRESHOLD", -1.0)  # every window may be silence
    monkeypatch.setattr(whisper_module, "LOGPROB_THRESHOLD", 1.0)  # and its text is always unlikely: skipped
    for timestamps in (False, True):
        silent = server.run(transcribe(part, clip, language="en", timestamps=timestamps, on_text=on_text))
        assert silent.text == "" and deltas == [] and silent.token_ids == []
        assert silent.segments == ([] if timestamps else [(0.0, 1.0, "")])
    monkeypatch.setattr(whisper_module, "LOGPROB_THRESHOLD", -1e9)  # likely enough: kept, its text sent at the end
    kept = server.run(transcribe(part, clip, language="en", max_tokens=8, on_text=on_text))
    assert kept.token_ids == result.token_ids and "".join(deltas) == kept.text == result.text
