"""Whisper-style log-mel features, computed with torch (STFT, Slaney mel filters), batched.

Equal to transformers' `WhisperFeatureExtractor` (and `Qwen3ASRFeatureExtractor`, the same recipe) within 1e-4:
- power spectrum of a centred, reflect-padded Hann STFT (`n_fft`, `hop_length`), the last frame dropped;
- Slaney-normalised, Slaney-scale mel filters from 0 to 8 kHz (8 kHz whatever the sample rate, as the extractor);
- `log10(max(mel, 1e-10))`, clamped below at (the clip's maximum - 8), then `(x + 4) / 4`. The maximum is taken per
  clip over all its frames, padding included, exactly as the extractor does.

Three padding modes:
- `max_length` (Qwen2-Audio, Whisper): every clip is zero-padded to `chunk_length` seconds (`n_samples`) before the
  STFT; the attention mask marks `ceil(num_samples / hop)` frames. A longer clip is an error here (the extractor
  would cut it silently; `codecs.audio_input` rejects such audio first).
- `longest` (Qwen3-ASR): no padding in samples, except clips under `min_samples`, which are zero-padded to it and
  count as valid frames (as the extractor does); then the frame axis is zero-padded to a multiple of
  `pad_frames_to_multiple` (mask 0 there). Each clip's features are those the extractor gives for that clip alone,
  so a clip's features never depend on what it is batched with (the extractor's own batch padding would change the
  last frames of the shorter clips).
- `multiple` (Voxtral): the clip is zero-padded to a multiple of `chunk_length` seconds (at least one), as the Voxtral
  processor asks (`pad_to_multiple_of=n_samples`); the normalisation spans the whole padded clip, and the encoder
  reads it in `chunk_length` pieces. The mask marks `ceil(num_samples / hop)` frames, as in `max_length`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

MEL_F_MAX = 8000.0  # WhisperFeatureExtractor's filters end at 8 kHz whatever the sample rate


@dataclass(frozen=True)
class MelSettings:
    """Feature settings read from a checkpoint's feature extractor config (`preprocessor_config.json`)."""

    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 80
    chunk_length: int = 30  # seconds; `max_length` pads every clip to this
    padding: Literal["max_length", "longest", "multiple"] = "max_length"
    min_samples: int = 0  # `longest`: shorter clips are zero-padded to this many samples
    pad_frames_to_multiple: int = 0  # `longest`: frame axis padded to a multiple of this (0: none)

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sample_rate

    @property
    def max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @classmethod
    def from_feature_extractor(
        cls, fe: Any, padding: Literal["max_length", "longest", "multiple"] = "max_length"
    ) -> MelSettings:
        """From a `WhisperFeatureExtractor` / `Qwen3ASRFeatureExtractor` instance. Dithering is refused (random)."""
        if float(getattr(fe, "dither", 0.0) or 0.0) != 0.0:
            raise ValueError(f"feature extractor dither={fe.dither}: random features cannot be cached or compared")
        n_window = int(getattr(fe, "n_window", 0) or 0)
        return cls(
            sample_rate=int(fe.sampling_rate),
            n_fft=int(fe.n_fft),
            hop_length=int(fe.hop_length),
            n_mels=int(fe.feature_size),
            chunk_length=int(fe.chunk_length),
            padding=padding,
            min_samples=int(getattr(fe, "min_length", 0) or 0) if padding == "longest" else 0,
            pad_frames_to_multiple=2 * n_window if padding == "longest" else 0,
        )

    def key(self) -> str:
        """A stable text form of every setting, for content keys."""
        return "mel:" + ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))

    def padded_samples(self, num_samples: int) -> int:
        """Length in samples the clip is padded to before the STFT."""
        if self.padding == "max_length":
            return self.n_samples
        if self.padding == "multiple":
            return max(1, -(-num_samples // self.n_samples)) * self.n_samples
        return max(num_samples, self.min_samples)

    def valid_frames(self, num_samples: int) -> int:
        """Frames the attention mask marks as audio (the extractor's sample mask sampled every `hop` samples)."""
        padded = self.padded_samples(num_samples)
        valid = padded if self.padding == "longest" else num_samples
        entries = math.ceil(padded / self.hop_length) - (1 if padded % self.hop_length else 0)
        return min(math.ceil(valid / self.hop_length), entries)

    def num_frames(self, num_samples: int) -> int:
        """Frames of the feature matrix (after padding to a multiple where set)."""
        frames = self.padded_samples(num_samples) // self.hop_length
        m = self.pad_frames_to_multiple
        return -(-frames // m) * m if m > 1 else frames


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:  # Slaney: linear below 1 kHz, logarithmic above
    return torch.where(f < 1000.0, f * 3.0 / 200.0, 15.0 + torch.log(f.clamp(min=1e-9) / 1000.0) * 27.0 / math.log(6.4))


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return torch.where(m < 15.0, m * 200.0 / 3.0, 1000.0 * torch.exp((m - 15.0) * math.log(6.4) / 27.0))


def slaney_mel_filters(n_freqs: int, f_max: float, n_mels: int, sample_rate: int) -> torch.Tensor:
    """[n_freqs, n_mels] float32: Slaney-scale triangles from 0 Hz to f_max, Slaney area normalisation.

    The triangles of `torchaudio.functional.melscale_fbanks(norm="slaney", mel_scale="slaney")`, computed in float64
    like transformers' `mel_filter_bank`: torchaudio's float32 edges differ by up to 1.6e-7, which a chirp sitting on
    a triangle's edge turned into 3.5e-4 of feature error against the extractor (measured); in float64 the features
    came out bit-identical on the tests' chirps, tones and noise.
    """
    mel_edges = torch.linspace(
        0.0, float(_hz_to_mel(torch.tensor(f_max, dtype=torch.float64))), n_mels + 2, dtype=torch.float64
    )
    hz_edges = _mel_to_hz(mel_edges)  # [n_mels + 2]
    freqs = torch.linspace(0.0, sample_rate // 2, n_freqs, dtype=torch.float64)  # [n_freqs]
    slopes = hz_edges[None, :] - freqs[:, None]  # [n_freqs, n_mels + 2]
    widths = hz_edges[1:] - hz_edges[:-1]  # [n_mels + 1]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    triangles = torch.clamp(torch.minimum(down, up), min=0.0)
    return (triangles * (2.0 / (hz_edges[2:] - hz_edges[:-2]))[None, :]).float()


@dataclass
class MelBatch:
    """Features of a batch of clips. `features` [B, n_mels, T] float32 (T = the longest clip's frames, zero-padded);
    `mask` [B, T] int64 (1 on audio frames); `valid_frames` per clip (the mask's sum)."""

    features: torch.Tensor
    mask: torch.Tensor
    valid_frames: list[int]


class LogMelExtractor:
    """`extract(list of 1-D float32 sample tensors at settings.sample_rate) -> MelBatch`, on `device`."""

    def __init__(self, settings: MelSettings, device: torch.device | str = "cpu") -> None:
        self.settings = settings
        self.device = torch.device(device)
        s = settings
        self.filters = slaney_mel_filters(s.n_fft // 2 + 1, MEL_F_MAX, s.n_mels, s.sample_rate).to(self.device)
        self.window = torch.hann_window(s.n_fft, device=self.device)

    def _log_mel(self, x: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, n_mels, S // hop]
        s = self.settings
        spec = torch.stft(x, s.n_fft, s.hop_length, window=self.window, center=True, return_complex=True)
        power = (spec[..., :-1].abs() ** 2).contiguous()  # [B, n_freqs, frames]; the last frame is dropped
        mel = self.filters.T @ power  # [B, n_mels, frames]
        log_spec = torch.clamp(mel, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)  # per clip
        return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0

    def extract(self, clips: list[torch.Tensor]) -> MelBatch:
        s = self.settings
        if not clips:
            raise ValueError("no clips")
        lengths = [int(c.numel()) for c in clips]
        if s.padding == "max_length" and max(lengths) > s.n_samples:
            raise ValueError(f"a clip of {max(lengths)} samples exceeds the {s.n_samples}-sample window")
        frames = [s.num_frames(n) for n in lengths]
        T = max(frames)
        features = torch.zeros(len(clips), s.n_mels, T, device=self.device)
        mask = torch.zeros(len(clips), T, dtype=torch.int64, device=self.device)
        valid = [s.valid_frames(n) for n in lengths]
        # Clips padded to the same length go through one STFT together.
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(s.padded_samples(n), []).append(i)
        for padded, idx in groups.items():
            x = torch.zeros(len(idx), padded, device=self.device)
            for row, i in enumerate(idx):
                x[row, : lengths[i]] = clips[i].to(self.device, torch.float32)
            out = self._log_mel(x)
            for row, i in enumerate(idx):
                features[i, :, : out.shape[-1]] = out[row]
                mask[i, : valid[i]] = 1
        return MelBatch(features=features, mask=mask, valid_frames=valid)
