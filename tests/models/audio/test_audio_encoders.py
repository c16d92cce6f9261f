"""Audio encoders (models/audio) against transformers on tiny random Qwen2-Audio and Qwen3-ASR checkpoints.

The reference is what each model's own forward puts into its language model: the processor expands the audio
placeholder, the model's forward runs its audio path, and a hook on the language model takes the embeddings at the
placeholder rows. Ours: `features` + one batched `encode` over every clip.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.audio_checkpoints import chirp, make_qwen2_audio, make_qwen3_asr, make_voxtral, noise, tone

from omnivox.models.audio import (
    Qwen2AudioEncoder,
    Qwen3ASRAudioEncoder,
    VoxtralAudioEncoder,
    audio_family,
    encoder_class,
    load_audio_encoder,
)
from omnivox.models.audio.transcription import (
    TranscriptionRequestError,
    language_name,
)
from omnivox.models.checkpoint import iter_checkpoint_tensors

FAMILIES = {
    "qwen2_audio": (make_qwen2_audio, transformers.Qwen2AudioForConditionalGeneration, Qwen2AudioEncoder),
    "qwen3_asr": (make_qwen3_asr, transformers.Qwen3ASRForConditionalGeneration, Qwen3ASRAudioEncoder),
}
PROMPTS = {
    "qwen2_audio": "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "qwen3_asr": "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n<|im_start|>assistant\n",
}


@pytest.fixture(scope="session")
def audio_bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audio_bundles")
    return {family: make(root / family) for family, (make, _, _) in FAMILIES.items()}


@pytest.fixture(scope="session")
def references(audio_bundles):
    return {f: FAMILIES[f][1].from_pretrained(audio_bundles[f]).eval() for f in FAMILIES}


def _clips(family: str) -> list[np.ndarray]:
    clips = [tone(1.0), chirp(2.7), noise(0.3, seed=1), tone(0.021, freq=1000.0)]
    # Qwen2-Audio: the whole 30 s window; Qwen3-ASR: 9 s (four 2 s attention windows, nine conv chunks).
    return clips + [chirp(30.0) if family == "qwen2_audio" else chirp(9.0, f0=300.0) + noise(9.0, amp=0.02)]


def _reference_embeds(family: str, path: Path, model, clip: np.ndarray) -> tuple[torch.Tensor, int]:
    """What the model's forward puts at the placeholder rows for this clip alone, and the processor's count."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    inputs = processor(text=[PROMPTS[family]], audio=[clip], sampling_rate=16000, return_tensors="pt")
    captured = {}

    def hook(_module, _args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model.model(**{k: v for k, v in inputs.items() if k != "num_audio_tokens"})
    finally:
        handle.remove()
    rows = inputs["input_ids"][0] == model.config.audio_token_id
    return captured["embeds"][0, rows], int(rows.sum())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encoder_matches_transformers_batched(family, audio_bundles, references):
    path = audio_bundles[family]
    encoder = load_audio_encoder(path)
    assert isinstance(encoder, FAMILIES[family][2]) and audio_family(path) == family
    clips = _clips(family)
    inputs = encoder.features(clips)
    ours = encoder.encode(inputs)  # every clip in one batch
    for clip, emb in zip(clips, ours, strict=True):
        ref, count = _reference_embeds(family, path, references[family], clip)
        assert encoder.num_placeholders(len(clip)) == count == emb.shape[0]
        assert emb.shape == (count, encoder.text_hidden_size)
        torch.testing.assert_close(emb, ref, atol=1e-5, rtol=1e-4)
    assert encoder.placeholder_token_id == references[family].config.audio_token_id


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encoder_batch_invariant(family, audio_bundles):
    """Clips of several requests (one `features` call each) encoded in one pass equal each clip encoded alone."""
    encoder = load_audio_encoder(audio_bundles[family])
    clips = _clips(family)[:4]
    requests = [encoder.features(clips[:1]), encoder.features(clips[1:3]), encoder.features(clips[3:])]
    together = encoder.encode(requests)
    assert len(together) == len(clips)
    for clip, emb in zip(clips, together, strict=True):
        (alone,) = encoder.encode(encoder.features([clip]))
        torch.testing.assert_close(emb, alone, atol=1e-5, rtol=1e-4)
    assert encoder.encode([]) == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expand_prompt_equals_the_processor(family, audio_bundles):
    """The chat template writes the marker once per clip; expanding it gives the processor's token ids."""
    path = audio_bundles[family]
    encoder = load_audio_encoder(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    clips = [tone(1.0), chirp(2.7)] if family == "qwen2_audio" else [chirp(2.7)]  # Qwen3-ASR: one clip per prompt
    content = [{"type": "audio", "audio": c} for c in clips] + [{"type": "text", "text": "What is it?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, str) else prompt[0]
    ids = processor.tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids.count(encoder.marker_token_id) == len(clips)
    counts = encoder.features(clips).num_tokens
    expanded, starts = encoder.expand_prompt(ids, counts)
    ref = processor(text=[prompt], audio=clips, sampling_rate=16000, return_tensors="pt")
    assert expanded == ref["input_ids"][0].tolist()
    for start, n in zip(starts, counts, strict=True):
        assert expanded[start : start + n] == [encoder.placeholder_token_id] * n
    assert encoder.expand_prompt(expanded, counts) == (expanded, starts)  # already expanded: unchanged
    with pytest.raises(ValueError, match="markers"):
        encoder.expand_prompt(ids, counts + [5])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_features_match_the_processor(family, audio_bundles):
    path = audio_bundles[family]
    encoder = load_audio_encoder(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    for clip in _clips(family)[:4]:
        ref = processor(text=[PROMPTS[family]], audio=[clip], sampling_rate=16000, return_tensors="pt")
        mask_name = "feature_attention_mask" if family == "qwen2_audio" else "input_features_mask"
        ours = encoder.features([clip]).mel
        assert ours.features.shape == ref["input_features"].shape
        torch.testing.assert_close(ours.features, ref["input_features"].float(), atol=1e-4, rtol=0)
        assert torch.equal(ours.mask, ref[mask_name].long())


HUB_TO_RUNTIME = (
    ("audio_tower.", "model.audio_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)


def _relayout(name: str, to_runtime: bool) -> str:
    for hub, runtime in HUB_TO_RUNTIME:
        src, dst = (hub, runtime) if to_runtime else (runtime, hub)
        if name.startswith(src):
            return dst + name[len(src) :]
    raise AssertionError(f"unexpected name {name}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_key_layouts_load_the_same(family, audio_bundles, tmp_path):
    """The hub's names (`audio_tower.*`, `language_model.model.*`) and transformers' runtime names
    (`model.audio_tower.*`, `model.language_model.*`, `lm_head.*`) give the same encoder and the same decoder."""
    src = audio_bundles[family]
    tensors = load_file(src / "model.safetensors")
    to_runtime = not any(k.startswith("model.audio_tower.") for k in tensors)
    other = tmp_path / "other"
    other.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    save_file({_relayout(k, to_runtime): v.contiguous() for k, v in tensors.items()}, other / "model.safetensors")
    a, b = load_audio_encoder(src), load_audio_encoder(other)
    clips = [chirp(1.5)]
    torch.testing.assert_close(a.encode(a.features(clips))[0], b.encode(b.features(clips))[0], atol=0, rtol=0)
    names_a = {n: t for n, t in iter_checkpoint_tensors(src)}
    names_b = {n: t for n, t in iter_checkpoint_tensors(other)}
    assert names_a.keys() == names_b.keys()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_part_is_a_causal_lm(family, audio_bundles, references):
    """What the engine loads from an audio-LLM folder (`iter_checkpoint_tensors`' decoder part) is exactly the
    text model: a causal LM's names, the reference's values, no audio tensor."""
    ref = references[family]
    lm = transformers.AutoModelForCausalLM.from_config(ref.config.text_config)
    expected = set(lm.state_dict().keys())
    got = dict(iter_checkpoint_tensors(audio_bundles[family]))
    assert set(got) - expected == set()
    assert expected - set(got) <= {"lm_head.weight"}  # tied embeddings save no lm_head
    lm_sd = ref.model.language_model.state_dict()
    for name, tensor in got.items():
        if name.startswith("model."):
            torch.testing.assert_close(tensor, lm_sd[name.removeprefix("model.")], atol=0, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_limits_and_placeholder_formula(family, audio_bundles):
    encoder = load_audio_encoder(audio_bundles[family])
    limits = encoder.limits
    assert encoder.num_placeholders(limits.min_samples) >= 1
    assert encoder.num_placeholders(limits.min_samples - 1) == 0 if limits.min_samples > 1 else True
    if family == "qwen2_audio":
        assert limits.max_seconds == 30 and encoder.num_placeholders(480000) == 750
        assert encoder.num_placeholders(16000) == 25
    else:
        assert encoder.num_placeholders(16000) == 13 and encoder.num_placeholders(1) == 7  # min_length: 0.5 s
    key = encoder.feature_settings()
    assert family in key and "n_mels=128" in key


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encoder_in_bfloat16_is_close(family, audio_bundles):
    path = audio_bundles[family]
    f32, bf16 = load_audio_encoder(path), load_audio_encoder(path, dtype=torch.bfloat16)
    clips = [chirp(2.0)]
    a, b = f32.encode(f32.features(clips))[0], bf16.encode(bf16.features(clips))[0]
    assert b.dtype == torch.bfloat16 and f32.feature_settings() != bf16.feature_settings()
    torch.testing.assert_close(b.float(), a, atol=0.05, rtol=0.05)


def test_voxtral_matches_get_audio_features(tmp_path):
    """Voxtral (stretch): clips over 30 s become several chunks; ours equals `get_audio_features` on the
    processor's chunked features (its own `_retrieve_input_features`), clip by clip, encoded in one batch."""
    from types import SimpleNamespace

    path = make_voxtral(tmp_path / "voxtral")
    encoder = load_audio_encoder(path)
    assert isinstance(encoder, VoxtralAudioEncoder) and audio_family(path) == "voxtral"
    ref = transformers.VoxtralForConditionalGeneration.from_pretrained(path).eval()
    fe = transformers.AutoFeatureExtractor.from_pretrained(path)
    clips = [tone(1.0), chirp(31.0) + noise(31.0, amp=0.02), noise(0.2, seed=4)]
    ours = encoder.encode(encoder.features(clips))
    kwargs = dict(sampling_rate=16000, padding=True, truncation=False, pad_to_multiple_of=480000, return_tensors="pt")
    for clip, emb in zip(clips, ours, strict=True):
        features = transformers.VoxtralProcessor._retrieve_input_features(
            SimpleNamespace(feature_extractor=fe), [clip], 3000, **kwargs
        )
        ours_mel = encoder.features([clip]).mel.features
        torch.testing.assert_close(ours_mel.reshape(128, -1, 3000).transpose(0, 1), features, atol=1e-4, rtol=0)
        with torch.no_grad():
            expected = ref.get_audio_features(features).pooler_output
        assert encoder.num_placeholders(len(clip)) == expected.shape[0] == emb.shape[0]
        torch.testing.assert_close(emb, expected, atol=1e-5, rtol=1e-4)
    assert [e.shape[0] for e in ours] == [375, 750, 375]


@pytest.mark.parametrize(("language", "context"), [(None, None), ("en-US", None), ("fr", "Noms : Zoë, Ørsted")])
def test_qwen3_asr_transcription_prompt_equals_the_processor(language, context, audio_bundles):
    processor = transformers.AutoProcessor.from_pretrained(audio_bundles["qwen3_asr"])
    messages = encoder_class("qwen3_asr").transcription_messages(language, context)
    ours = processor.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ref = processor.apply_transcription_request(
        audio=tone(1.0), language=language.split("-")[0] if language else None, prompt=context, tokenize=False
    )
    assert ours == ref[0]


def test_transcription_languages_and_parsing():
    assert language_name("en-US") == language_name("English") == "English" and language_name("yue") == "Cantonese"
    with pytest.raises(TranscriptionRequestError) as info:
        language_name("tlh")
    assert info.value.field == "language"
    assert encoder_class("qwen3_asr").parse_transcription("language German<asr_text> Guten Tag.") == (
        "de",
        "Guten Tag.",
    )
    assert encoder_class("qwen3_asr").parse_transcription("language None<asr_text>") == (None, "")
    assert encoder_class("qwen3_asr").parse_transcription(" Bonjour.", language="fr-FR") == ("fr", "Bonjour.")
    assert encoder_class("qwen2_audio").parse_transcription(" Hello there. ") == (None, "Hello there.")
    messages = encoder_class("qwen2_audio").transcription_messages("de", "Namen: Zoë")
    assert messages[0]["content"][0] == {"type": "audio"} and "German" in messages[0]["content"][1]["text"]
    with pytest.raises(TranscriptionRequestError):
        encoder_class("voxtral").transcription_messages()
