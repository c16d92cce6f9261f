"""Reasoning models (Qwen3, DeepSeek-R1, QwQ: thinking between `<think>` and `</think>`): the thinking apart from the
answer, structured output and tool calls for the answer only, and the chat template's thinking switch.

As vLLM's and SGLang's reasoning parsers, but chosen from the model (its chat template writes `</think>`, both tags
are single tokens the decoder keeps in the text), not by a flag:
- Where the output starts is read from the prompt's end: after `<think>` (DeepSeek-R1, Qwen3-Thinking-2507) it starts
  thinking; after `</think>` (Qwen3 with enable_thinking false writes an empty block) it is all answer; otherwise
  (Qwen3's default) it thinks if its first token is `<think>`.
- `ReasoningOutput` splits the text so far into (reasoning, answer), a pure function of the text (so the deltas are
  the same however the tokens were chunked); the answer is what tool-call parsing reads.
- `ReasoningGate` wraps the request's constraint (response_format or tool grammar): every token is allowed while the
  model thinks, the grammar from the first answer token. Before, the grammar held from the first token: a JSON
  answer or a required call could never be thought about first (`<think>` was masked), and in `auto` a `<tool_call>`
  written while thinking armed the call grammar.

Magistral (Mistral tokenizer v13) thinks between `[THINK]` and `[/THINK]`: special tokens that decoding as usual
drops, so its requests decode with them kept (`ThinkTags.special`); chosen when its chat template writes `[/THINK]`
or, for a tekken.json folder (no template), when mistral_common's tokenizer has both tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from omnivox.engine.detokenizer import skipped_token_ids
from omnivox.engine.params import ConstraintFactory, TokenConstraint
from omnivox.services import errors
from omnivox.services.errors import FieldViolation
from omnivox.services.processing.tool_formats import is_mistral_common
from omnivox.v1 import generation_pb2

THINK, END = "<think>", "</think>"
MISTRAL_THINK, MISTRAL_END = "[THINK]", "[/THINK]"


class Start(enum.Enum):
    THINKING = "thinking"  # the prompt ends with <think>
    ANSWER = "answer"  # the prompt ends with </think>: no reasoning in this output
    EITHER = "either"  # thinking if the first token is <think>


@dataclass(frozen=True)
class ThinkTags:
    think_id: int
    end_id: int
    think: str = THINK  # the tags' text
    end: str = END

    @property
    def special(self) -> bool:
        """Special tokens (Magistral's): the request decodes with skip_special_tokens off, or the text loses them."""
        return self.think == MISTRAL_THINK


def tags_of(tokenizer: Any) -> ThinkTags | None:
    """The model's think tags when its chat template writes them and they are single tokens kept in decoded text, or
    Magistral's `[THINK]` / `[/THINK]` (single special tokens, kept by the request's decoding)."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if END not in template:
        if MISTRAL_END not in template and not _mistral_common_thinks(tokenizer):
            return None
        think_id, end_id = _token_id(tokenizer, MISTRAL_THINK), _token_id(tokenizer, MISTRAL_END)
        return None if think_id is None or end_id is None else ThinkTags(think_id, end_id, MISTRAL_THINK, MISTRAL_END)
    think_id, end_id = _token_id(tokenizer, THINK), _token_id(tokenizer, END)
    if think_id is None or end_id is None or {think_id, end_id} & skipped_token_ids(tokenizer):
        return None  # several tokens each, or special ones decoding drops: the text could not tell
    return ThinkTags(think_id, end_id)


def _mistral_common_thinks(tokenizer: Any) -> bool:
    """A tekken.json tokenizer (transformers' MistralCommonBackend) whose instruct tokenizer writes thinking: v13 and
    later with both think tokens (mistral_common's InstructTokenizerV13 sets BEGIN_THINK only then)."""
    if not is_mistral_common(tokenizer):
        return False
    instruct = tokenizer.tokenizer.instruct_tokenizer
    return getattr(instruct, "BEGIN_THINK", None) is not None and getattr(instruct, "END_THINK", None) is not None


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one token (get_vocab() copies the whole vocabulary: per request, no)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token else None


def template_kwargs(request: generation_pb2.GenerateRequest, tokenizer: Any, text_prompt: bool) -> dict[str, Any]:
    """The chat-template arguments the request sets (`enable_thinking`); INVALID_ARGUMENT when thinking cannot be
    turned off for this model. `text_prompt`: the prompt is built from the tokenizer's template (text models)."""
    if not request.HasField("enable_thinking"):
        return {}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if text_prompt and "enable_thinking" in template:
        return {"enable_thinking": request.enable_thinking}
    if not request.enable_thinking:  # silently ignored, the model would think all the same
        why = "this model's chat template has no thinking switch (enable_thinking)"
        raise errors.invalid_argument([FieldViolation("enable_thinking", why)])
    return {}  # true: what the model does anyway


def start_of(tokenizer: Any, prompt_ids: list[int], tags: ThinkTags | None = None) -> Start:
    think, end = (tags.think, tags.end) if tags is not None else (THINK, END)
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    if tail.endswith(think):
        return Start.THINKING
    if tail.endswith(end):
        return Start.ANSWER
    return Start.EITHER


def split(text: str, start: Start, final: bool = False, tags: ThinkTags | None = None) -> tuple[str, str]:
    """(reasoning, answer) so far. Held back until the text says more: whitespace that may precede `<think>`, and a
    partial `</think>` at the end of the reasoning. The answer starts at its first non-whitespace character.
    `tags`: the tags' text (default `<think>` / `</think>`)."""
    think, close = (tags.think, tags.end) if tags is not None else (THINK, END)
    if start is Start.ANSWER:
        return "", text
    begin = 0
    if start is Start.EITHER:
        body = text.lstrip()
        if not body.startswith(think):
            if not final and think.startswith(body):  # "" or a partial tag: not known yet
                return "", ""
            return "", text
        begin = len(text) - len(body) + len(think)
    end = text.find(close, begin)
    if end < 0:
        held = 0 if final else _partial_suffix(text, close)
        return text[begin : len(text) - held], ""
    return text[begin:end], text[end + len(close) :].lstrip()


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningOutput:
    """Generate's view of a reasoning model's output: the thinking into `reasoning_text`, the answer into `text`."""

    def __init__(self, tags: ThinkTags, start: Start) -> None:
        self.tags, self.start = tags, start
        self.sent_reasoning = 0
        self.sent_answer = 0

    def rewrite(self, delta: generation_pb2.GenerateDelta, text: str, final: bool = False) -> str:
        """Set the delta's reasoning_text and text from the output so far; returns the answer so far."""
        reasoning, answer = split(text, self.start, final, self.tags)
        delta.reasoning_text = reasoning[self.sent_reasoning :]
        delta.text = answer[self.sent_answer :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_answer = max(self.sent_answer, len(answer))
        return answer

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """Output tokens spent thinking, through the closing tag (all of them if it never closed)."""
        if self.start is Start.ANSWER or not token_ids:
            return 0
        if self.start is Start.EITHER and token_ids[0] != self.tags.think_id:
            return 0
        return token_ids.index(self.tags.end_id) + 1 if self.tags.end_id in token_ids else len(token_ids)


class ReasoningGate:
    """A constraint that holds only for the answer: every token is allowed while the model thinks, then the inner
    constraint (a grammar) from the token after `</think>`. With Start.EITHER the first token may be `<think>` or
    the answer's first token. Token-exact: the tags are single tokens."""

    def __init__(self, inner: TokenConstraint, tags: ThinkTags, start: Start) -> None:
        self.inner, self.tags, self.start = inner, tags, start
        self.tokens: list[int] = []  # every advanced token
        self.answer_from: int | None = 0 if start is Start.ANSWER else None  # index in tokens where the answer starts

    def _answer_start(self, tokens: list[int], since: int = 0) -> int | None:
        """Where the answer starts in `tokens` (None: still thinking); `</think>` is looked for from `since` on (an
        advance looks at its new tokens only: a scan of the whole trace per step was O(length))."""
        if self.start is Start.ANSWER:
            return 0
        if self.start is Start.EITHER and tokens and tokens[0] != self.tags.think_id:
            return 0
        try:
            return tokens.index(self.tags.end_id, since) + 1
        except ValueError:
            return None

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor | None:
        if self.answer_from is not None:
            return self.inner.allowed(output_token_ids[self.answer_from :])
        if self.start is Start.EITHER and not self.tokens:
            mask = self.inner.allowed([])  # the answer's first token, or <think>
            if mask is None:
                return None
            mask = mask.clone()  # the inner constraint reuses its mask
            mask[self.tags.think_id] = True
            return mask
        return None  # thinking: anything

    @property
    def active_grammar(self) -> TokenConstraint | None:
        """The inner constraint while its mask is needed (engine/structured.py fills it with the batch's)."""
        thinking = self.answer_from is None and not (self.start is Start.EITHER and not self.tokens)
        return None if thinking else self.inner

    @property
    def must_end(self) -> bool:
        return self.answer_from is not None and bool(getattr(self.inner, "must_end", False))

    def advance(self, token_ids: list[int]) -> None:
        before = len(self.tokens)
        self.tokens.extend(token_ids)
        if self.answer_from is None:
            self.answer_from = self._answer_start(self.tokens, before)
        if self.answer_from is not None:
            fed = self.tokens[max(self.answer_from, before) :]
            if fed and hasattr(self.inner, "advance"):
                self.inner.advance(fed)

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        kept = len(self.tokens) - num_tokens
        if self.answer_from is not None:
            fed_back = len(self.tokens) - max(self.answer_from, kept)
            if fed_back > 0 and hasattr(self.inner, "rollback"):
                self.inner.rollback(fed_back)
        del self.tokens[kept:]
        if self.answer_from is not None and self.answer_from > kept:
            self.answer_from = self._answer_start(self.tokens)


def gate(factory: ConstraintFactory, tags: ThinkTags, start: Start) -> ConstraintFactory:
    """The request's constraint factory, its constraints holding for the answer only."""
    if start is Start.ANSWER:
        return factory
    return lambda: ReasoningGate(factory(), tags, start)
