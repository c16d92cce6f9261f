"""Generate's output processing: the engine's RequestOutputs -> GenerateResponses.

`GenerateOutput.delta(out)` writes one text delta (with its logprobs), re-read by the reasoning split
(services/processing/reasoning.py: reasoning_text and text) and the tool-call parser (services/processing/tools.py: content and tool_calls)
from the text so far; `finish(last)` checks how the request ended, and returns what was held back (whitespace, a
partial closing tag, a tool call's tail) and the summary, after recording metrics and the tracing phases.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from omnivox.engine import RequestOutput
from omnivox.engine.errors import ModelGroupBroken
from omnivox.services import errors
from omnivox.services.metrics import Metrics
from omnivox.services.output.summaries import finish_reason, seconds_to_duration
from omnivox.services.processing import validation
from omnivox.services.processing.generate_request import GenerateJob
from omnivox.v1 import generation_pb2

log = logging.getLogger(__name__)


class GenerateOutput:
    """The responses of one GenerateJob, from its first delta to its summary."""

    def __init__(self, job: GenerateJob, received: float, metrics: Metrics, call: Any) -> None:
        """`received`: when the request arrived (time.monotonic()); `call`: its log and tracing record
        (services/grpc_api/logs.py current_call)."""
        self.job, self.received, self.metrics, self.call = job, received, metrics, call
        engine = job.model.engine
        self.tokenizer = engine.tokenizer if engine is not None else None

    def delta(self, out: RequestOutput) -> generation_pb2.GenerateResponse | None:
        """The response for one engine output; None when it brought no new token."""
        if not (out.new_token_ids or out.new_text):
            return None
        response = self._delta(out)
        answer = out.text
        if self.job.reasoning_output is not None:  # reasoning_text and text re-read from the text so far
            answer = self.job.reasoning_output.rewrite(response.delta, out.text)
        if self.job.tool_output is not None:  # content and tool_calls re-read from the answer so far
            self.job.tool_output.rewrite(response, answer)
        return response

    def finish(self, last: RequestOutput | None) -> list[generation_pb2.GenerateResponse]:
        """The held-back tail (if any) and the summary; ServiceError when the request ended in an error."""
        job, model = self.job, self.job.model
        assert last is not None and last.finished, "the engine stream ended without a finished output"
        if last.error is not None:  # its own values left it nothing to sample (e.g. -inf biases on every token)
            raise validation.from_invalid_request(last.error)
        if last.finish_reason == "error":  # the engine failed this request's step and kept serving the others
            self.metrics.request_ended(model.name, "error")
            failure = model.engine.failure if model.engine is not None else None
            if isinstance(failure, ModelGroupBroken):  # a lost rank or node: the call can be retried elsewhere
                raise errors.unavailable(f"{model.name}: {failure}; the server is restarting")
            raise errors.internal("the engine failed while computing this request; see the server log")
        final = self._summary(last)
        answer = last.text
        tail = generation_pb2.GenerateDelta()
        if job.reasoning_output is not None:  # what was held back (whitespace, a partial closing tag) comes now
            answer = job.reasoning_output.rewrite(tail, last.text, final=True)
            final.summary.usage.reasoning_tokens = job.reasoning_output.reasoning_tokens(last.token_ids)
        if job.tool_output is not None:
            tool_tail = job.tool_output.flush(answer)
            tail.text = tool_tail.delta.text if tool_tail is not None else ""
            tail.tool_calls.extend(tool_tail.delta.tool_calls if tool_tail is not None else [])
            job.tool_output.complete(final, answer)
        self._record(last, final)
        held = (
            [generation_pb2.GenerateResponse(delta=tail)] if tail.text or tail.reasoning_text or tail.tool_calls else []
        )
        return [*held, final]

    def _record(self, last: RequestOutput, final: generation_pb2.GenerateResponse) -> None:
        """Metrics, the tracing phases (services/grpc_api/tracing.py) and the call's log fields."""
        job, call, name = self.job, self.call, self.job.model.name
        self.metrics.request_finished(name, last)
        scheduled = self.metrics.admission(name, job.engine_request_id)
        if scheduled is not None and last.first_token_time is not None:
            scheduled = min(max(scheduled, last.arrival_time), last.first_token_time)
            call.phase("queue", last.arrival_time, scheduled)
            call.phase("prefill", scheduled, last.first_token_time)
            call.phase("decode", last.first_token_time, time.monotonic())
        if (encoded := job.prompt.encode_span()) is not None:
            call.phase("encode", *encoded)  # the encoder worker's pass(es) for this request's images / audio
        call.set(
            request_id=final.summary.request_id,
            prompt_tokens=last.num_prompt_tokens,
            output_tokens=len(last.token_ids),
            cached_tokens=last.num_cached_tokens,
            finish_reason=last.finish_reason,
            ttft_s=round(final.summary.timing.time_to_first_token.ToNanoseconds() / 1e9, 6),
        )
        log.debug(
            "Generate %s model=%s prompt=%d output=%d cached=%d finish=%s total=%.3fs",
            final.summary.request_id,
            name,
            last.num_prompt_tokens,
            len(last.token_ids),
            last.num_cached_tokens,
            last.finish_reason,
            time.monotonic() - self.received,
        )

    def _delta(self, out: RequestOutput) -> generation_pb2.GenerateResponse:
        delta = generation_pb2.GenerateDelta(text=out.new_text, token_ids=out.new_token_ids)
        tokenizer = self.tokenizer

        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id]) if tokenizer is not None else ""

        for lp in out.new_logprobs or ():
            top = [generation_pb2.TopLogprob(token_id=t, token=token_text(t), logprob=p) for t, p in lp.top]
            delta.logprobs.append(
                generation_pb2.TokenLogprob(
                    token_id=lp.token_id, token=token_text(lp.token_id), logprob=lp.logprob, top_logprobs=top
                )
            )
        return generation_pb2.GenerateResponse(delta=delta)

    def _summary(self, out: RequestOutput) -> generation_pb2.GenerateResponse:
        now = time.monotonic()
        timing = generation_pb2.Timing(total=seconds_to_duration(now - self.received))
        if out.first_token_time is not None:
            timing.time_to_first_token.CopyFrom(seconds_to_duration(out.first_token_time - self.received))
        summary = generation_pb2.GenerateSummary(
            finish_reason=finish_reason(out.finish_reason),
            usage=generation_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                output_tokens=len(out.token_ids),
                cached_prompt_tokens=out.num_cached_tokens,
            ),
            timing=timing,
            request_id=self.job.request_id,
            model=self.job.model.name,
        )
        return generation_pb2.GenerateResponse(summary=summary)
