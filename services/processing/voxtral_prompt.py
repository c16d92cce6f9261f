"""Voxtral's prompts, written by mistral_common as transformers' VoxtralProcessor writes them.

Voxtral has no chat template: its tokenizer is a Tekken file (tekken.json) and its chat format and transcription
request are mistral_common's (`InstructTokenizerV7`), which transformers' `MistralCommonBackend` wraps:
- chat: `MistralCommonBackend.apply_chat_template(messages, continue_final_message=...)`, the call
  `VoxtralProcessor.apply_chat_template` makes: `<s>[INST][BEGIN_AUDIO][AUDIO]x375 question[/INST]`, a system turn
  as `[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]`, an answered turn closed with `</s>`;
- transcription: `encode_transcription(TranscriptionRequest(audio, language))`, the call
  `VoxtralProcessor.apply_transcription_request` makes: `<s>[INST][BEGIN_AUDIO][AUDIO]x375[/INST]lang:en[TRANSCRIBE]`.

mistral_common writes `[AUDIO]` once per 12.5 Hz frame of the clip padded to 30 s chunks, the count our encoder
gives (`VoxtralAudioEncoder.num_placeholders`; both are checked to agree when the model loads). Each clip is handed
to mistral_common as a short silent stand-in (one chunk: 375 markers, whatever its real length), the run is folded
to one marker, and `AudioInputPart.prompt` expands it to the real clip's count as for every other family; so a
prompt is written once for all the windows of a transcription and no clip is encoded to WAV and back to be counted
(handing mistral_common the real clip as the processor does took 61 ms for 30 s of audio and 640 ms for 300 s, the
stand-in ~1 ms: medians of 7 alternating runs, one thread; the expanded ids were equal).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import soundfile

from omnivox.models.audio.transcription import TranscriptionRequestError
from omnivox.services.output.tool_parser import ToolFormat
from omnivox.services.processing.tool_formats import mistral_common_format


class VoxtralPrompts:
    """Chat and transcription token ids of a Voxtral checkpoint (markers folded to one per clip)."""

    def __init__(self, backend: Any, encoder: Any) -> None:
        """`backend`: the checkpoint's MistralCommonBackend (its processor's tokenizer); `encoder`: its
        VoxtralAudioEncoder. ValueError when the tekken file's audio section disagrees with the encoder."""
        self.backend = backend
        self.instruct = backend.tokenizer.instruct_tokenizer
        audio = self.instruct.audio_encoder
        if audio is None:
            raise ValueError("its tekken.json has no audio section; Voxtral prompts need one")
        config = audio.audio_config
        chunk_samples = encoder.chunk_frames * encoder.mel_settings.hop_length
        if config.sampling_rate != encoder.sample_rate or config.chunk_frames != chunk_samples:
            raise ValueError(f"tekken.json cuts {config.sampling_rate} Hz audio into {config.chunk_frames}-sample chunks; the encoder {encoder.sample_rate} Hz into {chunk_samples}")  # fmt: skip
        if config.num_audio_tokens(chunk_samples) != encoder.per_chunk:
            raise ValueError(f"tekken.json writes {config.num_audio_tokens(chunk_samples)} audio tokens per chunk; the encoder gives {encoder.per_chunk}")  # fmt: skip
        self.marker = audio.special_ids.audio
        if self.marker != encoder.placeholder_token_id:
            raise ValueError(f"tekken.json's [AUDIO] is {self.marker}; config.json's audio_token_id {encoder.placeholder_token_id}")  # fmt: skip
        self.per_chunk = encoder.per_chunk
        buf = io.BytesIO()
        soundfile.write(
            buf, np.zeros(config.encoding_config.window_size, np.float32), config.sampling_rate, format="WAV"
        )
        self._stand_in = buf.getvalue()

    def chat_ids(self, messages: list[dict], continue_final: bool, tools: list[dict] | None = None) -> list[int]:
        """Chat messages (`{"type": "audio"}` where each clip goes; a tool turn's content a string) and the request's
        `tools` -> token ids, one marker per clip. mistral_common's refusals (turn order, an empty conversation) are
        ValueError."""
        stand_in = base64.b64encode(self._stand_in).decode()
        filled = [
            m
            if isinstance(m["content"], str)
            else {**m, "content": [{**p, "base64": stand_in} if p["type"] == "audio" else p for p in m["content"]]}
            for m in messages
        ]
        try:
            ids = self.backend.apply_chat_template(
                filled, tools=tools, tokenize=True, return_dict=False, continue_final_message=continue_final
            )
        except (ValueError, AssertionError) as exc:  # mistral_common's exceptions are ValueErrors
            raise ValueError(str(exc)) from exc
        return self._fold(list(ids))

    def tool_format(self) -> ToolFormat | None:
        """How mistral_common writes an assistant's calls for this tokenizer version (`tool_formats.mistral_common_format`:
        `[TOOL_CALLS][{...}]` for v3 to v7 Tekken, Voxtral's; `[TOOL_CALLS]name[ARGS]{...}` for v11+); None for a
        format our parser does not read, which refuses tools."""
        return mistral_common_format(self.backend)

    def transcription_ids(self, language: str | None) -> list[int]:
        """The transcription request's token ids (one marker), `language` an ISO 639-1 code or None (detect)."""
        from mistral_common.protocol.transcription.request import TranscriptionRequest

        request = TranscriptionRequest(audio=self._stand_in, language=language)
        return self._fold(list(self.instruct.encode_transcription(request).tokens))

    def _fold(self, ids: list[int]) -> list[int]:
        out: list[int] = []
        run = 0
        for token in [*ids, -1]:
            if token == self.marker:
                run += 1
                continue
            if run:
                # A stand-in is one chunk; any other count means mistral_common counts differently from the encoder.
                assert run == self.per_chunk, f"mistral_common wrote {run} audio tokens for one chunk"
                out.append(self.marker)
                run = 0
            if token != -1:
                out.append(token)
        return out


def voxtral_language(tag: str) -> str:
    """A BCP-47 tag (`en`, `en-US`, `pt_BR`) -> the ISO 639-1 code Voxtral's transcription request takes.
    TranscriptionRequestError on `language` for anything else (`eng`, `xx`, `English`)."""
    from pydantic import TypeAdapter, ValidationError
    from pydantic_extra_types.language_code import LanguageAlpha2

    code = tag.strip().replace("_", "-").split("-")[0].lower()
    try:
        return str(TypeAdapter(LanguageAlpha2).validate_python(code))
    except ValidationError as exc:
        raise TranscriptionRequestError(
            "language", f"{tag!r}: Voxtral takes an ISO 639-1 language code (en, fr, de-DE)"
        ) from exc
