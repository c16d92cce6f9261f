"""Qwen3-ASR's audio side: a chunked conv + windowed-attention encoder and a two-layer projector into Qwen3's width.

The tower and projector are transformers' own modules (`Qwen3ASREncoder`, `Qwen3ASRMultiModalProjector`), built from
the checkpoint's config on the meta device and given the checkpoint's tensors; `encode` is `get_audio_features`.
How the tower sees audio: the mel frames are cut into chunks of `2 * n_window` frames (1 s), each chunk goes through
three stride-2 convolutions on its own (13 positions for a full chunk, sinusoidal positions restarting per chunk),
and attention runs within windows of `n_window_infer` frames (8 s by default); only valid frames count.

Features are computed per clip as the feature extractor gives them for that clip alone (no padding, clips under
`min_length` samples zero-padded to it, frames padded to a multiple of 100), so a clip's embeddings never depend on
what it is batched with: clips of several requests are stacked with zero frames past their ends (mask 0), and the
tower reads only each clip's valid chunks.

Placeholders (the processor's formula, `_get_audio_token_length`): `frames = max(samples, min_length) // hop`;
13 per full 100-frame chunk plus three ceil-halvings of the remainder. The token is `config.audio_token_id`
(`<|audio_pad|>`). The encoder has no window limit of its own; `max_seconds` (default 300 s, ~3,900 placeholders)
is our bound on one part, which the transcription service meets by splitting long audio.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from transformers.models.qwen3_asr import modeling_qwen3_asr as hf

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import MelSettings
from omnivox.models.audio.base import AudioEncoder, AudioInputs, audio_side_tensors
from omnivox.models.audio.base import load_module_state as _load

DEFAULT_MAX_SECONDS = 300.0


class Qwen3ASRAudioEncoder(AudioEncoder):
    family = "qwen3_asr"

    def __init__(
        self,
        config: transformers.Qwen3ASRConfig,
        mel: MelSettings,
        tower: hf.Qwen3ASREncoder,
        projector: hf.Qwen3ASRMultiModalProjector,
        device: torch.device | str,
        dtype: torch.dtype,
        name: str = "",
        max_seconds: float = DEFAULT_MAX_SECONDS,
    ) -> None:
        super().__init__(mel, device, dtype, name)
        self.config = config
        self.n_window = int(config.audio_config.n_window)
        if mel.padding != "longest" or mel.pad_frames_to_multiple != 2 * self.n_window:
            raise ValueError(f"feature extractor pads frames to {mel.pad_frames_to_multiple}, the tower needs a "
                             f"multiple of {2 * self.n_window}")  # fmt: skip
        if config.audio_config.output_dim != config.text_config.hidden_size:
            raise ValueError(f"projector width {config.audio_config.output_dim} != text width {config.text_config.hidden_size}")  # fmt: skip
        self.tower = tower.to(self.device, dtype).eval()
        self.projector = projector.to(self.device, dtype).eval()
        self._limits = AudioLimits(max_seconds=max_seconds, min_samples=self._min_samples())

    @classmethod
    def from_folder(
        cls,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seconds: float = DEFAULT_MAX_SECONDS,
    ) -> Qwen3ASRAudioEncoder:
        path = Path(path)
        config = transformers.AutoConfig.from_pretrained(path)
        if config.model_type != "qwen3_asr":
            raise ValueError(f"{path}: model_type {config.model_type!r} is not qwen3_asr")
        fe = transformers.AutoFeatureExtractor.from_pretrained(path)
        mel = MelSettings.from_feature_extractor(fe, padding="longest")
        if mel.pad_frames_to_multiple != 2 * config.audio_config.n_window:  # the processor passes n_window itself
            mel = MelSettings(**{**mel.__dict__, "pad_frames_to_multiple": 2 * config.audio_config.n_window})
        with torch.device("meta"):
            tower = hf.Qwen3ASREncoder(config.audio_config)
            projector = hf.Qwen3ASRMultiModalProjector(config)
        tower_state, projector_state = audio_side_tensors(path, dtype)
        _load(tower, tower_state, "audio_tower")
        _load(projector, projector_state, "multi_modal_projector")
        # The sinusoidal position table is a non-persistent buffer (not in the checkpoint): compute it.
        positions = tower.positional_embedding
        positions.positional_embedding = positions.compute_default_singular_positional_embedding()
        return cls(config, mel, tower, projector, device, dtype, name=path.name, max_seconds=max_seconds)

    @property
    def placeholder_token_id(self) -> int:
        return int(self.config.audio_token_id)

    @property
    def text_hidden_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    @property
    def limits(self) -> AudioLimits:
        return self._limits

    def num_placeholders(self, num_samples: int) -> int:
        return int(hf._get_feat_extract_output_lengths(self.mel_settings.valid_frames(num_samples), self.n_window))

    def _encode_batch(self, inputs: AudioInputs) -> list[torch.Tensor]:
        features = inputs.mel.features.to(self.device, self.dtype)  # [B, n_mels, T], T a multiple of 2 * n_window
        mask = inputs.mel.mask.to(self.device)  # [B, T]
        lengths = hf._get_feat_extract_output_lengths(mask.sum(-1), self.n_window).tolist()
        if lengths != inputs.num_tokens:
            raise AssertionError(f"encoder gives {lengths} embeddings, placeholders are {inputs.num_tokens}")
        hidden = self.tower(input_features=features, input_features_mask=mask).last_hidden_state  # [sum(n), d]
        if hidden.shape[0] != sum(lengths):
            raise AssertionError(f"tower output {hidden.shape[0]} rows != placeholders {sum(lengths)}")
        embeds = self.projector(hidden)  # [sum(n), text_hidden]
        return list(torch.split(embeds, lengths))
