"""Voxtral's audio side: a Whisper encoder over 30 s chunks, four frames stacked per embedding, a two-layer projector.

The tower and projector are transformers' own modules (`VoxtralEncoder`, `VoxtralMultiModalProjector`) built from
the checkpoint's config on the meta device and given the checkpoint's tensors; `encode` is `get_audio_features`.
Long audio is Voxtral's own business: the processor pads a clip to a multiple of 30 s, computes one log-mel over
all of it (one normalisation for the whole clip) and cuts it into 3000-frame chunks; each chunk is encoded on its own
(no attention mask: the padding is heard as silence, as in the reference), and every 4 consecutive encoder frames
(`intermediate_size / hidden_size`) become one embedding.

Placeholders: `375 * ceil(samples / 480000)` for the real config (max_source_positions * hidden / intermediate per
chunk), every chunk full. The token is `config.audio_token_id` (`[AUDIO]`, 24 in the real tokenizer).
Prompts are not built here: Voxtral's tokenizer and chat format come from `mistral_common`
(services/processing/voxtral_prompt.py). `max_seconds` (default 300 s) is our bound.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.models.voxtral import modeling_voxtral as hf

from omnivox.codecs.audio_input import AudioLimits
from omnivox.codecs.mel import MelSettings
from omnivox.models.audio.base import AudioEncoder, AudioInputs

DEFAULT_MAX_SECONDS = 300.0


class VoxtralAudioEncoder(AudioEncoder):
    family = "voxtral"

    def __init__(
        self,
        config: transformers.VoxtralConfig,
        mel: MelSettings,
        tower: hf.VoxtralEncoder,
        projector: hf.VoxtralMultiModalProjector,
        device: torch.device | str,
        dtype: torch.dtype,
        name: str = "",
        max_seconds: float = DEFAULT_MAX_SECONDS,
    ) -> None:
        super().__init__(mel, device, dtype, name)
        self.config = config
        audio = config.audio_config
        self.chunk_frames = audio.max_source_positions * 2  # mel frames per chunk (conv2 has stride 2)
        if mel.padding != "multiple" or mel.max_frames != self.chunk_frames:
            raise ValueError(f"feature extractor gives {mel.max_frames}-frame chunks, the tower takes {self.chunk_frames}")  # fmt: skip
        if audio.intermediate_size % audio.hidden_size or audio.max_source_positions % (
            audio.intermediate_size // audio.hidden_size
        ):
            raise ValueError("Voxtral stacks intermediate_size / hidden_size frames per embedding; sizes disagree")
        self.per_chunk = audio.max_source_positions * audio.hidden_size // audio.intermediate_size  # 375
        self.tower = tower.to(self.device, dtype).eval()
        self.projector = projector.to(self.device, dtype).eval()
        self._limits = AudioLimits(max_seconds=max_seconds, min_samples=self._min_samples())

    @classmethod
    def mel_settings_for(cls, feature_extractor: Any, config: Any) -> MelSettings:
        return MelSettings.from_feature_extractor(feature_extractor, padding="multiple")

    @classmethod
    def build_modules(cls, config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        return hf.VoxtralEncoder(config.audio_config), hf.VoxtralMultiModalProjector(config)

    @classmethod
    def parse_transcription(cls, text: str, language: str | None = None) -> tuple[str | None, str]:
        """Plain text (its prompt is mistral_common's TranscriptionRequest, services/processing/voxtral_prompt.py); the forced
        language is the ISO 639-1 code its request was written with."""
        return (language.strip().replace("_", "-").split("-")[0].lower() if language else None), text.strip()

    @property
    def placeholder_token_id(self) -> int:
        return int(self.config.audio_token_id)

    @property
    def text_hidden_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    @property
    def limits(self) -> AudioLimits:
        return self._limits

    def num_chunks(self, num_samples: int) -> int:
        return self.mel_settings.num_frames(num_samples) // self.chunk_frames

    def num_placeholders(self, num_samples: int) -> int:
        return self.num_chunks(num_samples) * self.per_chunk

    def _encode_batch(self, inputs: AudioInputs) -> list[torch.Tensor]:
        feats = inputs.mel.features  # [B, n_mels, T], T a multiple of chunk_frames
        chunks_per_clip = [n // self.per_chunk for n in inputs.num_tokens]
        # Every clip's chunks, in order: [sum(chunks), n_mels, chunk_frames], as the processor stacks them.
        chunks = torch.cat(
            [
                feats[i, :, : k * self.chunk_frames].reshape(feats.shape[1], k, self.chunk_frames).transpose(0, 1)
                for i, k in enumerate(chunks_per_clip)
            ]
        ).to(self.device, self.dtype)
        hidden = self.tower(chunks).last_hidden_state  # [sum(chunks), 1500, d_audio]
        stacked = hidden.reshape(-1, self.config.audio_config.intermediate_size)  # [sum(chunks) * 375, 4 * d_audio]
        embeds = self.projector(stacked)  # [sum(tokens), text_hidden]
        return list(torch.split(embeds, inputs.num_tokens))
