"""Which tool-call format a model writes: read from its chat template's text, or for a tekken.json tokenizer (no
template) from what mistral_common writes for an assistant's call. No grammar machinery here (services/processing/prompt.py and
services/processing/reasoning.py read `is_mistral_common` without importing llguidance); services/processing/tools.py builds on it."""

from __future__ import annotations

import weakref
from typing import Any

from omnivox.services.output.tool_parser import HERMES, LLAMA3, MISTRAL, MISTRAL_NEMO, MISTRAL_V11, ToolFormat


def format_of(tokenizer: Any, template: str | None = None) -> ToolFormat:
    """The call format the chat template writes: `template` (a multimodal processor's), else the tokenizer's."""
    if template is None:
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if not template and is_mistral_common(tokenizer):
            return mistral_common_format(tokenizer) or HERMES
    if "[TOOL_CALLS]" in template:  # Mistral's template writes calls back with its tag (a tokenizer that has the
        # token but a template without tools gets Hermes written into the text: prompt_ids)
        if "[ARGS]" in template:  # v11+: `[TOOL_CALLS]` + name + `[ARGS]` + arguments
            return MISTRAL_V11
        return MISTRAL_NEMO if "[TOOL_CALLS][" in template else MISTRAL
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3
    return HERMES


def is_mistral_common(tokenizer: Any) -> bool:
    """A tokenizer read from tekken.json through mistral_common (transformers' MistralCommonBackend), whose prompts
    mistral_common writes (no chat template)."""
    return hasattr(getattr(tokenizer, "tokenizer", None), "instruct_tokenizer")


# backend -> its format (None: mistral_common writes no calls we read); probed once per tokenizer
_MISTRAL_COMMON_FORMATS: weakref.WeakKeyDictionary[Any, ToolFormat | None] = weakref.WeakKeyDictionary()


def mistral_common_format(backend: Any) -> ToolFormat | None:
    """How mistral_common writes an assistant's calls for this tokenizer version: `[TOOL_CALLS]name[ARGS]{...}`
    (v11+; v11 puts `[CALL_ID]id` before `[ARGS]`), `[TOOL_CALLS][{...}]` (v3 to v7 Tekken) or `[TOOL_CALLS] [{...}]`
    (SentencePiece); None when it writes none of them. Read from a rendered call once per tokenizer (0.3 ms)."""
    if backend in _MISTRAL_COMMON_FORMATS:
        return _MISTRAL_COMMON_FORMATS[backend]
    call = {"id": "a" * 9, "type": "function", "function": {"name": "f", "arguments": {}}}
    probe = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a" * 9, "content": "r"},  # mistral_common ends on a user or tool turn
    ]
    fmt = None
    try:
        ids = backend.apply_chat_template(probe, tokenize=True, return_dict=False)
    except (ValueError, AssertionError):
        pass
    else:
        text = backend.decode(ids, skip_special_tokens=False)
        if "[TOOL_CALLS]f[ARGS]" in text or "[TOOL_CALLS]f[CALL_ID]" in text:
            fmt = MISTRAL_V11
        elif '[TOOL_CALLS][{"name"' in text:
            fmt = MISTRAL_NEMO
        elif '[TOOL_CALLS] [{"name"' in text:
            fmt = MISTRAL
    _MISTRAL_COMMON_FORMATS[backend] = fmt
    return fmt


def media_template(processor: Any) -> str | None:
    """The chat template that renders tools for a multimodal processor: its own when that renders tools, else its
    tokenizer's when that does (the hub's Qwen2.5-VL: chat_template.json renders none, tokenizer_config.json's does,
    and vLLM's chat API takes the tokenizer's for a request with tools); None when neither does."""
    for template in (getattr(processor, "chat_template", None), getattr(processor.tokenizer, "chat_template", None)):
        if isinstance(template, str) and "tools" in template:
            return template
    return None
