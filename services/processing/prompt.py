"""From a request's validated `contents` to what the engine takes: prompt token ids (+ embedding segments).

A model's parts choose its PromptBuilder (services/parts/table.py): a part with a vision or audio encoder supplies a
MediaPromptBuilder that turns image and audio parts into placeholder tokens plus EmbeddingSegments through its own
template; text-only models use ChatPromptBuilder. Generate's processing (services/processing/generate_request.py) calls the three
methods every builder has, never asking which kind it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from omnivox.services.processing import reasoning, tools
from omnivox.services.processing.tool_formats import is_mistral_common
from omnivox.v1 import content_pb2, generation_pb2

if TYPE_CHECKING:
    import torch

    from omnivox.engine import EmbeddingSegment


@dataclass
class Prompt:
    token_ids: list[int]
    segments: list[EmbeddingSegment] = field(default_factory=list)
    # M-RoPE (Qwen2.5-VL): ([3, len(token_ids)] positions, generated-token delta) for `engine.stream`; None: 1-D.
    rope_positions: tuple[torch.Tensor, int] | None = None

    def encode_span(self) -> tuple[float, float] | None:
        """When this prompt's images / audio were encoded (time.monotonic() first start, last end), for tracing;
        None when every one came from a cache."""
        spans = [e for seg in self.segments if (e := getattr(seg.source, "encoded", None)) is not None]
        return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None

    def release(self) -> None:
        """Drop the segments' encoder-cache references: for a prompt the engine never queued (a queued request's
        segments are released by the engine when it ends). Releasing twice is harmless."""
        for segment in self.segments:
            segment.release()


class PromptBuilder(Protocol):
    """What Generate asks of a model's prompt builder. `contents` already passed validation: roles are known, every
    part is of a kind the model accepts."""

    def media_tool_format(self, request: generation_pb2.GenerateRequest) -> tools.ToolFormat | None:
        """The call format the builder's own template writes (services/processing/tools.py media_format); None for a builder
        whose tools the tokenizer's chat template renders (tools.plan reads it there)."""
        ...

    def template_kwargs(self, request: generation_pb2.GenerateRequest, tokenizer: Any) -> dict[str, Any]:
        """The chat-template arguments the request sets (services/processing/reasoning.py template_kwargs)."""
        ...

    def build_request_prompt(
        self,
        contents: Sequence[content_pb2.Content],
        tool_plan: tools.ToolPlan | None,
        template_kwargs: dict[str, Any],
        cache_salt: str,
    ) -> Prompt:
        """The prompt (blocking: run it in a worker thread). `cache_salt`: the share of the encoder cache its images
        and audio use (engine/encoder_cache.py `EncoderWorker.handle`)."""
        ...


class MediaPromptBuilder:
    """A builder whose own template renders the turns with their images or audio, and tools where it can
    (`tool_format`, when a subclass has one). Subclasses define `build(contents, tools, cache_salt=...)`."""

    def build(self, contents: Sequence[content_pb2.Content], tools: list[dict] | None = None, cache_salt: str = ""):
        raise NotImplementedError

    def media_tool_format(self, request: generation_pb2.GenerateRequest) -> tools.ToolFormat | None:
        return tools.media_format(request, self)

    def template_kwargs(self, request: generation_pb2.GenerateRequest, tokenizer: Any) -> dict[str, Any]:
        return reasoning.template_kwargs(request, tokenizer, text_prompt=False)

    def build_request_prompt(
        self,
        contents: Sequence[content_pb2.Content],
        tool_plan: tools.ToolPlan | None,
        template_kwargs: dict[str, Any],
        cache_salt: str,
    ) -> Prompt:
        return self.build(contents, tool_plan.tools if tool_plan is not None else None, cache_salt=cache_salt)


def role_of(content: content_pb2.Content) -> str:
    return content.role or "user"


class ChatPromptBuilder:
    """Text turns through the tokenizer's chat template (mistral_common's for a tekken.json tokenizer); without a
    template, the turns' text joined by newlines."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def build(self, contents: Sequence[content_pb2.Content], template_kwargs: dict[str, Any] | None = None) -> Prompt:
        """`template_kwargs`: further chat-template arguments (Qwen3's `enable_thinking`)."""
        messages = [
            {"role": role_of(c), "content": "\n".join(p.text for p in c.parts if p.WhichOneof("kind") == "text")}
            for c in contents
        ]
        if is_mistral_common(self.tokenizer):
            # tekken.json (Mistral Small 3.2, Devstral, Magistral as Mistral ships them): no chat template;
            # mistral_common writes the turns, ids straight away (its special tokens are not read back from text)
            continue_final = bool(messages) and messages[-1]["role"] == "assistant"
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=False, continue_final_message=continue_final
            )
        elif self.has_chat_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=True)
        return Prompt(token_ids=list(ids))

    def media_tool_format(self, request: generation_pb2.GenerateRequest) -> tools.ToolFormat | None:
        return None  # the tokenizer's chat template renders the tools (tools.plan)

    def template_kwargs(self, request: generation_pb2.GenerateRequest, tokenizer: Any) -> dict[str, Any]:
        return reasoning.template_kwargs(request, tokenizer, text_prompt=True)

    def build_request_prompt(
        self,
        contents: Sequence[content_pb2.Content],
        tool_plan: tools.ToolPlan | None,
        template_kwargs: dict[str, Any],
        cache_salt: str,
    ) -> Prompt:
        if tool_plan is not None:  # tools and tool turns through the tokenizer's chat template (text turns)
            return Prompt(token_ids=tools.prompt_ids(self.tokenizer, contents, tool_plan, template_kwargs))
        return self.build(contents, template_kwargs or None)
