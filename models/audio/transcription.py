"""What every audio-LLM family's transcription prompt and answer share: language names and codes, the request error.
Each family's own prompt and reading of its answer are methods of its encoder class (`transcription_messages`,
`parse_transcription`: models/audio/base.py, qwen3_asr.py, qwen2_audio.py, voxtral.py):

- Qwen3-ASR: the model's own recipe, as transformers' `Qwen3ASRProcessor.apply_transcription_request` builds it:
  an optional system turn holding the context (hot words, names), the audio in the user turn, and the assistant
  turn prefilled with `language <Name><asr_text>` when the language is given (the model then writes only the text).
  Without a language the model answers `language <Name><asr_text><text>`: the detected language comes first.
- Qwen2-Audio (Instruct): no transcription recipe of its own in transformers; ours is a plain instruction after the
  audio ("Transcribe the speech ..."), naming the language when one is given, and the context when one is given.
- Voxtral: mistral_common's TranscriptionRequest (services/processing/voxtral_prompt.py), not chat messages; its answer is the
  plain transcript.
Rendering goes through the checkpoint's own chat template (`processor.apply_chat_template`), so the audio marker
is whatever the template writes; `AudioEncoder.expand_prompt` then repeats it to the clip's placeholder count.
"""

from __future__ import annotations

import functools

ASR_TEXT = "<asr_text>"


@functools.cache
def _languages() -> tuple[dict[str, str], dict[str, str]]:
    """Qwen3-ASR's language table (code -> name) and its inverse (lower-cased name -> code). Imported on first use:
    its module pulls in transformers' processing and modeling utilities, ~1.5 s of every `omnivox serve` start
    (an audio-LLM's processor, loaded with the model, imports most of it anyway)."""
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    return LANGUAGE_CODE_TO_NAME, {name.lower(): code for code, name in LANGUAGE_CODE_TO_NAME.items()}


class TranscriptionRequestError(ValueError):
    """A transcription setting the family cannot honour; `field` names the request field (`language`)."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


def language_name(language: str) -> str:
    """A BCP-47 tag (`en`, `en-US`, `yue`, `pt-BR`) or an English name (`English`) -> the name Qwen3-ASR was trained
    with. Raises TranscriptionRequestError for a language the model does not list."""
    code_to_name, name_to_code = _languages()
    code = language.strip().replace("_", "-").split("-")[0].lower()
    if code in code_to_name:
        return code_to_name[code]
    if language.strip().lower() in name_to_code:
        return code_to_name[name_to_code[language.strip().lower()]]
    known = ", ".join(sorted(code_to_name))
    raise TranscriptionRequestError("language", f"{language!r} is not a language this model knows; known: {known}")


def forced_language_code(language: str | None) -> str | None:
    """The ISO 639-1 code of a language the request forced (by name or code); None when it forced none."""
    return _languages()[1].get(language_name(language).lower()) if language else None


def read_language_header(text: str, language: str | None) -> tuple[str | None, str]:
    """Qwen3-ASR's answer `language <Name><asr_text><text>`: (the forced or else the detected code, the text)."""
    forced = forced_language_code(language)
    if ASR_TEXT not in text:
        return forced, text.strip()
    head, transcript = text.split(ASR_TEXT, 1)
    head = head.strip()
    name = head[len("language ") :].strip() if head.lower().startswith("language ") else head
    detected = _languages()[1].get(name.lower()) if name and name.lower() != "none" else None
    return forced or detected, transcript.strip()
