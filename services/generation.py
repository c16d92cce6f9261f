"""GenerationService: validate, build the prompt, stream the engine's output as deltas, end with one summary."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import duration_pb2

from omnivox.engine import RequestOutput
from omnivox.engine.errors import InvalidRequest, ModelGroupBroken
from omnivox.services import cascade, errors, reasoning, structured, tools, validation
from omnivox.services.cache_salt import request_salt
from omnivox.services.errors import FieldViolation, ServiceError, rpc_method
from omnivox.services.limits import check_generate_limits
from omnivox.services.logs import current_call
from omnivox.services.metrics import Metrics
from omnivox.services.prompt import Prompt
from omnivox.services.registry import ModelRegistry, ServedModel
from omnivox.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def seconds_to_duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


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


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, registry: ModelRegistry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics()

    @rpc_method
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        received = time.monotonic()
        if too_large := check_generate_limits(request):  # sizes first: a huge request costs one length check
            raise errors.invalid_argument(too_large)
        salt = request_salt(request.cache_salt)  # this caller's (and cache_salt's) share of the caches
        model = self.registry.get_ready(request.model)
        call = current_call()
        call.set(model=model.name)
        if cascade.applies(request, model, self.registry):  # a spoken question: transcribed first (--asr-model)
            request = await cascade.transcribe_audio_parts(request, self.registry, salt)
        checked = validation.validate_generate(request, model)
        # Admitted from here on: counted against the queue bound, and waited for by a drain.
        with model.admit():
            assert model.engine is not None and model.bundle is not None
            grammars = model.bundle.grammars  # response_format and tool grammars, cached per salt
            await structured.constrain(request, checked.params, grammars, salt)  # compiled off the loop
            builder = model.prompt_builder
            assert builder is not None
            # A vision or audio model's own template renders the tools with its images and audio (None: text model)
            tool_plan = tools.plan(request, model.engine.tokenizer, builder.media_tool_format(request))
            await tools.constrain(tool_plan, checked.params, grammars, salt)
            tool_output = tools.ToolOutput(tool_plan) if tool_plan is not None and tool_plan.parses_calls else None
            tokenizer = model.engine.tokenizer
            template_kwargs = builder.template_kwargs(request, tokenizer)
            built = time.monotonic()
            prompt = await self._build_prompt(model, request, tool_plan, template_kwargs, salt)
            call.phase("prompt", built, time.monotonic())  # tokenise; decode and preprocess images and audio
            try:
                validation.check_prompt_fits(len(prompt.token_ids), checked.params, model)
            except ServiceError:
                prompt.release()  # never queued: its encoder-cache references are ours to drop
                raise
            # A reasoning model's thinking goes to reasoning_text; grammars and tool calls hold for the answer only
            reasoning_output = None
            if (tags := reasoning.tags_of(tokenizer)) is not None:
                start = reasoning.start_of(tokenizer, prompt.token_ids, tags)
                reasoning_output = reasoning.ReasoningOutput(tags, start)
                if tags.special:  # Magistral's [THINK] / [/THINK]: dropped from the text by the usual decoding
                    checked.params.skip_special_tokens = False
                if checked.params.constraint_factory is not None:
                    checked.params.constraint_factory = reasoning.gate(checked.params.constraint_factory, tags, start)
            assert model.engine is not None
            engine_request_id = uuid.uuid4().hex  # ours, so that clients reusing an id cannot collide in the engine
            stream = model.engine.stream(
                prompt.token_ids,
                checked.params,
                request_id=engine_request_id,
                segments=prompt.segments or None,
                rope_positions=prompt.rope_positions,
                cache_salt=salt,
            )
            last: RequestOutput | None = None
            # Leaving this block in any way (finished, client cancelled, deadline passed, server stopping) closes the
            # engine stream, which aborts the request and frees its KV blocks at once.
            async with contextlib.aclosing(stream):
                try:
                    async for out in stream:
                        last = out
                        if out.new_token_ids or out.new_text:
                            response = self._delta(out, model)
                            answer = out.text
                            if reasoning_output is not None:  # reasoning_text and text re-read from the text so far
                                answer = reasoning_output.rewrite(response.delta, out.text)
                            if tool_output is not None:  # content and tool_calls re-read from the answer so far
                                tool_output.rewrite(response, answer)
                            await context.write(response)
                except InvalidRequest as err:  # raised by add_request, before the engine queued anything
                    prompt.release()
                    raise validation.from_invalid_request(err) from err
                except asyncio.CancelledError:  # client cancel, deadline, forced stop: the engine request aborts
                    self.metrics.request_ended(model.name, "abort")
                    raise
            assert last is not None and last.finished, "the engine stream ended without a finished output"
            if last.error is not None:  # its own values left it nothing to sample (e.g. -inf biases on every token)
                raise validation.from_invalid_request(last.error)
            if last.finish_reason == "error":  # the engine failed this request's step and kept serving the others
                self.metrics.request_ended(model.name, "error")
                if isinstance(model.engine.failure, ModelGroupBroken):  # a lost rank or node: retry elsewhere
                    raise errors.unavailable(f"{model.name}: {model.engine.failure}; the server is restarting")
                raise errors.internal("the engine failed while computing this request; see the server log")
            final = self._summary(last, model, request.request_id or engine_request_id, received)
            answer = last.text
            tail = generation_pb2.GenerateDelta()
            if reasoning_output is not None:  # what was held back (whitespace, a partial closing tag) comes now
                answer = reasoning_output.rewrite(tail, last.text, final=True)
                final.summary.usage.reasoning_tokens = reasoning_output.reasoning_tokens(last.token_ids)
            if tool_output is not None:
                tool_tail = tool_output.flush(answer)
                tail.text = tool_tail.delta.text if tool_tail is not None else ""
                tail.tool_calls.extend(tool_tail.delta.tool_calls if tool_tail is not None else [])
                tool_output.complete(final, answer)
            if tail.text or tail.reasoning_text or tail.tool_calls:
                await context.write(generation_pb2.GenerateResponse(delta=tail))
            self.metrics.request_finished(model.name, last)
            scheduled = self.metrics.admission(model.name, engine_request_id)
            if scheduled is not None and last.first_token_time is not None:  # tracing's spans (services/tracing.py)
                scheduled = min(max(scheduled, last.arrival_time), last.first_token_time)
                call.phase("queue", last.arrival_time, scheduled)
                call.phase("prefill", scheduled, last.first_token_time)
                call.phase("decode", last.first_token_time, time.monotonic())
            if (encoded := prompt.encode_span()) is not None:
                call.phase("encode", *encoded)  # the encoder worker's pass(es) for this request's images / audio
            call.set(
                request_id=final.summary.request_id,
                prompt_tokens=last.num_prompt_tokens,
                output_tokens=len(last.token_ids),
                cached_tokens=last.num_cached_tokens,
                finish_reason=last.finish_reason,
                ttft_s=round(final.summary.timing.time_to_first_token.ToNanoseconds() / 1e9, 6),
            )
            await context.write(final)
        log.debug(
            "Generate %s model=%s prompt=%d output=%d cached=%d finish=%s total=%.3fs",
            final.summary.request_id,
            model.name,
            last.num_prompt_tokens,
            len(last.token_ids),
            last.num_cached_tokens,
            last.finish_reason,
            time.monotonic() - received,
        )

    @staticmethod
    async def _build_prompt(
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

    @staticmethod
    def _delta(out: RequestOutput, model: ServedModel) -> generation_pb2.GenerateResponse:
        delta = generation_pb2.GenerateDelta(text=out.new_text, token_ids=out.new_token_ids)
        if out.new_logprobs:
            tokenizer = model.engine.tokenizer if model.engine is not None else None

            def token_text(token_id: int) -> str:
                return tokenizer.decode([token_id]) if tokenizer is not None else ""

            for lp in out.new_logprobs:
                delta.logprobs.append(
                    generation_pb2.TokenLogprob(
                        token_id=lp.token_id,
                        token=token_text(lp.token_id),
                        logprob=lp.logprob,
                        top_logprobs=[
                            generation_pb2.TopLogprob(token_id=t, token=token_text(t), logprob=p) for t, p in lp.top
                        ],
                    )
                )
        return generation_pb2.GenerateResponse(delta=delta)

    @staticmethod
    def _summary(
        out: RequestOutput, model: ServedModel, request_id: str, received: float
    ) -> generation_pb2.GenerateResponse:
        now = time.monotonic()
        timing = generation_pb2.Timing(total=seconds_to_duration(now - received))
        if out.first_token_time is not None:
            timing.time_to_first_token.CopyFrom(seconds_to_duration(out.first_token_time - received))
        summary = generation_pb2.GenerateSummary(
            finish_reason=FINISH_REASONS.get(out.finish_reason or "", generation_pb2.FINISH_REASON_UNSPECIFIED),
            usage=generation_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                output_tokens=len(out.token_ids),
                cached_prompt_tokens=out.num_cached_tokens,
            ),
            timing=timing,
            request_id=request_id,
            model=model.name,
        )
        return generation_pb2.GenerateResponse(summary=summary)
