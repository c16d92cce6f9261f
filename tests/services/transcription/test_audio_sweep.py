"""Audio input on configs and inputs users bring, against transformers (WhisperForConditionalGeneration.generate) and
ffmpeg's conventions, through a real gRPC server on tiny random Whispers (tests/support/whisper_checkpoints.py):
- a Whisper whose encoder window is shorter than 30 s (max_source_positions 100, chunk_length 2: tiny configs);
  a window that disagrees with its feature extractor is refused at load naming max_source_positions;
- a fine-tuned checkpoint's forced language (generation_config forced_decoder_ids, no lang_to_id) is its default,
  and a begin_suppress_tokens id past the vocabulary is ignored (as transformers) instead of failing the load; a
  checkpoint without generation_config.json takes those settings from config.json, as transformers does;
- a prompt holding a special token's text is INVALID_ARGUMENT on `prompt` (`config.prompt` when streaming); a long
  one is cut to half a small decoder context (max_target_positions 64), as openai-whisper cuts it;
- language as "en" / "EN" / "english" / "en-US" (equal), a non-ASCII prompt, a released .en checkpoint's config;
- multi-channel WAV mixed to mono as ffmpeg mixes it (LFE left out), WAVE_FORMAT_EXTENSIBLE masks, extra chunks,
  odd-length data, a truncated data chunk (decoded, logged).
"""

from __future__ import annotations

import json
import logging
import struct

import grpc
import numpy as np
import pytest
import torch
from support.audio_checkpoints import chirp, encode, noise, tone
from support.grpc_errors import violated_fields
from support.service_harness import ServerThread
from support.whisper_checkpoints import N_MELS, SPECIALS, make_whisper, whisper_tokenizer
from transformers import GenerationMixin, WhisperFeatureExtractor, WhisperForConditionalGeneration

from omnivox.codecs.audio_input import content_key, decode_audio
from omnivox.codecs.downmix import mono_weights
from omnivox.services.parts.bundle import load_bundle
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, transcription_pb2, transcription_pb2_grpc

# Channel masks (WAVE_FORMAT_EXTENSIBLE)
FL, FR, FC, LFE, BL, BR, SL, SR = 0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x200, 0x400


def _edit_generation_config(path, drop=(), **values) -> None:
    file = path / "generation_config.json"
    gen = json.loads(file.read_text())
    for key in drop:
        gen.pop(key, None)
    file.write_text(json.dumps({**gen, **values}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    ids = {t: i for t, i in zip(SPECIALS, whisper_tokenizer().convert_tokens_to_ids(SPECIALS), strict=True)}
    short = make_whisper(root / "short-window", max_source_positions=100)  # 2 s: 200 mel frames
    WhisperFeatureExtractor(feature_size=N_MELS, chunk_length=2).save_pretrained(short)
    forced = make_whisper(root / "forced-fr", seed=4)  # a fine-tuned checkpoint's older generation config
    _edit_generation_config(
        forced, drop=("lang_to_id", "task_to_id", "is_multilingual"),
        forced_decoder_ids=[[1, ids["<|fr|>"]], [2, ids["<|transcribe|>"]], [3, ids["<|notimestamps|>"]]],
        # An id past the vocabulary (a trimmed-vocabulary model's stale list): transformers ignores it; the
        # first-step mask raised IndexError and the model failed to load.
        begin_suppress_tokens=[whisper_tokenizer().convert_tokens_to_ids("Ġ"), ids["<|endoftext|>"], 10**6],
    )  # fmt: skip
    small_ctx = make_whisper(root / "ctx-64", seed=6, max_target_positions=64)
    # A released .en checkpoint's generation config: no lang_to_id / task_to_id, <|notimestamps|> forced at 1; its
    # vocabulary keeps the language, task and timestamp tokens (51864 in the real ones).
    # Whisper's own codes where BCP-47 differs: its four language tokens renamed <|en|>, <|jw|>, <|no|>, <|he|>.
    codes = make_whisper(root / "codes", seed=9)
    _edit_generation_config(codes, lang_to_id={f"<|{c}|>": ids[f"<|{o}|>"] for c, o in
                                               (("en", "en"), ("jw", "de"), ("no", "fr"), ("he", "es"))})  # fmt: skip
    english = make_whisper(root / "tiny-en", seed=7)
    _edit_generation_config(
        english, drop=("lang_to_id", "task_to_id"), is_multilingual=False,
        forced_decoder_ids=[[1, ids["<|notimestamps|>"]]],
    )  # fmt: skip
    # Saved before generation_config.json existed: suppression and the forced prompt live in config.json.
    legacy = make_whisper(root / "legacy", seed=8)
    gen = json.loads((legacy / "generation_config.json").read_text())
    (legacy / "generation_config.json").unlink()
    config = json.loads((legacy / "config.json").read_text())
    config.update(
        suppress_tokens=gen["suppress_tokens"] + list(range(100, 2000)),
        begin_suppress_tokens=gen["begin_suppress_tokens"],
        forced_decoder_ids=[[1, ids["<|de|>"]], [2, ids["<|transcribe|>"]], [3, ids["<|notimestamps|>"]]],
    )
    (legacy / "config.json").write_text(json.dumps(config))
    specs = [ModelSpec(path=short, name="short"), ModelSpec(path=forced, name="forced"),
             ModelSpec(path=small_ctx, name="ctx64"), ModelSpec(path=english, name="en"),
             ModelSpec(path=legacy, name="legacy"), ModelSpec(path=codes, name="codes")]  # fmt: skip
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.02)) as server:
        yield {
            "server": server,
            "stub": transcription_pb2_grpc.TranscriptionServiceStub(server.channel()),
            "paths": {
                "short": short,
                "forced": forced,
                "ctx64": small_ctx,
                "en": english,
                "legacy": legacy,
                "codes": codes,
            },
            "root": root,
        }


def _hf(served, name: str):
    path = served["paths"][name]
    return WhisperForConditionalGeneration.from_pretrained(path).eval(), WhisperFeatureExtractor.from_pretrained(path)


def _hf_text(served, name: str, clip: np.ndarray, **generate) -> str:
    """transformers' own Whisper generate (greedy, its generation config's prompt and suppression), as text."""
    hf, fe = _hf(served, name)
    with torch.no_grad():
        out = hf.generate(fe(clip, sampling_rate=16000, return_tensors="pt").input_features, **generate)
    part = served["server"].registry.lookup(name).bundle.whisper
    text = [t for t in out[0].tolist() if part.vocab.is_text(t)]  # timestamps are plain added tokens: not text
    return part.tokenizer.decode(text, skip_special_tokens=True).strip()


def _transcribe(served, model: str, data: bytes, **fields) -> transcription_pb2.TranscriptionSummary:
    fields.setdefault("temperature", 0.0)  # greedy, no fallback: transformers' generate is the reference
    request = transcription_pb2.TranscribeRequest(model=model, audio=content_pb2.AudioPart(data=data), **fields)
    responses = list(served["stub"].Transcribe(request, timeout=120))
    assert responses[-1].HasField("summary")
    return responses[-1].summary


def _wav(clip: np.ndarray) -> bytes:
    return encode(clip, 16000, "WAV", "FLOAT")


# --- Whisper configs -------------------------------------------------------------------------------------------------
def test_short_encoder_window_transcribes_window_by_window(served):
    """max_source_positions 100 (2 s windows): audio past 2 s was cut into 30 s windows and crashed the feature
    extractor (INTERNAL); now it goes in windows of at most 2 s, one segment each, the first equal to transformers' generate on it."""
    clip = chirp(3.5)
    summary = _transcribe(served, "short", _wav(clip), language="en")
    spans = [(s.start_offset.ToNanoseconds() / 1e9, s.end_offset.ToNanoseconds() / 1e9) for s in summary.segments]
    assert len(spans) >= 2 and spans[0][0] == 0 and spans[-1][1] == 3.5
    assert all(0 < b - a <= 2.0 for a, b in spans)
    assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    first_end = round(spans[0][1] * 16000)
    expected = _hf_text(served, "short", clip[:first_end], language="en", max_new_tokens=224)
    assert summary.segments[0].text == expected


def test_window_disagreeing_with_the_extractor_is_refused_at_load(served, tmp_path):
    path = make_whisper(tmp_path / "mismatch", max_source_positions=100)  # extractor: 30 s = 3000 frames
    with pytest.raises(ValueError, match="max_source_positions"):
        load_bundle(ModelSpec(path=path, name="mismatch"), EngineOptions(kv_cache_gib=0.01, device="cpu"))


def test_forced_language_of_a_fine_tuned_checkpoint_is_its_default(served):
    """forced_decoder_ids (1, <|fr|>) with no language asked: transformers transcribes French; we detected."""
    clip = noise(2.0, seed=11)
    summary = _transcribe(served, "forced", _wav(clip))
    assert summary.language == "fr"
    assert summary.text == _hf_text(served, "forced", clip, max_new_tokens=224)


def test_prompt_is_cut_to_half_a_small_decoder_context(served):
    """max_target_positions 64: the previous text / prompt keeps its last 64 // 2 - 1 = 31 tokens and a window
    writes at most what is left of 64 // 2 (openai-whisper's shares; 223 and 224 at 448). Fixed at 223, a 60-word
    prompt was INVALID_ARGUMENT on `audio` ("172 tokens do not fit the context of 64 tokens")."""
    clip = chirp(1.5)
    prompt = " ".join(f"word{i}" for i in range(60))
    summary = _transcribe(served, "ctx64", _wav(clip), language="en", prompt=prompt)
    part = served["server"].registry.lookup("ctx64").bundle.whisper
    v = part.vocab
    decoder_prompt = [v.sot_prev, *part.prompt_tokens(prompt)[-31:], v.sot, v.languages["en"], v.transcribe,
                      v.no_timestamps]  # fmt: skip
    hf, fe = _hf(served, "ctx64")
    with torch.no_grad():
        out = GenerationMixin.generate(
            hf, input_features=fe(clip, sampling_rate=16000, return_tensors="pt").input_features,
            decoder_input_ids=torch.tensor([decoder_prompt]), max_new_tokens=64 - len(decoder_prompt), do_sample=False,
        )[0, len(decoder_prompt) :].tolist()  # fmt: skip
    out = out[: out.index(v.eot)] if v.eot in out else out
    assert summary.text == part.tokenizer.decode([t for t in out if v.is_text(t)], skip_special_tokens=True).strip()


@pytest.mark.parametrize("seed", [3, 4])
def test_a_checkpoint_without_generation_config_reads_config_json(served, seed):
    """suppress_tokens, begin_suppress_tokens and forced_decoder_ids in config.json (older checkpoints): transformers
    reads them there; we ignored them (no suppression, the language detected instead of the forced one)."""
    clip = noise(2.0, seed=seed)
    summary = _transcribe(served, "legacy", _wav(clip))
    assert summary.language == "de"
    assert summary.text == _hf_text(served, "legacy", clip, max_new_tokens=224)


def test_english_only_checkpoint_equals_transformers(served):
    """Equal before (kept as a regression case): [<|startoftranscript|>, <|notimestamps|>], no language token."""
    clip = noise(1.5, seed=12)
    summary = _transcribe(served, "en", _wav(clip))
    assert summary.text == _hf_text(served, "en", clip, max_new_tokens=224)
    assert _transcribe(served, "en", _wav(clip), language="English").text == summary.text
    with pytest.raises(grpc.RpcError) as info:
        _transcribe(served, "en", _wav(clip), language="de")
    assert violated_fields(info.value) == ["language"]


@pytest.mark.parametrize(("bcp47", "whisper"), [("jv", "jw"), ("nb-NO", "no"), ("iw", "he"), ("<|jw|>", "jw")])
def test_bcp47_codes_whisper_spells_otherwise(served, bcp47, whisper):
    """Javanese is jv in BCP-47 and <|jw|> in Whisper (Norwegian Bokmål nb / <|no|>, Hebrew's old iw / <|he|>): the
    request's BCP-47 code was refused as unknown. A token's own text is taken, as transformers takes it."""
    clip = tone(1.0, freq=500.0)
    summary = _transcribe(served, "codes", _wav(clip), language=bcp47)
    assert summary.language == whisper
    assert summary.text == _hf_text(served, "codes", clip, language=whisper, max_new_tokens=224)


@pytest.mark.parametrize("language", ["EN", "english", "en-US", "English"])
def test_language_spellings_equal_the_code(served, language):
    clip = tone(1.0, freq=300.0)
    expected = _transcribe(served, "short", _wav(clip), language="en")
    got = _transcribe(served, "short", _wav(clip), language=language)
    assert (got.text, got.language) == (expected.text, "en")


def test_prompt_with_a_special_token_is_refused(served):
    clip = tone(1.0)
    for prompt in ("<|de|>", "names: <|endoftext|> Zoë"):
        with pytest.raises(grpc.RpcError) as info:
            _transcribe(served, "short", _wav(clip), language="en", prompt=prompt)
        assert violated_fields(info.value) == ["prompt"]
    summary = _transcribe(served, "short", _wav(clip), language="en", prompt="Zürich, 東京, Ελλάδα")
    assert summary.language == "en"  # non-ASCII text is a prompt like any other


def test_streaming_prompt_with_a_special_token_is_refused(served):
    config = transcription_pb2.StreamingTranscriptionConfig(
        model="short", sample_rate_hertz=16000, prompt="<|startoftranscript|>"
    )
    requests = iter([transcription_pb2.StreamingTranscribeRequest(config=config)])
    with pytest.raises(grpc.RpcError) as info:
        list(served["stub"].StreamingTranscribe(requests, timeout=60))
    assert "config.prompt" in violated_fields(info.value)


# --- decoding inputs -------------------------------------------------------------------------------------------------
def _chunk(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload + b"\0" * (len(payload) % 2)


def _wav_bytes(pcm: np.ndarray, mask: int | None = None, before=(), after=(), data_size=None, tail=b"") -> bytes:
    """16-bit WAV of pcm [frames, channels] int16; `mask`: WAVE_FORMAT_EXTENSIBLE with that channel mask; `tail`:
    bytes after the samples inside the data chunk."""
    channels = pcm.shape[1]
    head = (0xFFFE if mask is not None else 1, channels, 16000, 32000 * channels, 2 * channels, 16)
    fmt = struct.pack("<HHIIHH", *head)
    if mask is not None:  # cbSize, valid bits, mask, KSDATAFORMAT_SUBTYPE_PCM
        fmt += struct.pack("<HHI", 22, 16, mask) + bytes.fromhex("0100000000001000800000aa00389b71")
    raw = pcm.astype("<i2").tobytes() + tail
    data = b"data" + struct.pack("<I", len(raw) if data_size is None else data_size) + raw + b"\0" * (len(raw) % 2)
    body = b"WAVE" + _chunk(b"fmt ", fmt) + b"".join(before) + data + b"".join(after)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _surround(frames: int = 16000) -> np.ndarray:
    """[frames, 6] int16: speech-band chirp in the fronts and centre, a loud 40 Hz rumble in the LFE (4th)."""
    voice = chirp(frames / 16000, f0=200.0, f1=3000.0, amp=0.3)
    rumble = tone(frames / 16000, freq=40.0, amp=0.9)
    pcm = np.stack([voice, voice * 0.8, voice, rumble, voice * 0.3, voice * 0.3], axis=1)
    return np.round(pcm * 32767).astype(np.int16)


def test_surround_wav_leaves_the_lfe_out_as_ffmpeg():
    pcm = _surround()
    x = pcm.astype(np.float32) / 32768.0
    # libswresample's mono row for 5.1 (defaults: -3 dB centre / surround, LFE 0), normalised for s16 output.
    row = np.array([0.5**0.5, 0.5**0.5, 1.0, 0.0, 0.5, 0.5])
    expected = x @ (row / row.sum())
    plain = decode_audio(_wav_bytes(pcm)).samples  # no mask: ffmpeg guesses 5.1 for 6 channels
    masked = decode_audio(_wav_bytes(pcm, mask=FL | FR | FC | LFE | SL | SR)).samples
    np.testing.assert_allclose(plain, expected, atol=1e-6)
    np.testing.assert_allclose(masked, expected, atol=1e-6)
    assert not np.allclose(plain, x.mean(axis=1), atol=1e-3)  # the old mean carried 1/6 of the rumble


def test_channel_masks_and_counts():
    stereo = mono_weights(2, "WAV")
    assert stereo is None  # the plain mean, as ffmpeg's s16 downmix of stereo
    np.testing.assert_allclose(mono_weights(2, "WAV", FL | FR), [0.5, 0.5])
    quad = mono_weights(4, "WAV", FL | FR | BL | BR)  # sqrt(1/2), sqrt(1/2), 1/2, 1/2 normalised
    np.testing.assert_allclose(quad, np.array([0.5**0.5, 0.5**0.5, 0.5, 0.5]) / (2**0.5 + 1), rtol=1e-6)
    assert mono_weights(4, "WAV") is None and mono_weights(3, "WAV", FL | FR) is None  # unknown: the mean
    ogg = mono_weights(6, "OGG")  # Vorbis order: FL FC FR BL BR LFE
    assert ogg[-1] == 0 and ogg[1] == ogg.max()


def test_wav_extra_chunks_odd_data_and_truncation(caplog):
    mono = np.round(chirp(1.0) * 32767).astype(np.int16)[:, None]
    plain = decode_audio(_wav_bytes(mono)).samples
    info = _chunk(b"LIST", b"INFOISFT\x05\x00\x00\x00omni\x00\x00")
    for variant in (
        _wav_bytes(mono, before=[info, _chunk(b"fact", struct.pack("<I", len(mono)))]),
        _wav_bytes(mono, after=[info]),
        _wav_bytes(mono, mask=FC),
        _wav_bytes(mono, data_size=0xFFFFFFFF),  # streaming headers: "to the end of the file", not truncated
        _wav_bytes(mono, data_size=0x7FFFFFFF),  # (arecord's)
        _wav_bytes(mono, data_size=0),
    ):
        np.testing.assert_array_equal(decode_audio(variant).samples, plain)
    assert "truncated" not in caplog.text
    odd = decode_audio(_wav_bytes(mono, tail=b"\x01")).samples  # an odd-length data chunk: the half sample dropped
    np.testing.assert_array_equal(odd, plain)
    with caplog.at_level(logging.WARNING, logger="omnivox.codecs.audio_input"):
        cut = decode_audio(_wav_bytes(mono)[:-8000])  # the upload stopped 4000 samples early
    assert len(cut.samples) == len(mono) - 4000
    np.testing.assert_array_equal(cut.samples, plain[: len(mono) - 4000])
    assert "truncated" in caplog.text and "32000 bytes" in caplog.text


def test_surround_through_transcribe_equals_its_mono_mix(served):
    pcm = _surround(24000)
    mixed = decode_audio(_wav_bytes(pcm)).samples
    a = _transcribe(served, "short", _wav_bytes(pcm), language="en")
    b = _transcribe(served, "short", _wav(mixed), language="en")
    assert a.text == b.text
    assert content_key(mixed, 16000, "s", "m") == content_key(decode_audio(_wav(mixed)).samples, 16000, "s", "m")


def test_gsm610_wav_is_read_forwards(served):
    """GSM 6.10 in WAV (telephony, voicemail): libsndfile reads it only forwards and soundfile's read-all refused it
    ("frames must be specified for non-seekable files"), so Transcribe said the audio could not be decoded."""
    gsm = encode(chirp(1.5, rate=8000, f1=3500.0), 8000, "WAV", "GSM610")
    decoded = decode_audio(gsm)
    assert decoded.source_rate == 8000 and 24000 <= len(decoded.samples) <= 24000 + 640  # GSM blocks of 320 samples
    a = _transcribe(served, "short", gsm, language="en")
    b = _transcribe(served, "short", _wav(decoded.samples), language="en")
    assert a.text == b.text
