"""Our log-mel features (codecs/mel.py) against transformers' WhisperFeatureExtractor and Qwen3ASRFeatureExtractor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from support.audio_checkpoints import chirp, noise, tone
from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

from omnivox.codecs.mel import LogMelExtractor, MelSettings

LENGTHS = [1, 161, 400, 12345, 16160, 88888, 480000]


KINDS = [
    lambda s: tone(s, freq=440.0),
    lambda s: chirp(s),
    lambda s: noise(s, seed=3),
    lambda s: tone(s, freq=3000.0, amp=0.9) + noise(s, amp=0.01),
]


def _signals(lengths: list[int]) -> list[np.ndarray]:
    """Every kind at every length (a chirp sweeping the band crosses every filter edge: float32 filters failed it)."""
    return [kind(n / 16000)[:n] for n in lengths for kind in KINDS]


@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_features_batched(n_mels):
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    clips = _signals(LENGTHS)
    ref = fe(clips, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    ours = LogMelExtractor(MelSettings.from_feature_extractor(fe)).extract([torch.from_numpy(c) for c in clips])
    assert ours.features.shape == ref["input_features"].shape == (len(clips), n_mels, 3000)
    torch.testing.assert_close(ours.features, ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(ours.mask, ref["attention_mask"].long())
    assert ours.valid_frames == ref["attention_mask"].sum(-1).tolist()


@pytest.mark.filterwarnings("ignore:At least one mel")  # 8 kHz audio, filters up to 8 kHz: the top ones are empty
def test_whisper_features_other_settings():
    """A shorter window, another hop and FFT size, 8 kHz: the settings come from the extractor, not constants."""
    fe = transformers.WhisperFeatureExtractor(
        feature_size=40, sampling_rate=8000, hop_length=100, n_fft=512, chunk_length=5
    )
    clips = [tone(1.3, rate=8000), chirp(5.0, rate=8000, f1=3500.0), noise(0.01, rate=8000)]
    ref = fe(clips, sampling_rate=8000, return_attention_mask=True, return_tensors="pt")
    settings = MelSettings.from_feature_extractor(fe)
    assert (settings.sample_rate, settings.hop_length, settings.n_fft, settings.n_samples) == (8000, 100, 512, 40000)
    ours = LogMelExtractor(settings).extract([torch.from_numpy(c) for c in clips])
    torch.testing.assert_close(ours.features, ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(ours.mask, ref["attention_mask"].long())


def test_qwen3_asr_features_per_clip():
    """`longest` padding: each clip as the extractor gives it alone (min_length padding, frames to a multiple of 100)."""
    fe = Qwen3ASRFeatureExtractor(feature_size=128, n_window=50)
    settings = MelSettings.from_feature_extractor(fe, padding="longest")
    assert settings.min_samples == 8000 and settings.pad_frames_to_multiple == 100
    clips = _signals([1, 161, 12345, 16160, 700000])
    ours = LogMelExtractor(settings).extract([torch.from_numpy(c) for c in clips])
    for i, clip in enumerate(clips):
        ref = fe(clip, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, n_window=50)
        frames = ref["input_features"].shape[-1]
        assert settings.num_frames(len(clip)) == frames
        torch.testing.assert_close(ours.features[i : i + 1, :, :frames], ref["input_features"], atol=1e-4, rtol=0)
        assert torch.equal(ours.mask[i : i + 1, :frames], ref["attention_mask"].long())
        assert not ours.mask[i, frames:].any() and not ours.features[i, :, frames:].any()  # batch padding: zeros


def test_silence_and_settings_key():
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    settings = MelSettings.from_feature_extractor(fe)
    silent = np.zeros(16000, dtype=np.float32)
    ref = fe(silent, sampling_rate=16000, return_tensors="pt")["input_features"]
    ours = LogMelExtractor(settings).extract([torch.from_numpy(silent)]).features
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (
        settings.key()
        != MelSettings.from_feature_extractor(transformers.WhisperFeatureExtractor(feature_size=128)).key()
    )


def test_refuses_what_the_extractor_would_cut_or_randomise():
    settings = MelSettings()
    with pytest.raises(ValueError, match="exceeds"):
        LogMelExtractor(settings).extract([torch.zeros(settings.n_samples + 1)])
    with pytest.raises(ValueError, match="dither"):
        MelSettings.from_feature_extractor(transformers.WhisperFeatureExtractor(dither=1e-4))


def test_voxtral_features_pad_to_a_multiple_of_the_window():
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    settings = MelSettings.from_feature_extractor(fe, padding="multiple")
    clips = [chirp(31.0) + noise(31.0, amp=0.02), tone(0.5), chirp(60.0)]
    ours = LogMelExtractor(settings).extract([torch.from_numpy(c) for c in clips])
    for i, clip in enumerate(clips):
        ref = fe(
            clip, sampling_rate=16000, padding=True, truncation=False, pad_to_multiple_of=480000, return_tensors="pt"
        )
        frames = ref["input_features"].shape[-1]
        assert frames == settings.num_frames(len(clip)) == 3000 * -(-len(clip) // 480000)
        torch.testing.assert_close(ours.features[i : i + 1, :, :frames], ref["input_features"], atol=1e-4, rtol=0)
