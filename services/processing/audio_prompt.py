"""Audio input for audio-LLM bundles (Qwen2-Audio, Qwen3-ASR, Voxtral): the bundle part and its PromptBuilder.

One audio part of a request, off the event loop (the prompt is built in a worker thread):
  bytes -> `decode_audio` (mono float32 at the encoder's rate; AudioInputError -> INVALID_ARGUMENT on
  `contents[i].parts[j].audio.<field>`) -> log-mel features -> a content key (hash of the decoded samples + feature
  settings + model, so WAV and FLAC of the same samples share one encoder-cache entry) -> an EmbeddingSegment whose
  source is the bundle's EncoderWorker handle. The encoder runs only when the engine admits the request and the prefix
  cache does not already cover the clip; clips of requests admitted together are encoded in one batch.

The prompt is the checkpoint's own chat template (its processor's) with `{"type": "audio"}` where each clip goes; the
template writes the audio marker once per clip and `AudioEncoder.expand_prompt` repeats it to the clip's count.
Voxtral has no chat template: mistral_common writes its prompts (services/processing/voxtral_prompt.py), one marker per clip too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnivox.codecs.audio_input import AudioInputError, AudioLimits, DecodedAudio, content_key, decode_audio
from omnivox.engine import EmbeddingSegment
from omnivox.engine.encoder_cache import EncoderCache, EncoderWorker
from omnivox.models.audio import AudioEncoder
from omnivox.models.audio.transcription import TranscriptionRequestError, language_name
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.output.tool_parser import ToolFormat
from omnivox.services.processing.prompt import MediaPromptBuilder, Prompt, role_of
from omnivox.services.processing.tool_formats import format_of, media_template
from omnivox.services.processing.tools import tool_turn_content, turn_fields
from omnivox.services.processing.voxtral_prompt import VoxtralPrompts, voxtral_language
from omnivox.v1 import content_pb2

log = logging.getLogger(__name__)

# Encoded clips kept for reuse. A 30 s Qwen2-Audio clip is 750 x 4096 bf16 = 6 MiB, so 256 MiB holds ~40 of them.
ENCODER_CACHE_BYTES = 256 << 20
# Transcription decodes long audio (then splits it into windows the model accepts) up to this long.
TRANSCRIBE_MAX_SECONDS = 3600.0


@dataclass
class AudioInputPart:
    """The audio side of a bundle: encoder (tower + projector), its worker and cache, and the processor whose chat
    template frames the clips."""

    family: str
    encoder: AudioEncoder
    worker: EncoderWorker
    processor: Any  # transformers' processor of the checkpoint: chat template + tokenizer
    model_key: str  # names the model in content keys (features of two models must never share an entry)
    mistral: VoxtralPrompts | None = None  # Voxtral: prompts written by mistral_common, not a chat template

    @property
    def cache(self) -> EncoderCache:
        return self.worker.cache

    @property
    def limits(self) -> AudioLimits:
        return self.encoder.limits

    def long_limits(self) -> AudioLimits:
        """What Transcribe accepts: long audio (split into windows of `limits.max_seconds` later)."""
        return dataclasses.replace(self.encoder.limits, max_seconds=TRANSCRIBE_MAX_SECONDS)

    def decode(self, part: content_pb2.AudioPart, path: str, limits: AudioLimits | None = None) -> DecodedAudio:
        """Decode one AudioPart; INVALID_ARGUMENT on `<path>.<field>` when it cannot be accepted."""
        try:
            return decode_audio(
                part.data,
                encoding_name(part.encoding),
                part.sample_rate_hertz,
                self.encoder.sample_rate,
                limits or self.encoder.limits,
            )
        except AudioInputError as err:
            raise errors.invalid_argument([FieldViolation(f"{path}.{err.field}", err.description)]) from err

    def render(self, messages: list[dict], continue_final: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Chat messages -> token ids through the checkpoint's template (one marker per clip, not yet expanded);
        `tools` (a list, maybe empty, for a request with tools or tool turns) through the template that renders them
        (`tool_formats.media_template`). Voxtral continues a final assistant turn (mistral_common has no generation prompt to
        add; it refuses a conversation that ends with an answer unless told to continue it)."""
        if self.mistral is not None:
            return self.mistral.chat_ids(messages, continue_final or messages[-1]["role"] == "assistant", tools or None)
        tool_kwargs = {} if tools is None else {"tools": tools or None, "chat_template": media_template(self.processor)}
        text = self.processor.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **tool_kwargs,
        )
        return list(self.processor.tokenizer(text, add_special_tokens=False).input_ids)

    def transcription_language(self, language: str) -> str:
        """The request's language as this family's transcription prompt names it; TranscriptionRequestError."""
        return voxtral_language(language) if self.mistral is not None else language_name(language)

    def transcription_ids(self, language: str | None, context: str | None) -> list[int]:
        """The family's transcription prompt (one marker, for one window's clip); TranscriptionRequestError."""
        if self.mistral is not None:
            if context:
                raise TranscriptionRequestError("prompt", "Voxtral's transcription request takes no context")
            return self.mistral.transcription_ids(voxtral_language(language) if language else None)
        messages = self.encoder.transcription_messages(language, context)  # the family's own prompt
        return self.render(messages, continue_final=messages[-1]["role"] == "assistant")

    def prompt(
        self, token_ids: list[int], clips: Sequence[Any], field: str = "contents", cache_salt: str = ""
    ) -> Prompt:
        """Expand the markers of `token_ids` to the clips' placeholder counts and attach one segment per clip (its
        features shared only with prompts of the same `cache_salt`).

        `clips` are the decoded samples, in prompt order. A prompt whose markers do not match the clips (user text
        that spells the marker token) is INVALID_ARGUMENT on `field`. Encoder-cache references are taken last, so a
        refused prompt holds none; the engine drops them when the request ends (`Prompt.release` before it is queued).
        """
        enc = self.encoder
        inputs = [enc.features([samples]) for samples in clips]
        try:
            ids, starts = enc.expand_prompt(token_ids, [i.num_tokens[0] for i in inputs])
        except ValueError as exc:
            raise errors.invalid_argument([FieldViolation(field, f"the audio markers do not match: {exc}")]) from exc
        segments = []
        for start, samples, clip in zip(starts, clips, inputs, strict=True):
            key = content_key(samples, enc.sample_rate, enc.feature_settings(), self.model_key)
            n = clip.num_tokens[0]
            segments.append(EmbeddingSegment(start, n, key=key, source=self.worker.handle(key, clip, cache_salt)))
        return Prompt(token_ids=ids, segments=segments)

    def marker_text(self) -> str:
        return self.processor.tokenizer.convert_ids_to_tokens(self.encoder.marker_token_id)

    def close(self) -> None:
        self.worker.shutdown()


def encoding_name(value: int) -> str:
    """An AudioPart's encoding as the codec names it; a number outside the enum stays a number, which the codec
    refuses as `encoding` (INVALID_ARGUMENT; `AudioEncoding.Name` raised ValueError: INTERNAL)."""
    return content_pb2.AudioEncoding.Name(value) if value in content_pb2.AudioEncoding.values() else str(value)


def load_audio_part(folder: Path, device: Any, dtype: Any, model_key: str) -> AudioInputPart:
    """Encoder, worker and processor of the audio-LLM checkpoint in `folder` (blocking). ValueError when the folder
    lacks what audio input needs (a processor with a chat template)."""
    import transformers

    from omnivox.models.audio import audio_family, load_audio_encoder

    family = audio_family(folder)
    if family is None:
        raise ValueError(f"{folder} is not an audio-LLM checkpoint")
    try:
        processor = transformers.AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # e.g. Voxtral, whose processor comes from mistral_common
        raise ValueError(f"{folder}: cannot load its audio processor ({exc})") from exc
    voxtral = family == "voxtral"  # a Tekken tokenizer (mistral_common), no chat template
    if not hasattr(processor, "tokenizer") or not (voxtral or getattr(processor, "chat_template", None)):
        raise ValueError(f"{folder}: its processor has no chat template; audio prompts need one")
    if voxtral and not hasattr(processor.tokenizer, "tokenizer"):
        raise ValueError(f"{folder}: Voxtral's prompts need its tekken.json (read through mistral_common)")
    encoder = load_audio_encoder(folder, device=device, dtype=dtype)
    try:
        mistral = VoxtralPrompts(processor.tokenizer, encoder) if voxtral else None
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from exc
    worker = EncoderWorker(encoder.encode, EncoderCache(ENCODER_CACHE_BYTES), name=f"audio-{family}", device=device)
    return AudioInputPart(family, encoder, worker, processor, model_key, mistral)


class AudioPromptBuilder(MediaPromptBuilder):
    """Turns of text and audio parts -> the chat template's prompt, markers expanded, one segment per clip."""

    def __init__(self, audio: AudioInputPart) -> None:
        self.audio = audio

    def tool_format(self) -> ToolFormat | None:
        """The call format the checkpoint's prompts write; None when they render no tools (Qwen2-Audio's template)."""
        if self.audio.mistral is not None:
            return self.audio.mistral.tool_format()
        template = media_template(self.audio.processor)
        return format_of(None, template) if template is not None else None

    def build(
        self, contents: Sequence[content_pb2.Content], tools: list[dict] | None = None, cache_salt: str = ""
    ) -> Prompt:
        """`tools`: the request's tools (a list, maybe empty; None: no tools nor tool turns) for the template
        (services/processing/tools.py); tool results and assistant calls are turns of their own, their text one string.
        `cache_salt`: the share of the encoder cache the clips use (services/processing/cache_salt.py)."""
        audio = self.audio
        marker = audio.marker_text()
        messages: list[dict] = []
        clips = []
        bad: list[FieldViolation] = []
        for i, content in enumerate(contents):
            parts: list[dict] = []
            for j, part in enumerate(content.parts):
                path = f"contents[{i}].parts[{j}]"
                kind = part.WhichOneof("kind")
                if kind == "text":
                    if marker and marker in part.text:
                        bad.append(FieldViolation(f"{path}.text", f"must not contain the audio marker {marker!r}"))
                    parts.append({"type": "text", "text": part.text})
                elif kind == "audio":
                    try:
                        clips.append(audio.decode(part.audio, f"{path}.audio").samples)
                    except errors.ServiceError as err:
                        bad.extend(err.field_violations)
                    parts.append({"type": "audio"})
            messages.append({"role": role_of(content), "content": tool_turn_content(content, parts)})
            messages[-1].update(turn_fields(content))
        if bad:
            raise errors.invalid_argument(bad)
        try:
            ids = audio.render(messages, tools=tools)
        except ValueError as exc:  # mistral_common refuses a conversation it cannot write (Voxtral)
            if audio.mistral is None:
                raise
            raise errors.invalid_argument([FieldViolation("contents", str(exc))]) from exc
        return audio.prompt(ids, clips, cache_salt=cache_salt)


def log_message_limit(model, limit: int) -> None:
    """Audio arrives inline: say so when the gRPC message limit, not the model's audio limit, decides how large a
    clip may be (a larger request gets RESOURCE_EXHAUSTED from gRPC itself, before any handler runs)."""
    audio = model.bundle.audio if model.bundle is not None else None
    if audio is not None and audio.limits.max_bytes >= limit:
        log.info(
            "%s accepts audio parts of up to %d MiB; requests are limited to %d MiB (--max-message-mib)",
            model.name,
            audio.limits.max_bytes >> 20,
            limit >> 20,
        )
