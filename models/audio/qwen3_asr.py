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

from typing import Any

import torch
import transformers
from transformers.models.qwen3_asr import modeling_qwen3_asr as hf

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import MelSettings
from omnivox.models.audio.base import AudioEncoder, AudioInputs
from omnivox.models.audio.transcription import ASR_TEXT, language_name, read_language_header

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
    def mel_settings_for(cls, feature_extractor: Any, config: Any) -> MelSettings:
        mel = MelSettings.from_feature_extractor(feature_extractor, padding="longest")
        if mel.pad_frames_to_multiple != 2 * config.audio_config.n_window:  # the processor passes n_window itself
            mel = MelSettings(**{**mel.__dict__, "pad_frames_to_multiple": 2 * config.audio_config.n_window})
        return mel

    @classmethod
    def build_modules(cls, config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        return hf.Qwen3ASREncoder(config.audio_config), hf.Qwen3ASRMultiModalProjector(config)

    @classmethod
    def after_load(cls, tower: torch.nn.Module) -> None:
        # The sinusoidal position table is a non-persistent buffer (not in the checkpoint): compute it.
        positions = tower.positional_embedding
        positions.positional_embedding = positions.compute_default_singular_positional_embedding()

    @classmethod
    def transcription_messages(cls, language: str | None = None, context: str | None = None) -> list[dict]:
        """The model's own recipe (transformers' `Qwen3ASRProcessor.apply_transcription_request`): an optional system
        turn holding the context, the audio in the user turn, the answer prefilled with `language <Name><asr_text>`
        when the language is given (the model then writes only the text)."""
        messages: list[dict] = []
        if context:
            messages.append({"role": "system", "content": [{"type": "text", "text": context}]})
        messages.append({"role": "user", "content": [{"type": "audio"}]})
        prefill = f"language {language_name(language)}{ASR_TEXT}" if language else ""
        messages.append({"role": "assistant", "content": [{"type": "text", "text": prefill}]})
        return messages

    @classmethod
    def parse_transcription(cls, text: str, language: str | None = None) -> tuple[str | None, str]:
        """Without a forced language it answers `language <Name><asr_text><text>`: the detected language first."""
        return read_language_header(text, language)

    @classmethod
    def answer_header_tag(cls, language: str | None) -> str | None:
        """Asked to detect the language it writes `language <Name><asr_text>` first; a forced one is prefilled."""
        return ASR_TEXT if language is None else None

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
