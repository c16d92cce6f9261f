"""Generate's request processing: a wire GenerateRequest -> what the engine takes (GenerateJob).

Two steps, with the admission between them (services/grpc_api/generation.py):
- `check(request, registry)`: sizes, the cache salt, the model, the cascade (a spoken question transcribed first by
  `--asr-model`), the field checks -> a CheckedGenerate; nothing is held yet;
- `process(checked)`, once admitted: response_format and tool grammars, the tool plan, the reasoning gate, the prompt
  (built in a worker thread) -> a GenerateJob whose `stream()` is the engine request.

Every refusal is a ServiceError carrying FieldViolations (services/errors.py), so any front can report it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from omnivox.engine import RequestOutput, SamplingParams
from omnivox.services import errors
from omnivox.services.errors import FieldViolation, ServiceError
from omnivox.services.limits import check_generate_limits
from omnivox.services.parts.registry import ModelRegistry, ServedModel
from omnivox.services.processing import cascade, reasoning, structured, tools, validation
from omnivox.services.processing.cache_salt import request_salt
from omnivox.services.processing.prompt import Prompt
from omnivox.v1 import generation_pb2


@dataclass
class CheckedGenerate:
    """A request whose sizes and fields passed, for a ready model; not yet admitted."""

    request: generation_pb2.GenerateRequest  # with a spoken question's audio replaced by its transcript (cascade)
    model: ServedModel
    params: SamplingParams
    salt: str  # this caller's (and cache_salt's) share of the caches (services/processing/cache_salt.py)
    # A completion's prompt text, tokenised as it is (no chat template): HTTP /v1/completions. None: the contents.
    raw_prompt: str | None = None


@dataclass
class GenerateJob:
    """What the engine takes for one Generate, and what output processing needs to read its outputs back."""

    model: ServedModel
    prompt: Prompt
    params: SamplingParams
    salt: str
    request_id: str  # the client's, or the engine request's when it sent none
    engine_request_id: str  # ours, so that clients reusing an id cannot collide in the engine
    tool_output: tools.ToolOutput | None  # content and tool_calls re-read from the answer so far
    reasoning_output: reasoning.ReasoningOutput | None  # a reasoning model's thinking goes to reasoning_text

    def stream(self) -> AsyncIterator[RequestOutput]:
        """The engine request; closing it aborts the request and frees its KV blocks at once."""
        assert self.model.engine is not None
        return self.model.engine.stream(
            self.prompt.token_ids,
            self.params,
            request_id=self.engine_request_id,
            segments=self.prompt.segments or None,
            rope_positions=self.prompt.rope_positions,
            cache_salt=self.salt,
        )


async def check(request: generation_pb2.GenerateRequest, registry: ModelRegistry) -> CheckedGenerate:
    """Sizes first (a huge request costs one length check), then the model, the cascade and the fields."""
    if too_large := check_generate_limits(request):
        raise errors.invalid_argument(too_large)
    salt = request_salt(request.cache_salt)
    model = registry.get_ready(request.model)
    if cascade.applies(request, model, registry):  # a spoken question: transcribed first (--asr-model)
        request = await cascade.transcribe_audio_parts(request, registry, salt)
    checked = validation.validate_generate(request, model)
    return CheckedGenerate(request, model, checked.params, salt)


async def process(checked: CheckedGenerate, phase: Callable[[str, float, float], None]) -> GenerateJob:
    """Grammars, tools, reasoning and the prompt of an admitted request. `phase(name, start, end)` records the
    prompt's building time (tracing)."""
    request, model, params, salt = checked.request, checked.model, checked.params, checked.salt
    assert model.engine is not None and model.bundle is not None and model.prompt_builder is not None
    grammars, builder, tokenizer = model.bundle.grammars, model.prompt_builder, model.engine.tokenizer
    await structured.constrain(request, params, grammars, salt)  # compiled off the loop, cached per salt
    # A vision or audio model's own template renders the tools with its images and audio (None: text model)
    tool_plan = tools.plan(request, tokenizer, builder.media_tool_format(request))
    await tools.constrain(tool_plan, params, grammars, salt)
    tool_output = tools.ToolOutput(tool_plan) if tool_plan is not None and tool_plan.parses_calls else None
    template_kwargs = builder.template_kwargs(request, tokenizer)
    started = time.monotonic()
    if checked.raw_prompt is not None:
        prompt = Prompt(token_ids=list(tokenizer.encode(checked.raw_prompt, add_special_tokens=True)))
    else:
        prompt = await build_prompt(model, request, tool_plan, template_kwargs, salt)
    phase("prompt", started, time.monotonic())  # tokenise; decode and preprocess images and audio
    try:
        validation.check_prompt_fits(len(prompt.token_ids), params, model)
    except ServiceError:
        prompt.release()  # never queued: its encoder-cache references are ours to drop
        raise
    engine_request_id = uuid.uuid4().hex
    return GenerateJob(
        model=model,
        prompt=prompt,
        params=params,
        salt=salt,
        request_id=request.request_id or engine_request_id,
        engine_request_id=engine_request_id,
        tool_output=tool_output,
        reasoning_output=reasoning_gate(tokenizer, prompt, params),
    )


def reasoning_gate(tokenizer: Any, prompt: Prompt, params: SamplingParams) -> reasoning.ReasoningOutput | None:
    """A reasoning model's thinking goes to reasoning_text; grammars and tool calls hold for the answer only."""
    if (tags := reasoning.tags_of(tokenizer)) is None:
        return None
    start = reasoning.start_of(tokenizer, prompt.token_ids, tags)
    if tags.special:  # Magistral's [THINK] / [/THINK]: dropped from the text by the usual decoding
        params.skip_special_tokens = False
    if params.constraint_factory is not None:
        params.constraint_factory = reasoning.gate(params.constraint_factory, tags, start)
    return reasoning.ReasoningOutput(tags, start)


async def build_in_thread(build: Callable[..., Prompt], *args: Any) -> Prompt:
    """`build(*args)` in a worker thread. A call cancelled meanwhile (client gone, deadline) cannot stop the thread:
    the prompt it still builds releases its encoder-cache references when it is done."""
    task = asyncio.ensure_future(asyncio.to_thread(build, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def release(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                t.result().release()

        task.add_done_callback(release)
        raise


async def build_prompt(
    model: ServedModel,
    request: generation_pb2.GenerateRequest,
    tool_plan: tools.ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
    salt: str = "",
) -> Prompt:
    """`salt` names the share of the encoder cache the images and audio of a media model's prompt use."""
    builder = model.prompt_builder
    assert builder is not None
    try:  # in a worker thread: a long prompt (or decoding audio and images) must not stall the other streams
        build = functools.partial(builder.build_request_prompt, cache_salt=salt)
        return await build_in_thread(build, request.contents, tool_plan, template_kwargs or {})
    except ServiceError:
        raise
    except Exception as exc:  # e.g. a chat template that refuses a role order: the request's fault
        raise errors.invalid_argument([FieldViolation("contents", f"cannot build the prompt: {exc}")]) from exc
