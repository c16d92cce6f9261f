"""Image input for vision-language bundles (LLaVA 1.5/NeXT, SmolVLM/Idefics3, Qwen2-VL, Qwen2.5-VL, Gemma 3): the
bundle part and its PromptBuilder.

The steps of models/vision/base.py's contract, for each image part of a request, off the event loop (the prompt is
built in a worker thread):
  bytes -> `decode_image` (guarded: format allow-list, header-checked pixel count, aspect, smallest side; an
  ImageDecodeError -> INVALID_ARGUMENT on `contents[i].parts[j].image`) -> `enc.preprocess` (the checkpoint's own
  processor, within the request's `max_pixels`) -> a content key (hash of the bytes + feature settings + max_pixels +
  model). The chat template writes one marker per image; `expand_prompt` replaces it with the image's placeholders and
  `feature_runs` gives the runs its feature rows fill: one EmbeddingSegment per run, whose source is a slice of the
  image's features in the bundle's EncoderWorker (SmolVLM writes text between an image's tiles, so one image fills
  several runs; the other families fill one). The encoder runs only when the engine admits the request and the prefix
  cache does not already cover the run; images of requests admitted together are encoded in one batch.
Qwen2-VL's and Qwen2.5-VL's prompts carry M-RoPE positions (`enc.rope_positions`), passed to `engine.stream`.
Gemma 3's rendered text goes through `enc.expand_text` before it is tokenized (its processor's newlines, and
pan-and-scan sentences, around each image), and its segments are `bidirectional` (an image's tokens attend to each other both ways during prefill).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omnivox.codecs.image import ImageDecodeError, ImageLimits, RequestPixelsError, decode_image, image_content_key
from omnivox.engine import EmbeddingSegment
from omnivox.engine.encoder_cache import EncodeHandle, EncoderCache, EncoderWorker
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.output.tool_parser import ToolFormat
from omnivox.services.processing.prompt import MediaPromptBuilder, Prompt, role_of
from omnivox.services.processing.tool_formats import format_of, media_template
from omnivox.services.processing.tools import tool_turn_content, turn_fields
from omnivox.v1 import content_pb2

if TYPE_CHECKING:  # models.vision's modules import transformers' processing utilities (~1.5 s): at load, if needed
    from omnivox.models.vision import ImageInputs, VisionEncoder

log = logging.getLogger(__name__)

# Encoded images kept for reuse (`serve --image-cache-mib`). LLaVA-1.5-7B: 576 x 4096 fp16 = 4.5 MiB per image;
# Qwen2.5-VL-3B at 1 MP: ~1300 x 2048 bf16 = 5 MiB; so 256 MiB holds ~50 images.
IMAGE_CACHE_BYTES = 256 << 20


class SlicedSource:
    """One run of an image's features: rows [offset, offset + n) of the image's entry in the encoder cache.

    Each run holds its own cache reference (the engine releases every segment), so the entry lives while any run of
    any request still needs it; the image is encoded once however many runs ask for it.
    """

    def __init__(self, handle: EncodeHandle, offset: int, n: int) -> None:
        self._handle, self._offset, self._n = handle, offset, n

    def start(self) -> None:
        self._handle.start()

    def ready(self) -> bool:
        return self._handle.ready()

    def failed(self) -> bool:
        return self._handle.failed()

    @property
    def encoded(self) -> tuple[float, float] | None:
        return self._handle.encoded

    def result(self) -> torch.Tensor:
        features = self._handle.result()  # [num_features, hidden]
        if self._offset == 0 and self._n == features.shape[0]:
            return features
        return features[self._offset : self._offset + self._n]  # [n, hidden], a view of the cached tensor

    def release(self) -> None:
        self._handle.release()


@dataclass
class ImageInputPart:
    """The vision side of a bundle: the encoder (tower + projector + the checkpoint's processor), its worker and
    cache, the decoding limits, and the name that keys its features."""

    encoder: VisionEncoder
    worker: EncoderWorker
    model_key: str  # names the model in content keys (features of two models must never share an entry)
    limits: ImageLimits = field(default_factory=ImageLimits)
    _settings: dict | None = None

    @property
    def cache(self) -> EncoderCache:
        return self.worker.cache

    @property
    def family(self) -> str:
        return self.encoder.family

    @property
    def processor(self) -> Any:
        return self.encoder.processor

    def feature_settings(self) -> dict:
        if self._settings is None:  # the processor's configuration never changes once loaded
            self._settings = self.encoder.feature_settings()
        return self._settings

    def decode(self, part: content_pb2.ImagePart, path: str, pixels_before: int = 0) -> tuple[ImageInputs, str, int]:
        """One ImagePart -> (the processor's inputs, the content key, its decoded pixels); INVALID_ARGUMENT on `path`
        when refused. `pixels_before`: the pixels of the request's images before it (`ImageLimits.max_request_pixels`
        is checked on its header, before it is decoded)."""
        max_pixels = part.max_pixels if part.HasField("max_pixels") else None
        if max_pixels is not None and not 1 <= max_pixels <= self.limits.max_pixels:
            raise errors.invalid_argument(
                [FieldViolation(f"{path}.max_pixels", f"must be in [1, {self.limits.max_pixels}], got {max_pixels}")]
            )
        if max_pixels is not None and self.encoder.max_pixels_refusal:
            why = self.encoder.max_pixels_refusal
            raise errors.invalid_argument([FieldViolation(f"{path}.max_pixels", f"not taken by this model: {why}")])
        try:
            decoded = decode_image(part.data, self.limits, part.mime_type or None, pixels_before)
        except ImageDecodeError as err:
            raise errors.invalid_argument([FieldViolation(path, err.reason)]) from err
        try:
            item = self.encoder.preprocess([decoded.image], max_pixels)[0]
        except (ValueError, RuntimeError) as exc:  # e.g. a processor that cannot resize an extreme aspect ratio
            raise errors.invalid_argument([FieldViolation(path, f"the image processor refused it: {exc}")]) from exc
        need, budget = self.encoder.feature_bytes(item), self.cache.budget_bytes
        if need > budget:
            raise errors.invalid_argument(
                [FieldViolation(path, f"its features take {need} bytes, above the encoder cache's {budget}")]
            )
        key = image_content_key(part.data, self.model_key, {**self.feature_settings(), "max_pixels": max_pixels})
        return item, key, decoded.width * decoded.height

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, items: Sequence[ImageInputs] = ()
    ) -> list[int]:
        """Chat messages -> token ids through the checkpoint's template (one marker per image, not yet expanded).
        `tools` (a list, maybe empty, for a request with tools or tool turns): through the template that renders them
        (`tool_formats.media_template`).

        `items`: the images in order, for a family whose processor writes text around each (`expand_text`).

        Tokenized as transformers' `ProcessorMixin.apply_chat_template(tokenize=True)` does: with the tokenizer's
        special tokens unless the rendered text already starts with its BOS. llava-1.5-hf's and LLaVA-NeXT-Mistral's
        templates write no BOS and their Llama/Mistral tokenizers add one; without it the prompt lost its first token.
        """
        tool_kwargs = {} if tools is None else {"tools": tools or None, "chat_template": media_template(self.processor)}
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tool_kwargs)
        text = self.encoder.expand_text(text, items)
        tok = self.processor.tokenizer
        add_special = not (tok.bos_token is not None and text.startswith(tok.bos_token))
        return list(tok(text, add_special_tokens=add_special).input_ids)

    def prompt(
        self,
        token_ids: list[int],
        images: Sequence[tuple[ImageInputs, str]],
        field: str = "contents",
        cache_salt: str = "",
    ) -> Prompt:
        """Expand the markers of `token_ids` and attach one segment per feature run of each image (its features
        shared only with prompts of the same `cache_salt`).

        A prompt whose markers do not match the images is INVALID_ARGUMENT on `field`. Encoder-cache references are
        taken last, so a refused prompt holds none; the engine drops them when the request ends (`Prompt.release`
        for a prompt never queued).
        """
        enc = self.encoder
        items = [item for item, _ in images]
        try:
            ids = enc.expand_prompt(token_ids, items)
            runs = enc.feature_runs(ids, items)
        except ValueError as exc:
            raise errors.invalid_argument([FieldViolation(field, f"the image markers do not match: {exc}")]) from exc
        rope = enc.rope_positions(ids, items)
        segments: list[EmbeddingSegment] = []
        try:
            for (item, key), image_runs in zip(images, runs, strict=True):
                offset = 0
                for start, n in image_runs:
                    source = SlicedSource(self.worker.handle(key, item, cache_salt), offset, n)
                    # The run's own key: two runs of one image are different content for the prefix cache.
                    run_key = key if len(image_runs) == 1 else f"{key}:{offset}"
                    try:
                        segments.append(
                            EmbeddingSegment(
                                start, n, key=run_key, source=source, bidirectional=enc.bidirectional_images
                            )
                        )
                    except BaseException:
                        source.release()
                        raise
                    offset += n
        except BaseException:  # no reference may outlive a prompt that was never returned
            Prompt(token_ids=ids, segments=segments).release()
            raise
        return Prompt(token_ids=ids, segments=segments, rope_positions=rope)

    def reserved_texts(self) -> tuple[str, ...]:
        """Token strings user text must not spell (they would smuggle in a marker or a placeholder, or a video pad)."""
        tok = self.processor.tokenizer
        names = {self.encoder.marker_token, *self.encoder.reserved_tokens}
        names.add(tok.convert_ids_to_tokens(self.encoder.placeholder_token_id))
        return tuple(sorted(n for n in names if n))

    def close(self) -> None:
        self.worker.shutdown()


def vision_family(folder: Path) -> str | None:
    """The vision family of a checkpoint folder (its config's `model_type`), or None when it has no vision encoder
    we serve. Reads config.json only."""
    import json

    from omnivox.models.vision import FAMILIES

    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in FAMILIES else None


def load_image_part(
    folder: Path,
    device: Any,
    dtype: Any,
    model_key: str,
    cache_bytes: int = IMAGE_CACHE_BYTES,
    limits: ImageLimits | None = None,
) -> ImageInputPart:
    """Encoder, worker and cache of the vision-language checkpoint in `folder` (blocking). ValueError when the
    folder lacks what image input needs (a processor with a chat template)."""
    from omnivox.models.vision import VisionEncoder

    try:
        encoder = VisionEncoder.from_folder(folder, device=device, dtype=dtype)
    except OSError as exc:  # transformers' "Can't load image processor ..." when preprocessor_config.json is missing
        reason = str(exc).splitlines()[0][:200]
        raise ValueError(f"{folder}: cannot load its image processor or vision weights ({reason})") from exc
    processor = encoder.processor
    if not getattr(processor, "chat_template", None) or not hasattr(processor, "tokenizer"):
        raise ValueError(f"{folder}: its processor has no chat template; image prompts need one")
    worker = EncoderWorker(encoder.encode, EncoderCache(cache_bytes), name=f"vision-{encoder.family}", device=device)
    return ImageInputPart(encoder, worker, model_key, limits or ImageLimits())


class ImagePromptBuilder(MediaPromptBuilder):
    """Turns of text and image parts (in any turn, several per turn) -> the chat template's prompt, markers expanded,
    one segment per feature run, and M-RoPE positions for Qwen2-VL / 2.5-VL."""

    def __init__(self, image: ImageInputPart, context_tokens: int | None = None) -> None:
        """context_tokens: the model's context; images whose placeholders alone fill it are refused as soon as
        that is known, before the rest are decoded and preprocessed (a large photo takes seconds in Qwen2.5-VL's
        processor: 16 of them would all be processed for a prompt the engine then refuses)."""
        self.image = image
        self.context_tokens = context_tokens

    def tool_format(self) -> ToolFormat | None:
        """The call format the checkpoint's template writes; None when it renders no tools (LLaVA's, SmolVLM's)."""
        template = media_template(self.image.processor)
        return format_of(None, template) if template is not None else None

    def build(
        self, contents: Sequence[content_pb2.Content], tools: list[dict] | None = None, cache_salt: str = ""
    ) -> Prompt:
        """`tools`: the request's tools (a list, maybe empty; None: no tools nor tool turns) for the template
        (services/processing/tools.py); tool results and assistant calls are turns of their own, their text one string.
        `cache_salt`: the share of the encoder cache the images use (services/processing/cache_salt.py)."""
        image = self.image
        reserved = image.reserved_texts()
        count = sum(1 for c in contents for p in c.parts if p.WhichOneof("kind") == "image")
        if count > image.limits.max_images:  # before decoding any of them
            raise errors.invalid_argument(
                [FieldViolation("contents", f"{count} images; at most {image.limits.max_images} per request")]
            )
        messages: list[dict] = []
        images: list[tuple[ImageInputs, str]] = []
        bad: list[FieldViolation] = []
        image_tokens = pixels = 0
        for i, content in enumerate(contents):
            parts: list[dict] = []
            for j, part in enumerate(content.parts):
                path = f"contents[{i}].parts[{j}]"
                kind = part.WhichOneof("kind")
                if kind == "text":
                    for r in reserved:
                        if r in part.text:
                            bad.append(FieldViolation(f"{path}.text", f"must not contain the media token {r!r}"))
                    parts.append({"type": "text", "text": part.text})
                elif kind == "image":
                    try:
                        item, key, size = image.decode(part.image, f"{path}.image", pixels)
                    except errors.ServiceError as err:
                        bad.extend(err.field_violations)
                        if isinstance(err.__cause__, RequestPixelsError):  # the images after it stay undecoded
                            raise errors.invalid_argument(bad) from err
                    else:
                        images.append((item, key))
                        pixels += size
                        image_tokens += len(images[-1][0].placeholder_ids)
                        if self.context_tokens is not None and image_tokens >= self.context_tokens:
                            raise errors.invalid_argument(
                                [
                                    FieldViolation(
                                        f"{path}.image",
                                        f"the images up to this one take {image_tokens} prompt tokens; the model's "
                                        f"context is {self.context_tokens} tokens (max_pixels lowers an image's count "
                                        "where the model's processor allows)",
                                    )
                                ]
                            )
                    parts.append({"type": "image"})
            messages.append({"role": role_of(content), "content": tool_turn_content(content, parts)})
            messages[-1].update(turn_fields(content))
        if bad:
            raise errors.invalid_argument(bad)
        return image.prompt(image.render(messages, tools, [it for it, _ in images]), images, cache_salt=cache_salt)
