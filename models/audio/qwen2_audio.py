"""Qwen2-Audio's audio side: Whisper-style encoder, 2x average pooling, linear projector into the Qwen2 text width.

The tower and projector are transformers' own modules (`Qwen2AudioEncoder`, `Qwen2AudioMultiModalProjector`) built
from the checkpoint's config on the meta device and given the checkpoint's tensors; `encode` follows the code path of
`Qwen2AudioModel.forward`: every clip is padded to the 30 s window (3000 frames), attention ignores the frames past
the clip (a bidirectional key mask from the conv output lengths), and only the first `num_tokens` pooled rows are the
clip's embeddings.

Placeholders (the processor's formula): `frames = ceil(samples / hop)`; `((frames - 1) // 2 + 1 - 2) // 2 + 1`,
i.e. 750 for a full 30 s clip, about 25 per second. The token is `config.audio_token_id` (`<|AUDIO|>`).
The encoder cannot see past its window, so audio over `chunk_length` seconds is refused (`limits`), never cut.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.qwen2_audio import modeling_qwen2_audio as hf

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import MelSettings
from omnivox.models.audio.base import AudioEncoder, AudioInputs
from omnivox.models.audio.transcription import language_name


class Qwen2AudioEncoder(AudioEncoder):
    family = "qwen2_audio"

    def __init__(
        self,
        config: transformers.Qwen2AudioConfig,
        mel: MelSettings,
        tower: hf.Qwen2AudioEncoder,
        projector: hf.Qwen2AudioMultiModalProjector,
        device: torch.device | str,
        dtype: torch.dtype,
        name: str = "",
    ) -> None:
        super().__init__(mel, device, dtype, name)
        self.config = config
        self.tower = tower.to(self.device, dtype).eval()
        self.projector = projector.to(self.device, dtype).eval()
        window = config.audio_config.max_source_positions * 2  # mel frames the tower takes (conv2 has stride 2)
        if mel.padding != "max_length" or mel.max_frames != window:
            raise ValueError(f"feature extractor gives {mel.max_frames} frames; the Qwen2-Audio tower takes {window}")
        self._limits = AudioLimits(max_seconds=mel.chunk_length, min_samples=self._min_samples())

    @classmethod
    def mel_settings_for(cls, feature_extractor: Any, config: Any) -> MelSettings:
        return MelSettings.from_feature_extractor(feature_extractor, padding="max_length")

    @classmethod
    def build_modules(cls, config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        return hf.Qwen2AudioEncoder(config.audio_config), hf.Qwen2AudioMultiModalProjector(config)

    @classmethod
    def transcription_messages(cls, language: str | None = None, context: str | None = None) -> list[dict]:
        """No transcription recipe of its own in transformers: a plain instruction after the audio, naming the
        language and the context when the request gives them."""
        instruction = "Transcribe the speech exactly, word for word, with nothing else."
        if language:
            instruction += f" The speech is in {language_name(language)}."
        if context:
            instruction += f" Context: {context}"
        return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction}]}]

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
        frames = self.mel_settings.valid_frames(num_samples)
        return max(0, ((frames - 1) // 2 + 1 - 2) // 2 + 1)

    def _encode_batch(self, inputs: AudioInputs) -> list[torch.Tensor]:
        features = inputs.mel.features.to(self.device, self.dtype)  # [B, n_mels, 3000]
        frames = torch.tensor(inputs.mel.valid_frames, device=self.device)
        conv_lens, out_lens = self.tower._get_feat_extract_output_lengths(frames)  # after conv2, after pooling
        if out_lens.tolist() != inputs.num_tokens:
            raise AssertionError(f"encoder gives {out_lens.tolist()} embeddings, placeholders are {inputs.num_tokens}")
        batch, _, mel_frames = features.shape
        conv_frames = (mel_frames - 2) // 2 + 1  # 1500
        key_mask = (torch.arange(conv_frames, device=self.device)[None, :] < conv_lens[:, None]).long()  # [B, 1500]
        mask = create_bidirectional_mask(
            config=self.tower.config,
            inputs_embeds=torch.zeros(batch, conv_frames, 1, dtype=self.dtype, device=self.device),
            attention_mask=key_mask,
        )
        hidden = self.tower(features, attention_mask=mask).last_hidden_state  # [B, 750, d_audio]
        embeds = self.projector(hidden)  # [B, 750, text_hidden]
        return [embeds[i, :n] for i, n in enumerate(inputs.num_tokens)]
